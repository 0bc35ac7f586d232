use dlock_macros::lockable;

// The handler is still emitted as written, so calling it gives no second error.
#[lockable(key = "k", timeout_ms = 5)]
async fn handler() -> &'static str {
    "ok"
}

fn main() {
    let _answer = handler();
}
