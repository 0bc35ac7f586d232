use dlock_macros::lockable;

// Stands in for axum's extractor: the macro reads the pattern only.
struct Path<T>(T);

#[lockable(key = "order.create", fields = ["product.id"])]
async fn handler(Path(id): Path<u64>) -> String {
    id.to_string()
}

fn main() {
    let _ = handler;
}
