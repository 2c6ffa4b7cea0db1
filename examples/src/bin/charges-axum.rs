//! A Stripe-shaped charges API on Axum, protected by `#[idempotent]`.
//!
//! `cargo run -p idempotent-examples --bin charges-axum -- --help`

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use idempotent_axum::{Idempotency, Sweeper, idempotent};
use idempotent_examples::charges::{self, Charge, Charges, NewCharge};
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

/// The caller, from `Authorization: Bearer <account>`; the idempotency scope.
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

/// A validated charge request (JSON or form); invalid ones are refused before any claim.
struct ChargeBody(NewCharge);

impl<S: Send + Sync> FromRequest<S> for ChargeBody {
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
        NewCharge::parse(content_type.as_deref(), &bytes)
            .map(ChargeBody)
            .map_err(|e| {
                api_problem(
                    StatusCode::BAD_REQUEST,
                    "invalid-request",
                    "Invalid charge request",
                    e.to_string(),
                )
            })
    }
}

/// A failure inside the handler: 500 (so the key is released and a retry runs again).
struct ApiError(String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        api_problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            self.0,
        )
    }
}

#[idempotent(scope = "account")]
async fn create_charge(
    State(app): State<AppState>,
    Account(account): Account,
    ChargeBody(req): ChargeBody,
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
    let sweeper = Sweeper::spawn(store.clone(), Duration::from_secs(60), 1_000);
    let idempotency =
        Idempotency::from_engine(idempotent_axum::Engine::from_arc(store)).lease(args.lease);
    let app = Router::new()
        .route("/v1/charges", post(create_charge).get(list_charges))
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
    sweeper.shutdown().await;
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("charges-axum: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
