use axum::extract::Path;
use dlock_axum::lockable;

#[lockable(key = "order.create", fields = ["product.id"])]
async fn handler(Path(id): Path<u64>) -> String {
    id.to_string()
}

fn main() {
    let _ = handler;
}
