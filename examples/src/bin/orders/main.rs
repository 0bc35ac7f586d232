//! `orders`: a small shop whose stock must never be oversold, even with
//! several instances behind a load balancer.
//!
//! ```sh
//! cargo run -p dlock-examples --bin orders                      # in process, 127.0.0.1:3000
//! DLOCK_BACKEND=redis DLOCK_REDIS_URL=redis://127.0.0.1:6379 \
//!   ORDERS_REDIS_URL=redis://127.0.0.1:6379 ORDERS_ADDR=127.0.0.1:3001 \
//!   cargo run -p dlock-examples --bin orders                    # one of several instances
//! ```
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `ORDERS_ADDR` | listen address (`:0` picks a free port) | `127.0.0.1:3000` |
//! | `ORDERS_REDIS_URL` | keep products and orders in this Redis (plain `GET`/`SET`, stock through `dlock_core::fence::redis`), shared by instances | in process |
//! | `ORDERS_POSTGRES_URL` | keep them in this PostgreSQL database instead (feature `postgres`; `pg.rs`): fenced stock, and the database patterns' routes | in process |
//! | `ORDERS_UNLOCKED` | `1`: no lock on the stock (shows the oversell) | off |
//! | `ORDERS_UNFENCED` | `1`: stock writes carry no fencing token (shows a holder whose lease ran out overselling) | off |
//! | `ORDERS_STOCK_WORK_MS` | how long a sale works between reading the stock and writing it | `2` |
//! | `ORDERS_CHARGES_UNGUARDED` | `1`: `POST /charges` without `IdempotencyLayer` (shows duplicates running twice; the torture harness's negative control) | off |
//! | `ORDERS_PAYMENT_LEASE_MS` | the lease of an in-progress payment (renewed while it runs): how long a crashed instance's payment blocks its `Idempotency-Key` before a retry runs it again | `10000` |
//! | `ORDERS_EXPORT_MS` | how long one `POST /users/{user}/export` works | `500` |
//! | `ORDERS_TOKEN_RATE` | `GET /idempotency/token` per second per client address (bursts of ten times that); beyond, `429 token_rate_limited` | `20` |
//! | `DLOCK_*` | the lock backend, see dlock-core's `Config` | in process |
//! | `RUST_LOG` | log filter | `info` |
//!
//! Routes:
//!
//! * `GET /health` → `{"status":"ok","backend":"memory|redis|redlock|zookeeper"}`
//! * `PUT /products/{id}` `{"stock": n}` → `{"id":id,"stock":n,"sold":0}`
//! * `GET /products/{id}` → `{"id":..,"stock":..,"sold":..}`, 404 when unknown
//! * `POST /stock/reduce` `{"product_id": id, "quantity": q}` → `{"product_id":..,"remaining":..}`,
//!   behind `LockLayer::new("product.stock").json("product_id")`; 409 `sold_out`; the
//!   stock write carries the lock's fencing token: a request whose lease ran
//!   out and whose lock another request took is `409 lock_token_stale`, nothing sold
//! * with `ORDERS_POSTGRES_URL`, the database's own patterns, no dlock lock
//!   (`docs/database-patterns.md`; `501 needs_postgres_store` on other stores):
//!   `POST /db/orders` `{"request_id": r, "product": {"id": id}, "quantity": q}` → 201
//!   (a unique index on `request_id`: a repeat answers 200 with the first order);
//!   `POST /db/stock/reduce-optimistic` and `POST /db/stock/reduce-for-update`
//!   `{"product_id": id, "quantity": q}` → `{"product_id":..,"remaining":..}` (a
//!   `version` column; `SELECT … FOR UPDATE`); 409 `sold_out`, 409 `stock_contended`
//! * `POST /orders?token=T` `{"product":{"id":id},"quantity":q}` → 201
//!   `{"order_id":..,"product_id":..,"quantity":..}`; `#[lockable]` on `order.create`
//!   by product and token; `T` comes from `GET /idempotency/token` and is
//!   spent once (`400 idempotency_token_missing`; `409 idempotency_token_unknown`
//!   once spent; `409 duplicate_submission` with `Retry-After` while the
//!   same order is running)
//! * `PUT /accounts/{id}` `{"balance": n}`, `GET /accounts/{id}` → `{"id":..,"balance":..}`
//! * `POST /transfers` `{"from": a, "to": b, "amount": n}` → `{"from":{"id","balance"},"to":{..}}`;
//!   `#[lockable(key = "account", fields = ["t.from"], also(key = "account", fields = ["t.to"]))]`
//!   holds both accounts as one set (all or none, in key order: 1→2 and
//!   2→1 at once never deadlock); `409 insufficient_funds`
//! * `POST /users/{user}/export` → `{"user":..,"export":"done"}`; `#[lockable(permits = 2)]`:
//!   at most two exports of one user at once, the third `429 lock_permits_exhausted`
//!   with `Retry-After`; on a lock backend that cannot keep a semaphore
//!   (`DLOCK_BACKEND=redlock`) the service starts with a `WARN` naming the
//!   route, and the route answers `501 lock_mode_unsupported` (`export.rs`)
//! * `GET /idempotency/token` → `{"token": "...", "expires_in_secs": n}`
//! * `POST /payments` with `Idempotency-Key: K` and `Authorization` (the
//!   caller, whose records the key belongs to: `400 idempotency_scope_missing`
//!   without), `{"order_id": "...", "amount": n}`
//!   → 201 `{"payment_id":..,"order_id":..,"amount":..}` after ~200 ms of work;
//!   a retry replays it (`Idempotent-Replayed: true`), `409
//!   idempotency_request_in_progress` while running, `422
//!   idempotency_key_mismatch` for another body, `400` without a key
//! * `POST /charges`, the same contract, but a side effect without
//!   deduplication of its own (`{"charge_id", "order_id", "amount",
//!   "execution"}`, `execution` counting its runs per order): only
//!   `IdempotencyLayer` keeps a duplicate from running twice
//!
//! Every error is RFC 9457 Problem Details (`application/problem+json`):
//! `{"type": "about:blank", "title": "...", "status": n, "detail": "...",
//! "error": "...", "code": n}`, through `RenderRejections`. JSON bodies
//! are read with `dlock_axum::JsonBody`, by the rules of `LockLayer`: a
//! declared `Content-Type` that is not JSON is `415`, a bad body `400`.
//! Query strings and path parameters are read with axum's `Query` and
//! `Path` made to refuse in the same shape (`extract.rs`): `400
//! invalid_query` (a field sent twice), `400 invalid_path`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dlock_axum::idempotency::stored_by_default;
use dlock_axum::lock::Policy;
use dlock_axum::{
    lockable, DlockExt, DlockRuntime, FencingToken, JsonBody, LockLayer, LockOutcome, Rejection, RenderRejections,
    RequestOwner,
};
use dlock_core::{Config, Locker, Owner};
use serde_json::{json, Value};
use tracing_subscriber::EnvFilter;

mod accounts;
mod export;
mod extract;
mod model;
#[cfg(feature = "postgres")]
mod patterns;
mod payments;
#[cfg(feature = "postgres")]
mod pg;
mod rate;
mod scrape;
mod store;

use extract::{Path, Query};
use model::{CreateOrder, ProductId, ProductRef, ReduceStock, SetStock, TokenParam};
use store::{Sale, Stock, Store, StoreError};

/// How long a sale waits for the product's lock.
const STOCK_WAIT: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
struct App {
    locker: Locker,
    store: Store,
    /// One-time order tokens and `Idempotency-Key` records.
    idem: std::sync::Arc<dyn dlock_core::idempotency::IdempotencyStore>,
    /// `ORDERS_PAYMENT_LEASE_MS`: the in-progress lease of `POST /payments`.
    payment_lease: std::time::Duration,
    /// `ORDERS_UNLOCKED=1`: sell without the stock lock.
    unlocked: bool,
    /// `ORDERS_UNFENCED=1`: stock writes without the lock's fencing token.
    unfenced: bool,
    /// `ORDERS_STOCK_WORK_MS`: a sale's work between its read and its write.
    stock_work: Duration,
    /// `ORDERS_CHARGES_UNGUARDED=1`: `POST /charges` without its idempotency layer.
    charges_unguarded: bool,
    /// `ORDERS_TOKEN_RATE`: tokens per second per client address.
    token_rate: rate::TokenRate,
    /// `ORDERS_EXPORT_MS`: how long one `POST /users/{user}/export` works.
    export_time: Duration,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,dlock_axum=warn,dlock_core=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stdout().is_terminal()).init();

    // DLOCK_* read once; the layers take their settings from what is installed.
    let config = Config::from_env()?;
    let orders_redis_url = non_empty_env("ORDERS_REDIS_URL");
    // Before the first lock: lock names register with the recorder once.
    let scrape = scrape::install()?;
    let dlock = payments::services(&config, orders_redis_url.as_deref()).await?;
    let (locker, idem) = (dlock.locker().clone(), dlock.idempotency_store()?.clone());
    let store = match (&orders_redis_url, non_empty_env("ORDERS_POSTGRES_URL")) {
        (Some(_), Some(_)) => return Err("ORDERS_REDIS_URL and ORDERS_POSTGRES_URL: set one store, not both".into()),
        (Some(url), None) => Store::redis(url).await?,
        (None, Some(url)) => postgres_store(&url).await?,
        (None, None) => Store::memory(),
    };
    let payment_lease = match non_empty_env("ORDERS_PAYMENT_LEASE_MS") {
        Some(v) => match v.parse::<u64>() {
            Ok(ms) if ms > 0 => std::time::Duration::from_millis(ms),
            _ => {
                return Err(
                    format!("ORDERS_PAYMENT_LEASE_MS: expected a positive number of milliseconds, got `{v}`").into()
                )
            }
        },
        None => std::time::Duration::from_secs(10),
    };
    let flag = |var: &str| non_empty_env(var).is_some_and(|v| matches!(v.as_str(), "1" | "true" | "yes"));
    let (unlocked, charges_unguarded) = (flag("ORDERS_UNLOCKED"), flag("ORDERS_CHARGES_UNGUARDED"));
    let unfenced = flag("ORDERS_UNFENCED");
    // A shared store keeps the highest fencing token of every product
    // across restarts of this process; the in-process lock backend's tokens
    // start again at 1 with it, and every sale would be refused as stale.
    if store.kind() != "memory" && locker.backend_name() == "memory" && !unlocked && !unfenced {
        return Err(format!(
            "a {} store needs a shared lock backend (DLOCK_BACKEND=redis, …): the in-process one's fencing tokens \
             restart with the process, and the store would refuse them as stale",
            store.kind()
        )
        .into());
    }
    let stock_work = match non_empty_env("ORDERS_STOCK_WORK_MS") {
        Some(v) => Duration::from_millis(
            v.parse().map_err(|_| format!("ORDERS_STOCK_WORK_MS: expected a number of milliseconds, got `{v}`"))?,
        ),
        None => Duration::from_millis(2),
    };
    let addr: SocketAddr = non_empty_env("ORDERS_ADDR")
        .unwrap_or_else(|| "127.0.0.1:3000".into())
        .parse()
        .map_err(|e| format!("ORDERS_ADDR: {e}"))?;

    let token_rate = match non_empty_env("ORDERS_TOKEN_RATE") {
        Some(v) => match v.parse::<u32>() {
            Ok(n) if n > 0 => n,
            _ => return Err(format!("ORDERS_TOKEN_RATE: expected a positive number per second, got `{v}`").into()),
        },
        None => 20,
    };
    let token_rate = rate::TokenRate::new(token_rate, token_rate.saturating_mul(10));
    let export_time = match non_empty_env("ORDERS_EXPORT_MS") {
        Some(v) => match v.parse::<u64>() {
            Ok(ms) => Duration::from_millis(ms),
            Err(_) => return Err(format!("ORDERS_EXPORT_MS: expected a number of milliseconds, got `{v}`").into()),
        },
        None => Duration::from_millis(500),
    };
    let store_kind = store.kind();
    let idem_for_scrape = idem.clone();
    let app = App {
        locker: locker.clone(),
        store,
        idem,
        unlocked,
        unfenced,
        stock_work,
        charges_unguarded,
        payment_lease,
        token_rate,
        export_time,
    };
    let router = router(app, dlock).route("/metrics", scrape::route(scrape, idem_for_scrape));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(
        backend = locker.backend_name(),
        store = store_kind,
        unlocked,
        "orders listening on http://{}",
        listener.local_addr()?
    );
    if unlocked {
        tracing::warn!("ORDERS_UNLOCKED is set: stock changes run without the lock and will oversell");
    }
    if charges_unguarded {
        tracing::warn!("ORDERS_CHARGES_UNGUARDED is set: duplicate charges run twice");
    }
    // The token endpoint's rate is per client address.
    let service = router.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service).with_graceful_shutdown(dlock_examples::shutdown::signal()).await?;
    tracing::info!("orders stopped");
    Ok(())
}

#[cfg(feature = "postgres")]
async fn postgres_store(url: &str) -> Result<Store, StoreError> {
    Ok(Store::Postgres(pg::PgStore::connect(url).await?))
}

#[cfg(not(feature = "postgres"))]
async fn postgres_store(_: &str) -> Result<Store, String> {
    Err("ORDERS_POSTGRES_URL needs the `postgres` feature (cargo run -p dlock-examples --features postgres --bin orders)".into())
}

fn non_empty_env(var: &str) -> Option<String> {
    std::env::var(var).ok().map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

fn router(app: App, dlock: DlockRuntime) -> Router {
    let reduce = post(reduce_stock);
    let reduce = if app.unlocked {
        reduce
    } else {
        reduce.route_layer(LockLayer::new("product.stock").json("product_id").wait(STOCK_WAIT))
    };
    #[cfg(feature = "postgres")]
    let router = Router::new()
        .route("/db/orders", post(patterns::unique_order))
        .route("/db/stock/reduce-optimistic", post(patterns::reduce_optimistic))
        .route("/db/stock/reduce-for-update", post(patterns::reduce_for_update));
    #[cfg(not(feature = "postgres"))]
    let router = Router::new();
    router
        .route("/health", get(health))
        // Every server dlock uses answers now (no lock taken): 200 or 503.
        .route("/ready", get(dlock_axum::ready))
        .route("/products/{id}", get(get_product).put(put_product))
        .route("/stock/reduce", reduce)
        .route("/orders", post(create_order))
        .route("/accounts/{id}", get(accounts::get_account).put(accounts::put_account))
        .route("/transfers", post(accounts::transfer))
        // A semaphore; on a backend that cannot keep one (RedLock), a `501`
        // said at start-up, and every other route still served.
        .route("/users/{user}/export", export::route(&app.locker))
        .merge(payments::routes(app.payment_lease, app.charges_unguarded, app.store.clone(), app.token_rate.clone()))
        // A path or method this service does not serve answers in the same
        // shape as every other refusal (axum's own are empty bodies).
        .fallback(route_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Every refusal, dlock's and this service's own `Rejection`s, as
        // RFC 9457 Problem Details (`error` and `code` kept as members).
        .layer(RenderRejections::problem_details())
        .layer(middleware::from_fn(access_log))
        .with_dlock(dlock)
        .with_state(app)
}

/// One line per request: method, path, status, time, and what happened to
/// its lock.
async fn access_log(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let started = Instant::now();
    let response = next.run(req).await;
    let lock = response.extensions().get::<LockOutcome>().map_or_else(|| "-".to_owned(), ToString::to_string);
    tracing::info!(
        %method,
        path,
        status = response.status().as_u16(),
        ms = format_args!("{:.2}", started.elapsed().as_secs_f64() * 1e3),
        lock,
        "request"
    );
    response
}

/// A failed request: a JSON rejection of the service's own, or the answer
/// of a lock the request could not take (with its [`LockOutcome`] for the
/// access log).
#[derive(Debug)]
enum AppError {
    Rejection(Rejection),
    Lock(Box<Response>),
}

impl From<Rejection> for AppError {
    fn from(rejection: Rejection) -> Self {
        AppError::Rejection(rejection)
    }
}

impl From<StoreError> for AppError {
    fn from(e: StoreError) -> Self {
        if let StoreError::Stale(e) = &e {
            tracing::warn!(error = %e, "a stock write was refused: the lock ran out and was taken again");
            return Rejection::from_lock_error(e).into();
        }
        tracing::warn!(error = %e, "store unavailable");
        Rejection::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            3004,
            "the product store is unavailable, please retry later",
        )
        .into()
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        match self {
            AppError::Rejection(rejection) => rejection.into_response(),
            AppError::Lock(response) => *response,
        }
    }
}

fn sold_out(id: &ProductId, stock: i64, wanted: i64) -> Rejection {
    Rejection::new(StatusCode::CONFLICT, "sold_out", 3001, format!("product {id} has {stock} left, {wanted} wanted"))
}

fn not_found(id: &ProductId) -> Rejection {
    Rejection::new(StatusCode::NOT_FOUND, "product_not_found", 3002, format!("no product {id}"))
}

fn invalid_quantity() -> Rejection {
    Rejection::new(StatusCode::BAD_REQUEST, "invalid_quantity", 3003, "quantity must be at least 1")
}

async fn route_not_found(uri: Uri) -> Rejection {
    Rejection::new(StatusCode::NOT_FOUND, "route_not_found", 3012, format!("no route {}", uri.path()))
}

/// axum adds the `Allow` header of the path's methods.
async fn method_not_allowed(method: Method, uri: Uri) -> Rejection {
    Rejection::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        3013,
        format!("{method} is not served at {}", uri.path()),
    )
}

async fn health(State(app): State<App>) -> Json<Value> {
    Json(json!({"status": "ok", "backend": app.locker.backend_name()}))
}

fn product_json(id: &ProductId, s: Stock) -> Json<Value> {
    Json(json!({"id": id, "stock": s.stock, "sold": s.sold}))
}

async fn get_product(State(app): State<App>, Path(id): Path<String>) -> Result<Json<Value>, AppError> {
    let id = ProductId::from_path(id);
    match app.store.get(id.as_str()).await? {
        Some(s) => Ok(product_json(&id, s)),
        None => Err(not_found(&id).into()),
    }
}

async fn put_product(
    State(app): State<App>,
    RequestOwner(owner): RequestOwner,
    Path(id): Path<String>,
    JsonBody(SetStock { stock }): JsonBody<SetStock>,
) -> Result<Json<Value>, AppError> {
    let id = ProductId::from_path(id);
    if stock < 0 {
        return Err(Rejection::new(StatusCode::BAD_REQUEST, "invalid_stock", 3005, "stock must not be negative").into());
    }
    let s = Stock { stock, sold: 0 };
    // Under the stock lock, so a restock never interleaves with a sale.
    let (app, id) = (&app, &id);
    app.with_stock_lock(owner, id, |fence| async move {
        app.store.put(id.as_str(), s, app.fence(fence)).await.map_err(AppError::from)
    })
    .await?;
    Ok(product_json(id, s))
}

/// Behind `LockLayer::new("product.stock").json("product_id")`: the layer
/// holds the product's lock while this runs, and its fencing token goes
/// with the stock write (none with `ORDERS_UNLOCKED`).
async fn reduce_stock(
    State(app): State<App>,
    fence: Option<FencingToken>,
    JsonBody(ReduceStock { product_id, quantity }): JsonBody<ReduceStock>,
) -> Result<Json<Value>, AppError> {
    let remaining = take_stock(&app, &product_id, quantity, fence).await?;
    Ok(Json(json!({"product_id": product_id, "remaining": remaining})))
}

/// `POST /orders?token=T`, the seed's `createOrder`: one order per product
/// and token at a time, the token spent once, the stock reduced under the
/// same lock as `/stock/reduce`.
#[lockable(key = "order.create", fields = ["product.id", "token"])]
async fn create_order(
    State(app): State<App>,
    RequestOwner(owner): RequestOwner,
    Query(TokenParam { token }): Query<TokenParam>,
    JsonBody(CreateOrder { product, quantity }): JsonBody<CreateOrder>,
) -> Result<Response, AppError> {
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return Err(Rejection::idempotency_token_missing().into());
    };
    if quantity < 1 {
        return Err(invalid_quantity().into());
    }
    let ProductRef { id } = product;
    // The token is claimed, and spent only if the order ran to a result (an
    // order, or `409 sold_out`); a 5xx (store down) gives it back for the
    // retry: the rule `TokenLayer` follows. Claim, order and settling run on
    // a task of their own, as `TokenLayer` runs them: a client that hangs up
    // while the claim is on its way, or mid-order, leaves neither a token
    // claimed for its lease nor an order half-placed.
    let placed = tokio::spawn(async move {
        let claim = payments::claim_token(&app.idem, &token).await?;
        let response = place_order(&app, owner, id, quantity).await.into_response();
        // Decided before the await: a `Response` is not `Sync`, so a
        // reference to it would make this future not `Send`.
        let ran_to_result = stored_by_default(&response);
        payments::settle_token(&app.idem, &claim, ran_to_result).await;
        Ok::<Response, AppError>(response)
    });
    match placed.await {
        Ok(answered) => answered,
        // The task panicked (a bug) or the runtime is shutting down.
        Err(e) => {
            tracing::error!(error = %e, "the order's task ended without an answer");
            Err(Rejection::backend_unavailable().into())
        }
    }
}

async fn place_order(app: &App, owner: Owner, id: ProductId, quantity: i64) -> Result<Response, AppError> {
    let remaining = app.with_stock_lock(owner, &id, |fence| take_stock(app, &id, quantity, fence)).await?;
    let order_id = new_order_id()?;
    let order = json!({"order_id": order_id, "product_id": id, "quantity": quantity});
    app.store.record_order(&order_id, &order).await?;
    tracing::debug!(%order_id, product = %id, quantity, remaining, "order placed");
    Ok((StatusCode::CREATED, Json(order)).into_response())
}

fn new_order_id() -> Result<String, AppError> {
    let mut bytes = [0u8; 12];
    getrandom::fill(&mut bytes).map_err(|e| {
        tracing::error!(error = %e, "OS random source failed");
        AppError::from(Rejection::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "order_id_unavailable",
            3006,
            "cannot create an order id",
        ))
    })?;
    Ok(bytes.iter().fold(String::from("ord_"), |mut s, b| {
        s.push_str(&format!("{b:02x}"));
        s
    }))
}

/// The deliberately non-atomic read-modify-write (`Store::sell`): read,
/// work, write. Only a lock around it keeps two sales from reading the same
/// stock, and only the lock's fencing token, checked by the store, keeps a
/// sale whose lock ran out during its work from writing over the next one.
async fn take_stock(app: &App, id: &ProductId, quantity: i64, fence: Option<FencingToken>) -> Result<i64, AppError> {
    if quantity < 1 {
        return Err(invalid_quantity().into());
    }
    sold(id, quantity, app.store.sell(id.as_str(), quantity, app.fence(fence), app.stock_work).await?)
}

/// A sale's answer: the units left, or why nothing was sold.
fn sold(id: &ProductId, quantity: i64, sale: Sale) -> Result<i64, AppError> {
    match sale {
        Sale::Sold(remaining) => Ok(remaining),
        Sale::SoldOut(stock) => Err(sold_out(id, stock, quantity).into()),
        Sale::NotFound => Err(not_found(id).into()),
    }
}

/// The stock lock `/stock/reduce`'s `LockLayer` takes, for the handlers
/// that change stock by hand.
fn stock_policy() -> Policy {
    Policy::new("product.stock").with_wait(STOCK_WAIT)
}

impl App {
    /// The token a stock write carries: the lock's, unless `ORDERS_UNFENCED`.
    fn fence(&self, token: Option<FencingToken>) -> Option<u64> {
        token.filter(|_| !self.unfenced).map(|FencingToken(t)| t)
    }

    /// Runs `work` holding the product's stock lock (the key
    /// `LockLayer::new("product.stock").json("product_id")` builds), as the
    /// request's `owner`, with the lock's fencing token, unless the service
    /// runs unlocked. A lock that cannot be taken is answered as the layer
    /// answers it.
    async fn with_stock_lock<T, F>(
        &self,
        owner: Owner,
        id: &ProductId,
        work: impl FnOnce(Option<FencingToken>) -> F,
    ) -> Result<T, AppError>
    where
        F: std::future::Future<Output = Result<T, AppError>>,
    {
        if self.unlocked {
            return work(None).await;
        }
        let policy = stock_policy();
        let key = self.locker.key(policy.name()).part(id).build().map_err(Rejection::from)?;
        match policy.run_holding(&self.locker, owner, key, |held| work(Some(held.fencing_token()))).await {
            Ok((result, _)) => result,
            Err(refused) => Err(AppError::Lock(Box::new(refused))),
        }
    }
}
