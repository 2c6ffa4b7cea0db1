//! The benchmark's handler on Actix-web: bare, annotated in plain mode, annotated in
//! transactional mode (single commit).

use super::server::{Bench, Conn, Db, NewOrder, created, insert};
use super::{Arm, ServeArgs};
use actix_web::dev::Payload;
use actix_web::http::{StatusCode, header};
use actix_web::web::{self, Json};
use actix_web::{FromRequest, HttpRequest, HttpResponse, HttpServer};
use idempotent_actix::sqlx::{MySql, Postgres, Sqlite};
use idempotent_actix::{Idempotency, Transaction, idempotent};
use idempotent_core::http::ConfigBuilder;
use std::io::Write;

/// The caller, from `Authorization: Bearer <account>`: the idempotency scope.
struct Account(String);

impl FromRequest for Account {
    type Error = actix_web::Error;
    type Future = std::future::Ready<Result<Self, Self::Error>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        std::future::ready(
            req.headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(|v| Account(v.to_owned()))
                .ok_or_else(|| actix_web::error::ErrorUnauthorized("no bearer token")),
        )
    }
}

fn answer(id: &str, order: &NewOrder, written: Result<(), sqlx::Error>) -> HttpResponse {
    match written {
        Ok(()) => HttpResponse::build(StatusCode::CREATED).json(created(id, order)),
        Err(e) => HttpResponse::ServiceUnavailable().body(e.to_string()),
    }
}

/// The handler's work when it writes on its own (bare and plain mode).
async fn work(b: web::Data<Bench>, account: String, order: NewOrder) -> HttpResponse {
    let id = b.execute();
    let written = b.insert_alone(&id, &account, &order).await;
    answer(&id, &order, written)
}

async fn bare(
    b: web::Data<Bench>,
    Account(account): Account,
    Json(order): Json<NewOrder>,
) -> HttpResponse {
    work(b, account, order).await
}

#[idempotent(scope = "account")]
async fn plain(
    b: web::Data<Bench>,
    Account(account): Account,
    Json(order): Json<NewOrder>,
) -> HttpResponse {
    work(b, account, order).await
}

#[idempotent(scope = "account")]
async fn tx_sqlite(
    b: web::Data<Bench>,
    Account(account): Account,
    mut tx: Transaction<Sqlite>,
    Json(order): Json<NewOrder>,
) -> HttpResponse {
    let id = b.execute();
    let written = insert(Conn::Sqlite(&mut tx), &id, &account, &order).await;
    answer(&id, &order, written)
}

#[idempotent(scope = "account")]
async fn tx_postgres(
    b: web::Data<Bench>,
    Account(account): Account,
    mut tx: Transaction<Postgres>,
    Json(order): Json<NewOrder>,
) -> HttpResponse {
    let id = b.execute();
    let written = insert(Conn::Postgres(&mut tx), &id, &account, &order).await;
    answer(&id, &order, written)
}

#[idempotent(scope = "account")]
async fn tx_mysql(
    b: web::Data<Bench>,
    Account(account): Account,
    mut tx: Transaction<MySql>,
    Json(order): Json<NewOrder>,
) -> HttpResponse {
    let id = b.execute();
    let written = insert(Conn::MySql(&mut tx), &id, &account, &order).await;
    answer(&id, &order, written)
}

async fn stats(b: web::Data<Bench>) -> String {
    b.executions().to_string()
}

pub(crate) fn serve(args: &ServeArgs) -> Result<(), String> {
    actix_web::rt::System::new().block_on(async {
        let (bench, store) = super::server::open(&args.database, &args.tag, args.pool).await?;
        if matches!((args.arm, &bench.db), (Arm::Tx, Db::Memory)) {
            return Err("transactional mode needs SQLite, PostgreSQL or MySQL".to_owned());
        }
        let idempotency: Idempotency = ConfigBuilder::new(super::engine(args, store)?)
            .build()
            .map_err(|e| e.to_string())?;
        let middleware = idempotency.middleware();
        let arm = args.arm;
        let bench = web::Data::new(bench);
        let workers = std::thread::available_parallelism().map_or(1, usize::from);
        let server = HttpServer::new(move || {
            let route = match (arm, &bench.db) {
                (Arm::Bare, _) => web::post().to(bare),
                (Arm::Plain, _) | (Arm::Tx, Db::Memory) => web::post().to(plain),
                (Arm::Tx, Db::Sqlite(_)) => web::post().to(tx_sqlite),
                (Arm::Tx, Db::Postgres(_)) => web::post().to(tx_postgres),
                (Arm::Tx, Db::MySql(_)) => web::post().to(tx_mysql),
            };
            actix_web::App::new()
                .wrap(middleware.clone())
                .app_data(bench.clone())
                .service(web::resource("/v1/orders").route(route))
                .service(web::resource("/stats").route(web::get().to(stats)))
        })
        .workers(workers)
        .disable_signals()
        .bind("127.0.0.1:0")
        .map_err(|e| e.to_string())?;
        let addr = server.addrs().first().copied().ok_or("no address bound")?;
        let mut out = std::io::stdout();
        let _ = writeln!(out, "listening on {addr}");
        let _ = out.flush();
        server.run().await.map_err(|e| e.to_string())
    })
}
