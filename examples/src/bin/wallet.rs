//! `wallet`: transfers between accounts on PostgreSQL, exactly once per
//! `Idempotency-Key`, with no lost update across instances (see
//! `dlock_examples::wallet` for the routes and why the layers are composed
//! as they are).
//!
//! ```sh
//! DLOCK_BACKEND=postgres DLOCK_POSTGRES_URL=postgres://127.0.0.1/locks \
//!   WALLET_DATABASE_URL=postgres://127.0.0.1/wallet WALLET_ADDR=127.0.0.1:3101 \
//!   cargo run -p dlock-examples --features postgres --bin wallet
//! ```
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `WALLET_DATABASE_URL` | the application's PostgreSQL: accounts, ledger, idempotency records, fences | required |
//! | `WALLET_DATABASE_MAX_CONNECTIONS` | the application pool's size | `10` |
//! | `WALLET_ADDR` | listen address (`:0` picks a free port) | `127.0.0.1:3100` |
//! | `WALLET_LOCK_INSIDE` | `1`: the lock inside the idempotency layer (`LayerOrder::LockInside`) | lock outside |
//! | `WALLET_WORK_MS` | a transfer's work between its read and its write | `0` |
//! | `WALLET_UNFENCED` | `1`: no `Fences::check`, the lock alone keeps transfers apart | fenced |
//! | `DLOCK_*` | the lock backend (`DLOCK_BACKEND=postgres` or `redis`, …), see dlock-core's `Config` | in process |
//! | `RUST_LOG` | log filter | `info` |

use std::io::IsTerminal as _;
use std::net::SocketAddr;
use std::time::Duration;

use dlock_examples::wallet::{LayerOrder, Wallet, WalletConfig};
use sqlx::postgres::PgPoolOptions;
use tracing_subscriber::EnvFilter;

type Error = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,dlock_axum=warn,dlock_core=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stdout().is_terminal()).init();

    let dlock = dlock_axum::from_env().await?;
    let url = env("WALLET_DATABASE_URL").ok_or("WALLET_DATABASE_URL: the wallet's PostgreSQL URL is required")?;
    let max_connections = match env("WALLET_DATABASE_MAX_CONNECTIONS") {
        Some(v) => v.parse().map_err(|_| format!("WALLET_DATABASE_MAX_CONNECTIONS: expected a number, got `{v}`"))?,
        None => 10,
    };
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(&url)
        .await
        .map_err(|e| format!("WALLET_DATABASE_URL: cannot connect: {e}"))?;
    let work = match env("WALLET_WORK_MS") {
        Some(v) => Duration::from_millis(
            v.parse().map_err(|_| format!("WALLET_WORK_MS: expected a number of milliseconds, got `{v}`"))?,
        ),
        None => Duration::ZERO,
    };
    let order = if flag("WALLET_LOCK_INSIDE")? { LayerOrder::LockInside } else { LayerOrder::LockOutside };
    let config = WalletConfig { order, work, fenced: !flag("WALLET_UNFENCED")?, ..WalletConfig::default() };
    let addr: SocketAddr = env("WALLET_ADDR")
        .unwrap_or_else(|| "127.0.0.1:3100".into())
        .parse()
        .map_err(|e| format!("WALLET_ADDR: {e}"))?;

    let backend = dlock.locker().backend_name();
    let wallet = Wallet::new(pool, dlock, config.clone()).await?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(backend, ?order, fenced = config.fenced, "wallet listening on http://{}", listener.local_addr()?);
    axum::serve(listener, wallet.router()).with_graceful_shutdown(dlock_examples::shutdown::signal()).await?;
    tracing::info!("wallet stopped");
    Ok(())
}

fn env(var: &str) -> Option<String> {
    std::env::var(var).ok().map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

/// `1` or `0` (unset: `0`).
fn flag(var: &str) -> Result<bool, String> {
    match env(var).as_deref() {
        None | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(format!("{var}: expected 1 or 0, got `{other}`")),
    }
}
