use axum::extract::Path;
use dlock_axum::lockable;

#[lockable(key = "k", fields = ["a"], permits = 4294967296)]
async fn handler(Path((a, b)): Path<(u64, u64)>) -> String {
    format!("{a} {b}")
}

fn main() {
    let _ = handler;
}
