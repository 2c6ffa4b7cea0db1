//! Attributes on an Actix handler's parameters are kept: lint levels on the bindings the
//! expansion makes, `#[cfg]` deciding which parameters exist (with `#[post]` in both orders),
//! and the transaction parameter's own. Under `deny`, a dropped `allow` fails to compile.
#![deny(unused_variables, unused_mut)]

use actix_web::{HttpResponse, post, web};
use idempotent_actix::sqlx::Sqlite;
use idempotent_actix::{Transaction, idempotent};

type Query = web::Query<std::collections::HashMap<String, String>>;

/// A type that exists in no configuration this is built in: a parameter of this type is
/// there only where its `#[cfg]` holds.
#[cfg(any())]
struct Absent;

#[idempotent(unscoped)]
async fn lint_levels(#[allow(unused_variables)] query: Query, body: String) -> HttpResponse {
    HttpResponse::Ok().body(body)
}

#[idempotent(unscoped)]
async fn gated(
    #[cfg(any())] absent: Absent,
    #[cfg(not(any()))] body: String,
    #[cfg(not(any()))]
    #[allow(unused_variables)]
    query: Query,
) -> HttpResponse {
    HttpResponse::Ok().body(body)
}

#[post("/post-above")]
#[idempotent(unscoped)]
async fn post_above(#[cfg(any())] absent: Absent, body: String) -> HttpResponse {
    HttpResponse::Ok().body(body)
}

#[idempotent(unscoped)]
#[post("/post-below")]
async fn post_below(body: String, #[cfg(any())] absent: Absent) -> HttpResponse {
    HttpResponse::Ok().body(body)
}

#[idempotent(unscoped)]
async fn transaction_lint_level(
    #[allow(unused_mut)] mut tx: Transaction<Sqlite>,
    body: String,
) -> HttpResponse {
    let _ = &tx;
    HttpResponse::Ok().body(body)
}

fn main() {
    let _ = actix_web::App::new()
        .route("/lint-levels", web::post().to(lint_levels))
        .route("/gated", web::post().to(gated))
        .route("/tx", web::post().to(transaction_lint_level))
        .service(post_above)
        .service(post_below);
}
