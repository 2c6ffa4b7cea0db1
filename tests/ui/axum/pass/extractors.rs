#![allow(clippy::too_many_arguments)] // nine extractors on purpose, more than clippy's seven
//! State, path, query, header, extension and custom extractors around the scope's.
use axum::extract::{Extension, FromRequestParts, Path, Query, State};
use axum::http::{HeaderMap, Method, Uri, request::Parts};
use axum::routing::post;
use axum::{Form, Json, Router};
use idempotent_axum::idempotent;
use std::collections::HashMap;

#[derive(Clone)]
struct App {
    name: &'static str,
}

#[derive(Clone)]
struct Tenant(u64);

/// The authenticated caller.
struct Caller {
    id: String,
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = axum::http::StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(|v| Caller { id: v.to_owned() })
            .ok_or(axum::http::StatusCode::UNAUTHORIZED)
    }
}

#[idempotent(scope = "caller.id")]
async fn everything(
    State(app): State<App>,
    caller: Caller,
    Path(order): Path<u64>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    method: Method,
    uri: Uri,
    Extension(tenant): Extension<Tenant>,
    Json(body): Json<serde_json::Value>,
) -> String {
    format!(
        "{} {} {order} {} {} {method} {uri} {} {body}",
        app.name,
        caller.id,
        query.len(),
        headers.len(),
        tenant.0
    )
}

#[idempotent(scope = "tenant")]
async fn form(
    Extension(Tenant(tenant)): Extension<Tenant>,
    Form(f): Form<HashMap<String, String>>,
) -> String {
    format!("{tenant}: {}", f.len())
}

fn main() {
    let _: Router = Router::new()
        .route("/orders/{order}", post(everything))
        .route("/form", post(form))
        .layer(Extension(Tenant(1)))
        .with_state(App { name: "app" });
}
