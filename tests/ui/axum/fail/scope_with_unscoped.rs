use idempotent_axum::idempotent;

use axum::extract::Path;

#[idempotent(scope = "id", unscoped)]
async fn handler(Path(id): Path<String>) -> String {
    id
}

fn main() {}
