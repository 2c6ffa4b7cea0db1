//! A Stripe-shaped charges API on Axum, protected by `#[idempotent]`. The contract lives in
//! `idempotent_examples::api`; this file is the Axum glue (`charges-actix` is its twin).
//!
//! `cargo run -p idempotent-examples --bin charges-axum -- --help`

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use clap::Parser;
use idempotent_axum::sqlx::{MySql, Postgres, Sqlite};
use idempotent_axum::{Idempotency, Idempotent, Transaction, idempotent};
use idempotent_examples::api::PAYMENT_PROVIDER;
use idempotent_examples::api::{self, Api, ApiBody, Args, DRAIN_TIMEOUT};
use idempotent_examples::charges::{Kind, NewCharge, NewRefund, Writer};
use std::io::Write;
use std::process::ExitCode;

/// An API answer as an axum response.
struct Reply(api::Reply);

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut res = (
            status,
            [(header::CONTENT_TYPE, self.0.content_type())],
            self.0.body,
        )
            .into_response();
        if self.0.problem {
            res.headers_mut().insert(
                header::CACHE_CONTROL,
                header::HeaderValue::from_static("no-store"),
            );
        }
        res
    }
}

/// The authenticated caller, from `Authorization: Bearer <account>`; the idempotency scope.
struct Account(String);

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = Reply;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Reply> {
        let header = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        api::bearer_account(header)
            .map(Account)
            .ok_or(Reply(api::Reply::unauthorized()))
    }
}

/// A validated request body (JSON or form); invalid ones are refused with 400 before any claim.
struct Valid<T>(T);

impl<S: Send + Sync, T: ApiBody> FromRequest<S> for Valid<T> {
    type Rejection = Response;
    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        api::validate(content_type.as_deref(), &bytes)
            .map(Valid)
            .map_err(|r| Reply(r).into_response())
    }
}

/// Memory store: plain mode (the charge and the record are written apart).
#[idempotent(scope = "account")]
async fn create_charge(
    State(api): State<Api>,
    Account(account): Account,
    idem: Idempotent,
    Valid(req): Valid<NewCharge>,
) -> Reply {
    Reply(
        api.create_charge(Writer::Pool, &account, idem.derive(PAYMENT_PROVIDER), req)
            .await,
    )
}

/// SQLite: transactional mode. The charge row commits with the stored response, in one
/// commit, or not at all (a crash, a 5xx, a panic roll both back).
#[idempotent(scope = "account")]
async fn create_charge_sqlite(
    State(api): State<Api>,
    Account(account): Account,
    idem: Idempotent,
    mut tx: Transaction<Sqlite>,
    Valid(req): Valid<NewCharge>,
) -> Reply {
    Reply(
        api.create_charge(
            Writer::Sqlite(&mut tx),
            &account,
            idem.derive(PAYMENT_PROVIDER),
            req,
        )
        .await,
    )
}

/// PostgreSQL: transactional mode, as on SQLite.
#[idempotent(scope = "account")]
async fn create_charge_postgres(
    State(api): State<Api>,
    Account(account): Account,
    idem: Idempotent,
    mut tx: Transaction<Postgres>,
    Valid(req): Valid<NewCharge>,
) -> Reply {
    Reply(
        api.create_charge(
            Writer::Postgres(&mut tx),
            &account,
            idem.derive(PAYMENT_PROVIDER),
            req,
        )
        .await,
    )
}

/// MySQL and MariaDB: transactional mode, as on SQLite.
#[idempotent(scope = "account")]
async fn create_charge_mysql(
    State(api): State<Api>,
    Account(account): Account,
    idem: Idempotent,
    mut tx: Transaction<MySql>,
    Valid(req): Valid<NewCharge>,
) -> Reply {
    Reply(
        api.create_charge(
            Writer::MySql(&mut tx),
            &account,
            idem.derive(PAYMENT_PROVIDER),
            req,
        )
        .await,
    )
}

/// The charge in the path is part of the request: one key used to refund two charges is a 422
/// for the second, never a replay of the first.
#[idempotent(scope = "account")]
async fn create_refund(
    State(api): State<Api>,
    Account(account): Account,
    Path(charge): Path<String>,
    Valid(req): Valid<NewRefund>,
) -> Reply {
    Reply(
        api.create_refund(Writer::Pool, &account, &charge, req)
            .await,
    )
}

#[idempotent(scope = "account")]
async fn create_refund_sqlite(
    State(api): State<Api>,
    Account(account): Account,
    Path(charge): Path<String>,
    mut tx: Transaction<Sqlite>,
    Valid(req): Valid<NewRefund>,
) -> Reply {
    Reply(
        api.create_refund(Writer::Sqlite(&mut tx), &account, &charge, req)
            .await,
    )
}

#[idempotent(scope = "account")]
async fn create_refund_postgres(
    State(api): State<Api>,
    Account(account): Account,
    Path(charge): Path<String>,
    mut tx: Transaction<Postgres>,
    Valid(req): Valid<NewRefund>,
) -> Reply {
    Reply(
        api.create_refund(Writer::Postgres(&mut tx), &account, &charge, req)
            .await,
    )
}

#[idempotent(scope = "account")]
async fn create_refund_mysql(
    State(api): State<Api>,
    Account(account): Account,
    Path(charge): Path<String>,
    mut tx: Transaction<MySql>,
    Valid(req): Valid<NewRefund>,
) -> Reply {
    Reply(
        api.create_refund(Writer::MySql(&mut tx), &account, &charge, req)
            .await,
    )
}

/// The POST handlers for the database kind: transactional on SQL, plain on memory.
fn posts(kind: Kind) -> (MethodRouter<Api>, MethodRouter<Api>) {
    match kind {
        Kind::Memory => (post(create_charge), post(create_refund)),
        Kind::Sqlite => (post(create_charge_sqlite), post(create_refund_sqlite)),
        Kind::Postgres => (post(create_charge_postgres), post(create_refund_postgres)),
        Kind::MySql => (post(create_charge_mysql), post(create_refund_mysql)),
    }
}

async fn list_charges(State(api): State<Api>, Account(account): Account) -> Reply {
    Reply(api.list_charges(&account).await)
}

async fn list_refunds(
    State(api): State<Api>,
    Account(account): Account,
    Path(charge): Path<String>,
) -> Reply {
    Reply(api.list_refunds(&account, &charge).await)
}

async fn healthz() -> &'static str {
    "ok"
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let started = match api::start::<Idempotency>("charges-axum", &args).await {
        Ok(started) => started,
        Err(code) => return code,
    };
    let api::Started {
        api,
        idempotency,
        metrics,
    } = started;
    let (charge, refund) = posts(args.handlers(api.kind()));
    let mut app = Router::new()
        .route("/v1/charges", charge.get(list_charges))
        .route("/v1/charges/{charge}/refunds", refund.get(list_refunds))
        .route("/healthz", get(healthz));
    if let Some(metrics) = metrics {
        // Prometheus' text format; the idempotency metrics are listed in
        // `idempotent_core::observe`.
        app = app.route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        );
    }
    let app = app.layer(idempotency.layer()).with_state(api);
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("charges-axum: cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("charges-axum: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Before the address is announced: a signal from then on drains.
    let shutdown = api::shutdown_signal();
    let mut out = std::io::stdout();
    let _ = writeln!(out, "listening on http://{addr}");
    let _ = out.flush();
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await;
    // Handlers whose clients went away are still running: let them store their responses.
    api::report_drain("charges-axum", idempotency.drain(DRAIN_TIMEOUT).await);
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("charges-axum: {e}");
            ExitCode::FAILURE
        }
    }
}
