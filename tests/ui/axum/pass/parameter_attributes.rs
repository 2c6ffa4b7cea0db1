//! Attributes on an Axum handler's parameters are kept, the transaction's and the idempotency
//! context's too (neither stays a parameter: the expansion binds them itself). Under `deny`,
//! a dropped `allow` fails to compile.
#![deny(unused_variables, unused_mut)]

use axum::Router;
use axum::routing::post;
use idempotent_axum::sqlx::Sqlite;
use idempotent_axum::{Idempotent, Transaction, idempotent};

/// A type that exists in no configuration this is built in.
#[cfg(any())]
struct Absent;

#[idempotent(unscoped)]
async fn attributes(
    #[cfg(any())] absent: Absent,
    #[allow(unused_variables)] method: axum::http::Method,
    #[allow(unused_mut)] mut tx: Transaction<Sqlite>,
    #[allow(unused_variables)] idem: Idempotent,
    body: String,
) -> String {
    let _ = &tx;
    body
}

fn main() {
    let _: Router = Router::new().route("/", post(attributes));
}
