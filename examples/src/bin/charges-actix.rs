//! A Stripe-shaped charges API on Actix-web, protected by `#[idempotent]`: the twin of
//! `charges-axum`, with exactly its contract (flags, routes, bodies, statuses). The contract
//! lives in `idempotent_examples::api`; this file is the Actix glue.
//!
//! `cargo run -p idempotent-examples --bin charges-actix -- --help`

use actix_web::dev::Payload;
use actix_web::http::{StatusCode, header};
use actix_web::web::{self, Bytes};
use actix_web::{FromRequest, HttpRequest, HttpResponse, HttpServer, Responder, ResponseError};
use clap::Parser;
use idempotent_actix::sqlx::{MySql, Postgres, Sqlite};
use idempotent_actix::{Idempotency, Idempotent, Transaction, idempotent};
use idempotent_examples::api::PAYMENT_PROVIDER;
use idempotent_examples::api::{self, Api, ApiBody, Args, DRAIN_TIMEOUT};
use idempotent_examples::charges::{Kind, NewCharge, NewRefund, Writer};
use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::process::ExitCode;

/// An API answer as an actix response.
#[derive(Debug)]
struct Reply(api::Reply);

impl Reply {
    fn response(&self) -> HttpResponse {
        let status =
            StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut res = HttpResponse::build(status);
        res.insert_header((header::CONTENT_TYPE, self.0.content_type()));
        if self.0.problem {
            res.insert_header((header::CACHE_CONTROL, "no-store"));
        }
        res.body(self.0.body.clone())
    }
}

impl Responder for Reply {
    type Body = actix_web::body::BoxBody;
    fn respond_to(self, _: &HttpRequest) -> HttpResponse {
        self.response()
    }
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.0.status, self.0.body)
    }
}

/// Extractor rejections answer with the API's own problem.
impl ResponseError for Reply {
    fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
    fn error_response(&self) -> HttpResponse {
        self.response()
    }
}

/// The authenticated caller, from `Authorization: Bearer <account>`; the idempotency scope.
struct Account(String);

impl FromRequest for Account {
    type Error = Reply;
    type Future = std::future::Ready<Result<Self, Reply>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let header = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        std::future::ready(
            api::bearer_account(header)
                .map(Account)
                .ok_or(Reply(api::Reply::unauthorized())),
        )
    }
}

/// A validated request body (JSON or form); invalid ones are refused with 400 before any claim.
struct Valid<T>(T);

impl<T: ApiBody + 'static> FromRequest for Valid<T> {
    type Error = actix_web::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self, Self::Error>>>>;
    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let bytes = Bytes::from_request(req, payload);
        Box::pin(async move {
            let bytes = bytes.await?;
            api::validate(content_type.as_deref(), &bytes)
                .map(Valid)
                .map_err(|r| Reply(r).into())
        })
    }
}

/// Memory store: plain mode (the charge and the record are written apart).
#[idempotent(scope = "account")]
async fn create_charge(
    api: web::Data<Api>,
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
    api: web::Data<Api>,
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
    api: web::Data<Api>,
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
    api: web::Data<Api>,
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
    api: web::Data<Api>,
    Account(account): Account,
    charge: web::Path<String>,
    Valid(req): Valid<NewRefund>,
) -> Reply {
    Reply(
        api.create_refund(Writer::Pool, &account, &charge, req)
            .await,
    )
}

#[idempotent(scope = "account")]
async fn create_refund_sqlite(
    api: web::Data<Api>,
    Account(account): Account,
    charge: web::Path<String>,
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
    api: web::Data<Api>,
    Account(account): Account,
    charge: web::Path<String>,
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
    api: web::Data<Api>,
    Account(account): Account,
    charge: web::Path<String>,
    mut tx: Transaction<MySql>,
    Valid(req): Valid<NewRefund>,
) -> Reply {
    Reply(
        api.create_refund(Writer::MySql(&mut tx), &account, &charge, req)
            .await,
    )
}

/// The POST routes for the database kind: transactional on SQL, plain on memory.
fn posts(kind: Kind) -> (actix_web::Route, actix_web::Route) {
    match kind {
        Kind::Memory => (web::post().to(create_charge), web::post().to(create_refund)),
        Kind::Sqlite => (
            web::post().to(create_charge_sqlite),
            web::post().to(create_refund_sqlite),
        ),
        Kind::Postgres => (
            web::post().to(create_charge_postgres),
            web::post().to(create_refund_postgres),
        ),
        Kind::MySql => (
            web::post().to(create_charge_mysql),
            web::post().to(create_refund_mysql),
        ),
    }
}

async fn list_charges(api: web::Data<Api>, Account(account): Account) -> Reply {
    Reply(api.list_charges(&account).await)
}

async fn list_refunds(
    api: web::Data<Api>,
    Account(account): Account,
    charge: web::Path<String>,
) -> Reply {
    Reply(api.list_refunds(&account, &charge).await)
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; charset=utf-8")
        .body("ok")
}

#[actix_web::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let started = match api::start::<Idempotency>("charges-actix", &args).await {
        Ok(started) => started,
        Err(code) => return code,
    };
    let api::Started {
        api,
        idempotency,
        metrics,
    } = started;
    let kind = args.handlers(api.kind());
    let api = web::Data::new(api);
    let middleware = idempotency.middleware();
    let server = HttpServer::new(move || {
        // One resource per path (another method gets 405, as on Axum), HEAD wherever GET is
        // (Axum's `get` serves both), and Axum's default 2 MB body limit.
        let (charge, refund) = posts(kind);
        actix_web::App::new()
            .wrap(middleware.clone())
            .app_data(api.clone())
            .app_data(web::PayloadConfig::new(2 * 1024 * 1024))
            .service(
                web::resource("/v1/charges")
                    .route(charge)
                    .route(web::get().to(list_charges))
                    .route(web::head().to(list_charges)),
            )
            .service(
                web::resource("/v1/charges/{charge}/refunds")
                    .route(refund)
                    .route(web::get().to(list_refunds))
                    .route(web::head().to(list_refunds)),
            )
            .service(
                web::resource("/healthz")
                    .route(web::get().to(healthz))
                    .route(web::head().to(healthz)),
            )
            .configure(|cfg| {
                // Prometheus' text format; the idempotency metrics are listed in
                // `idempotent_core::observe`.
                if let Some(metrics) = metrics.clone() {
                    cfg.route(
                        "/metrics",
                        web::get().to(move || std::future::ready(metrics.render())),
                    );
                }
            })
    })
    .workers(2)
    .shutdown_timeout(30)
    .disable_signals();
    let server = match server.bind(&args.listen) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("charges-actix: cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let Some(addr) = server.addrs().first().copied() else {
        eprintln!("charges-actix: no address bound for {}", args.listen);
        return ExitCode::FAILURE;
    };
    // Before the address is announced: a signal from then on drains.
    let shutdown = api::shutdown_signal();
    let mut out = std::io::stdout();
    let _ = writeln!(out, "listening on http://{addr}");
    let _ = out.flush();
    let server = server.run();
    let handle = server.handle();
    // On SIGINT/SIGTERM: stop accepting, let handlers whose clients went away store their
    // responses (they run on the workers' runtimes, which actix's own stop would drop), then
    // stop the server.
    let stopping = idempotency.clone();
    actix_web::rt::spawn(async move {
        shutdown.await;
        api::report_drain(
            "charges-actix",
            stopping.stop_server(&handle, DRAIN_TIMEOUT).await,
        );
    });
    let served = server.await;
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("charges-actix: {e}");
            ExitCode::FAILURE
        }
    }
}
