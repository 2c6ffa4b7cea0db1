//! The adapter imported under another name, told with `crate = "renamed"`.

use axum::Router;
use axum::routing::post;
use idempotent_axum as renamed;

#[renamed::idempotent(unscoped, crate = "renamed")]
async fn handler() -> &'static str {
    "ok"
}

fn main() {
    let _: Router = Router::new().route("/", post(handler));
}
