use axum::routing::post;
use axum::Router;
use dlock_axum::lockable;

// The handler is still emitted as written, so routing it gives no second error.
#[lockable(key = "k", timeout_ms = 5)]
async fn handler() -> &'static str {
    "ok"
}

fn main() {
    let _app: Router = Router::new().route("/", post(handler));
}
