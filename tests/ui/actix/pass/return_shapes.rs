#![deny(unused_imports)]
//! Every return shape actix accepts: `impl Responder`, `HttpResponse`, `actix_web::Result<impl
//! Responder>`, `Result<T, E: ResponseError>`, `?`, inner attributes.
use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, Responder, ResponseError, web};
use idempotent_actix::idempotent;

#[derive(Debug)]
struct ApiError(String);

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        StatusCode::BAD_REQUEST
    }
}

impl From<std::num::ParseIntError> for ApiError {
    fn from(e: std::num::ParseIntError) -> Self {
        ApiError(e.to_string())
    }
}

#[idempotent(unscoped)]
async fn impl_responder() -> impl Responder {
    "made"
}

#[idempotent(unscoped)]
async fn response() -> HttpResponse {
    HttpResponse::NoContent().finish()
}

#[idempotent(unscoped)]
async fn actix_result(body: String) -> actix_web::Result<impl Responder> {
    let n: u64 = body
        .trim()
        .parse()
        .map_err(actix_web::error::ErrorBadRequest)?;
    Ok(HttpResponse::Created().body(n.to_string()))
}

#[idempotent(unscoped)]
async fn own_error(body: String) -> Result<String, ApiError> {
    let n: u64 = body.trim().parse()?;
    Ok(n.to_string())
}

#[idempotent(unscoped)]
async fn json() -> web::Json<Vec<u8>> {
    web::Json(vec![1, 2, 3])
}

#[idempotent(unscoped)]
async fn inner_attributes(body: String) -> String {
    #![allow(unused_variables, clippy::let_and_return)]
    let unused = 1;
    body
}

fn main() {
    let _ = App::new()
        .route("/a", web::post().to(impl_responder))
        .route("/b", web::post().to(response))
        .route("/c", web::post().to(actix_result))
        .route("/d", web::post().to(own_error))
        .route("/e", web::post().to(json))
        .route("/f", web::post().to(inner_attributes));
}
