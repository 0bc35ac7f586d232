use dlock_macros::lockable;

#[lockable(key = "k")]
fn handler() -> &'static str {
    "ok"
}

fn main() {
    let _ = handler;
}
