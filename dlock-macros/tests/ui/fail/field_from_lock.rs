use dlock_macros::lockable;

// Stands in for dlock-axum's: the macro knows the argument by its type's name.
struct FencingToken(u64);

#[lockable(key = "k", fields = ["fence"])]
async fn handler(fence: FencingToken) -> String {
    fence.0.to_string()
}

fn main() {
    let _ = handler;
}
