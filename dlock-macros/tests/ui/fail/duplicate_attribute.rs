use dlock_macros::lockable;

#[lockable(key = "k", wait_ms = 0, wait_ms = 10)]
async fn handler() -> &'static str {
    "ok"
}

fn main() {
    let _ = handler;
}
