#![deny(unused_imports)]
//! Every return shape axum accepts works under the attribute, `?` included.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotent_axum::idempotent;
use serde_json::{Value, json};

struct ApiError(String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (StatusCode::BAD_REQUEST, self.0).into_response()
    }
}

impl From<std::num::ParseIntError> for ApiError {
    fn from(e: std::num::ParseIntError) -> Self {
        ApiError(e.to_string())
    }
}

#[idempotent(unscoped)]
async fn result_impl(body: String) -> Result<impl IntoResponse, ApiError> {
    let n: u64 = body.trim().parse()?;
    Ok((StatusCode::CREATED, n.to_string()))
}

#[idempotent(unscoped)]
async fn result_concrete(body: String) -> Result<Json<Value>, ApiError> {
    let n: u64 = body.trim().parse()?;
    Ok(Json(json!({ "n": n })))
}

#[idempotent(unscoped)]
async fn result_status_error(body: String) -> Result<(StatusCode, String), StatusCode> {
    if body.is_empty() {
        return Err(StatusCode::UNPROCESSABLE_ENTITY);
    }
    Ok((StatusCode::CREATED, body))
}

#[idempotent(unscoped)]
async fn plain_impl() -> impl IntoResponse {
    (StatusCode::ACCEPTED, [("x-thing", "1")], "queued")
}

#[idempotent(unscoped)]
async fn plain_response() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

#[idempotent(unscoped)]
async fn unit() {}

#[idempotent(unscoped)]
async fn json() -> Json<Value> {
    Json(json!({ "ok": true }))
}

#[idempotent(unscoped)]
async fn tuple_impl() -> (StatusCode, impl IntoResponse) {
    (StatusCode::CREATED, "made")
}

#[idempotent(unscoped)]
async fn inner_attributes(body: String) -> String {
    #![allow(unused_variables, clippy::let_and_return)]
    let unused = 1;
    body
}

/// A generic handler whose return type names its generic parameter next to an `impl Trait`.
trait Greeting: Send + Sync + 'static {
    fn text() -> &'static str;
}

struct Hello;

impl Greeting for Hello {
    fn text() -> &'static str {
        "hello"
    }
}

struct Refused<G>(std::marker::PhantomData<G>);

impl<G: Greeting> IntoResponse for Refused<G> {
    fn into_response(self) -> Response {
        (StatusCode::BAD_REQUEST, G::text()).into_response()
    }
}

#[idempotent(unscoped)]
async fn generic<G: Greeting>(body: String) -> Result<impl IntoResponse, Refused<G>> {
    if body.is_empty() {
        return Err(Refused(std::marker::PhantomData));
    }
    Ok(G::text())
}

fn main() {
    let _: Router = Router::new()
        .route("/a", post(result_impl))
        .route("/b", post(result_concrete))
        .route("/c", post(result_status_error))
        .route("/d", post(plain_impl))
        .route("/e", post(plain_response))
        .route("/f", post(unit))
        .route("/g", post(json))
        .route("/h", post(tuple_impl))
        .route("/i", post(inner_attributes))
        .route("/j", post(generic::<Hello>));
}
