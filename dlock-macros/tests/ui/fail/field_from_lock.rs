use dlock_axum::{lockable, FencingToken};

#[lockable(key = "k", fields = ["fence"])]
async fn handler(fence: FencingToken) -> String {
    fence.0.to_string()
}

fn main() {
    let _ = handler;
}
