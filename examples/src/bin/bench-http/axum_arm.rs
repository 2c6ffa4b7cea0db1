//! The benchmark's handler on Axum: bare, annotated in plain mode, annotated in
//! transactional mode (single commit).

use super::server::{Bench, Conn, NewOrder, created, insert};
use super::{Arm, ServeArgs};
use axum::Json;
use axum::Router;
use axum::extract::{FromRequestParts, State};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idempotent_axum::sqlx::{MySql, Postgres, Sqlite};
use idempotent_axum::{Idempotency, Transaction, idempotent};
use idempotent_core::http::ConfigBuilder;
use std::io::Write;

/// The caller, from `Authorization: Bearer <account>`: the idempotency scope.
struct Account(String);

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|v| Account(v.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

/// The answer to a written (or failed) order.
fn answer(id: &str, order: &NewOrder, written: Result<(), sqlx::Error>) -> Response {
    match written {
        Ok(()) => (StatusCode::CREATED, Json(created(id, order))).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

/// The handler's work when it writes on its own (bare and plain mode).
async fn work(b: Bench, account: String, order: NewOrder) -> Response {
    let id = b.execute();
    let written = b.insert_alone(&id, &account, &order).await;
    answer(&id, &order, written)
}

async fn bare(
    State(b): State<Bench>,
    Account(account): Account,
    Json(order): Json<NewOrder>,
) -> Response {
    work(b, account, order).await
}

#[idempotent(scope = "account")]
async fn plain(
    State(b): State<Bench>,
    Account(account): Account,
    Json(order): Json<NewOrder>,
) -> Response {
    work(b, account, order).await
}

#[idempotent(scope = "account")]
async fn tx_sqlite(
    State(b): State<Bench>,
    Account(account): Account,
    mut tx: Transaction<Sqlite>,
    Json(order): Json<NewOrder>,
) -> Response {
    let id = b.execute();
    let written = insert(Conn::Sqlite(&mut tx), &id, &account, &order).await;
    answer(&id, &order, written)
}

#[idempotent(scope = "account")]
async fn tx_postgres(
    State(b): State<Bench>,
    Account(account): Account,
    mut tx: Transaction<Postgres>,
    Json(order): Json<NewOrder>,
) -> Response {
    let id = b.execute();
    let written = insert(Conn::Postgres(&mut tx), &id, &account, &order).await;
    answer(&id, &order, written)
}

#[idempotent(scope = "account")]
async fn tx_mysql(
    State(b): State<Bench>,
    Account(account): Account,
    mut tx: Transaction<MySql>,
    Json(order): Json<NewOrder>,
) -> Response {
    let id = b.execute();
    let written = insert(Conn::MySql(&mut tx), &id, &account, &order).await;
    answer(&id, &order, written)
}

async fn stats(State(b): State<Bench>) -> String {
    b.executions().to_string()
}

pub(crate) fn serve(args: &ServeArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let (bench, store) = super::server::open(&args.database, &args.tag, args.pool).await?;
        let handler = match (args.arm, &bench.db) {
            (Arm::Bare, _) => post(bare),
            (Arm::Plain, _) => post(plain),
            (Arm::Tx, super::server::Db::Sqlite(_)) => post(tx_sqlite),
            (Arm::Tx, super::server::Db::Postgres(_)) => post(tx_postgres),
            (Arm::Tx, super::server::Db::MySql(_)) => post(tx_mysql),
            (Arm::Tx, super::server::Db::Memory) => {
                return Err("transactional mode needs SQLite, PostgreSQL or MySQL".to_owned());
            }
        };
        let idempotency: Idempotency = ConfigBuilder::new(super::engine(args, store)?)
            .build()
            .map_err(|e| e.to_string())?;
        let app = Router::new()
            .route("/v1/orders", handler)
            .route("/stats", get(stats))
            .layer(idempotency.layer())
            .with_state(bench);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let mut out = std::io::stdout();
        let _ = writeln!(out, "listening on {addr}");
        let _ = out.flush();
        axum::serve(listener, app).await.map_err(|e| e.to_string())
    })
}
