use dlock_macros::lockable;

#[lockable(key = "")]
async fn handler() -> &'static str {
    "ok"
}

fn main() {
    let _ = handler;
}
