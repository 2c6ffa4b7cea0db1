//! The attribute stacked with `#[tracing::instrument]` (above or below) and
//! `#[axum::debug_handler]` (below it: debug_handler then checks the generated handler).
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_axum::idempotent;

#[idempotent(unscoped)]
#[tracing::instrument(skip_all)]
async fn traced_inside(Json(n): Json<u64>) -> (StatusCode, String) {
    tracing::info!(n, "charging");
    (StatusCode::CREATED, n.to_string())
}

#[tracing::instrument(skip_all)]
#[idempotent(unscoped)]
async fn traced_outside(Json(n): Json<u64>) -> Result<String, StatusCode> {
    tracing::info!(n, "charging");
    Ok(n.to_string())
}

/// Without `skip`, `#[instrument]` records the hidden context by its `Debug` (method and
/// path only).
#[idempotent(unscoped)]
#[tracing::instrument]
async fn traced_with_fields(body: String) -> String {
    body
}

#[idempotent(unscoped)]
#[axum::debug_handler]
async fn debugged(Json(n): Json<u64>) -> String {
    n.to_string()
}

fn main() {
    let _: Router = Router::new()
        .route("/a", post(traced_inside))
        .route("/b", post(traced_outside))
        .route("/c", post(traced_with_fields))
        .route("/d", post(debugged));
}
