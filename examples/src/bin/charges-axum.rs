//! A Stripe-shaped charges API on Axum, protected by `#[idempotent]`.
//!
//! `cargo run -p idempotent-examples --bin charges-axum -- --help`

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use idempotent_axum::{Idempotency, Sweeper, idempotent};
use idempotent_examples::charges::{self, Charge, Charges, NewCharge, NewRefund, Refund};
use serde_json::json;
use std::io::Write;
use std::time::Duration;

/// A charges API whose POSTs are safe to retry with an `Idempotency-Key`.
#[derive(Debug, Parser)]
#[command(name = "charges-axum", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: String,
    /// `sqlite://FILE` (created and migrated), `sqlite::memory:`, `memory` or `postgres://…`.
    /// Defaults to `$DATABASE_URL`, then `sqlite://charges.db`.
    #[arg(long)]
    database: Option<String>,
    /// How long a crashed attempt blocks retries (heartbeat-extended while a handler runs).
    #[arg(long, default_value = "30s", value_parser = charges::parse_lease)]
    lease: Duration,
    /// How long the "payment provider" takes per charge.
    #[arg(long, default_value = "0ms", value_parser = charges::parse_delay)]
    work_delay: Duration,
}

#[derive(Clone)]
struct AppState {
    charges: Charges,
    work_delay: Duration,
}

/// RFC 9457 problem response for the API's own errors.
fn api_problem(status: StatusCode, slug: &str, title: &str, detail: String) -> Response {
    let body = json!({
        "type": format!("https://idempotent.dev/examples/charges/{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [
            (header::CONTENT_TYPE, "application/problem+json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body.to_string(),
    )
        .into_response()
}

/// The authenticated caller, from `Authorization: Bearer <account>`; the idempotency scope.
///
/// (A real service verifies the token here and takes the account it was issued to. The scope
/// must be such an authenticated identity, never a value the client picks freely, or one
/// client could replay another's stored responses.)
struct Account(String);

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = Response;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(|v| Account(v.to_owned()))
            .ok_or_else(|| {
                api_problem(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "Missing credentials",
                    "send `Authorization: Bearer <account>`".into(),
                )
            })
    }
}

/// A request body the API validates: a charge or a refund.
trait ApiBody: Sized {
    /// What it is, for the 400 problem's title.
    const WHAT: &'static str;
    fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, charges::InvalidCharge>;
}

impl ApiBody for NewCharge {
    const WHAT: &'static str = "Invalid charge request";
    fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, charges::InvalidCharge> {
        NewCharge::parse(content_type, body)
    }
}

impl ApiBody for NewRefund {
    const WHAT: &'static str = "Invalid refund request";
    fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, charges::InvalidCharge> {
        NewRefund::parse(content_type, body)
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
        T::parse(content_type.as_deref(), &bytes)
            .map(Valid)
            .map_err(|e| {
                api_problem(
                    StatusCode::BAD_REQUEST,
                    "invalid-request",
                    T::WHAT,
                    e.to_string(),
                )
            })
    }
}

/// A failure inside the handler: 500 (so the key is released and a retry runs again). The
/// database's error goes to the server's log, never into the response.
struct ApiError(String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        eprintln!("charges-axum: internal error: {}", self.0);
        api_problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            "the charge could not be processed; retry with the same key".into(),
        )
    }
}

#[idempotent(scope = "account")]
async fn create_charge(
    State(app): State<AppState>,
    Account(account): Account,
    Valid(req): Valid<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), ApiError> {
    let charge = Charge::new(&account, req);
    app.charges
        .insert(&charge)
        .await
        .map_err(|e| ApiError(e.to_string()))?;
    // "Call the payment provider." (A zero sleep would still wait for the next timer tick.)
    if !app.work_delay.is_zero() {
        tokio::time::sleep(app.work_delay).await;
    }
    Ok((StatusCode::CREATED, Json(charge)))
}

/// `POST /v1/charges/{charge}/refunds`: the charge in the path is part of the request, so one
/// key used to refund two charges is a 422 for the second, never a replay of the first.
#[idempotent(scope = "account")]
async fn create_refund(
    State(app): State<AppState>,
    Account(account): Account,
    Path(charge_id): Path<String>,
    Valid(req): Valid<NewRefund>,
) -> Result<Response, ApiError> {
    let Some(charge) = app
        .charges
        .get(&account, &charge_id)
        .await
        .map_err(|e| ApiError(e.to_string()))?
    else {
        return Ok(api_problem(
            StatusCode::NOT_FOUND,
            "no-such-charge",
            "No such charge",
            format!("this account has no charge `{charge_id}`"),
        ));
    };
    let amount = req.amount.unwrap_or(charge.amount);
    if amount > charge.amount {
        return Ok(api_problem(
            StatusCode::BAD_REQUEST,
            "invalid-request",
            "Invalid refund request",
            format!("`amount` exceeds the charge's {}", charge.amount),
        ));
    }
    let refund = Refund::new(&charge.id, amount);
    app.charges
        .insert_refund(&refund)
        .await
        .map_err(|e| ApiError(e.to_string()))?;
    if !app.work_delay.is_zero() {
        tokio::time::sleep(app.work_delay).await;
    }
    Ok((StatusCode::CREATED, Json(refund)).into_response())
}

async fn list_refunds(
    State(app): State<AppState>,
    Account(account): Account,
    Path(charge_id): Path<String>,
) -> Result<Response, ApiError> {
    let found = app
        .charges
        .get(&account, &charge_id)
        .await
        .map_err(|e| ApiError(e.to_string()))?;
    if found.is_none() {
        return Ok(api_problem(
            StatusCode::NOT_FOUND,
            "no-such-charge",
            "No such charge",
            format!("this account has no charge `{charge_id}`"),
        ));
    }
    let data = app
        .charges
        .refunds(&charge_id)
        .await
        .map_err(|e| ApiError(e.to_string()))?;
    Ok(Json(json!({"object": "list", "data": data})).into_response())
}

async fn list_charges(
    State(app): State<AppState>,
    Account(account): Account,
) -> Result<Json<serde_json::Value>, ApiError> {
    let data = app
        .charges
        .list(&account)
        .await
        .map_err(|e| ApiError(e.to_string()))?;
    Ok(Json(json!({"object": "list", "data": data})))
}

async fn healthz() -> &'static str {
    "ok"
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// How long shutdown waits for running executions.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let database = args
        .database
        .or_else(|| std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| "sqlite://charges.db".to_owned());
    let (store, charges) = match charges::open(&database).await {
        Ok(opened) => opened,
        Err(e) => {
            eprintln!("charges-axum: cannot open {database}: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let idempotency =
        match Idempotency::builder_from_engine(idempotent_axum::Engine::from_arc(store.clone()))
            .lease(args.lease)
            .build()
        {
            Ok(idempotency) => idempotency,
            Err(e) => {
                eprintln!("charges-axum: invalid configuration: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
    let sweeper = Sweeper::spawn(store, Duration::from_secs(60), 1_000);
    let app = Router::new()
        .route("/v1/charges", post(create_charge).get(list_charges))
        .route(
            "/v1/charges/{charge}/refunds",
            post(create_refund).get(list_refunds),
        )
        .route("/healthz", get(healthz))
        .layer(idempotency.layer())
        .with_state(AppState {
            charges,
            work_delay: args.work_delay,
        });
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("charges-axum: cannot listen on {}: {e}", args.listen);
            return std::process::ExitCode::FAILURE;
        }
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("charges-axum: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut out = std::io::stdout();
    let _ = writeln!(out, "listening on http://{addr}");
    let _ = out.flush();
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await;
    // Handlers whose clients went away are still running: let them store their responses.
    let drained = idempotency.drain(DRAIN_TIMEOUT).await;
    if drained.still_running > 0 {
        eprintln!(
            "charges-axum: {} executions still running after {DRAIN_TIMEOUT:?}; their keys stay in progress until their leases end",
            drained.still_running
        );
    }
    sweeper.shutdown().await;
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("charges-axum: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
