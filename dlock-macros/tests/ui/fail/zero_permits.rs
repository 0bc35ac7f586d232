use dlock_macros::lockable;

// Stands in for axum's extractor: the macro reads the pattern only.
struct Path<T>(T);

#[lockable(key = "k", fields = ["a"], permits = 0)]
async fn handler(Path((a, b)): Path<(u64, u64)>) -> String {
    format!("{a} {b}")
}

fn main() {
    let _ = handler;
}
