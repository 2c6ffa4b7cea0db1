#![deny(clippy::too_many_arguments)]
//! A handler of seven extractors, clippy's limit: the context extractor the attribute adds
//! (an eighth argument) must not make clippy flag the handler, whose own signature is within
//! the limit. (Checked by the CI's clippy run over the workspace's test targets.)

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::routing::post;
use idempotent_axum::idempotent;
use std::collections::HashMap;

#[derive(Clone)]
struct App;

#[idempotent(scope = "account")]
async fn seven(
    State(_app): State<App>,
    Path(account): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    method: Method,
    uri: Uri,
    body: String,
) -> String {
    format!(
        "{account} {} {} {method} {uri} {}",
        query.len(),
        headers.len(),
        body.len()
    )
}

fn main() {
    let _: Router = Router::new()
        .route("/{account}", post(seven))
        .with_state(App);
}
