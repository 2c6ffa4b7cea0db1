#![deny(warnings, unused_qualifications, unused_results, clippy::pedantic)]
//! The generated code is clean under `deny(warnings)`, `unused_qualifications`,
//! `unused_results` and `clippy::pedantic`.

use axum::Router;
use axum::extract::{FromRequestParts, Path};
use axum::http::{StatusCode, request::Parts};
use axum::routing::post;
use idempotent_axum::idempotent;

/// The authenticated caller (a verified token's subject).
struct Caller(u64);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("x-caller")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(Caller)
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

#[idempotent(scope = "caller", ttl = "7d")]
async fn handler(Caller(caller): Caller, Path(id): Path<u64>) -> String {
    format!("{caller}:{id}")
}

fn main() {
    let _: Router = Router::new().route("/{id}", post(handler));
}
