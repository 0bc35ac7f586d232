use dlock_macros::lockable;

#[lockable(fields = ["id"])]
async fn handler(id: String) -> String {
    id
}

fn main() {
    let _ = handler;
}
