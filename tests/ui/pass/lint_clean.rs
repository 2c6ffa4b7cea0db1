#![deny(warnings, unused_qualifications, unused_results, clippy::pedantic)]

use axum::extract::Path;
use axum::routing::post;
use axum::Router;
use idempotent_axum::idempotent;

#[idempotent(scope = "id", ttl = "7d")]
async fn handler(Path(id): Path<u64>) -> String {
    id.to_string()
}

fn main() {
    let _: Router = Router::new().route("/{id}", post(handler));
}
