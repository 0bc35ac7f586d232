use dlock_axum::lockable;

#[lockable(key = "k", timeout_ms = 5)]
async fn handler() -> &'static str {
    "ok"
}

fn main() {}
