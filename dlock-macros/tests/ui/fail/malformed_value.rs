use dlock_macros::lockable;

#[lockable(key = "k", wait_ms = "5s")]
async fn handler() -> &'static str {
    "ok"
}

fn main() {
    let _ = handler;
}
