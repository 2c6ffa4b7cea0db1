use idempotent_axum::idempotent;

#[idempotent(unscoped, commit = "two", wait = "5s")]
async fn plain(body: String) -> String {
    body
}

#[idempotent(unscoped, commit = "three")]
async fn bad_path(body: String) -> String {
    body
}

fn main() {}
