//! `unscoped` routes, and handlers returning `Result` with the caller's own error type.

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idempotent_axum::idempotent;

#[derive(Debug)]
struct ApiError;

impl axum::response::IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        StatusCode::BAD_REQUEST.into_response()
    }
}

fn parse(body: &str) -> Result<u64, ApiError> {
    body.parse().map_err(|_| ApiError)
}

/// Docs and attributes are kept.
#[idempotent(unscoped)]
#[allow(clippy::unused_async)]
pub async fn handler(body: String) -> Result<(StatusCode, String), ApiError> {
    let n = parse(&body)?;
    Ok((StatusCode::CREATED, n.to_string()))
}

#[idempotent(unscoped)]
async fn impl_trait() -> impl axum::response::IntoResponse {
    StatusCode::ACCEPTED
}

fn main() {
    let _: Router = Router::new()
        .route("/", post(handler))
        .route("/b", post(impl_trait));
}
