//! Every kind of actix extractor around the scope's, routed with `web::resource(..).route(..)`.
use actix_web::dev::Payload;
use actix_web::web::{self, Bytes};
use actix_web::{App, FromRequest, HttpRequest, HttpResponse};
use idempotent_actix::idempotent;
use std::collections::HashMap;
use std::future::{Ready, ready};

struct Db;

/// The authenticated caller.
struct Caller {
    id: String,
}

impl FromRequest for Caller {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, Self::Error>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(
            req.headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(|v| Caller { id: v.to_owned() })
                .ok_or_else(|| actix_web::error::ErrorUnauthorized("who?")),
        )
    }
}

#[derive(serde::Deserialize)]
struct NewOrder {
    sku: String,
}

#[idempotent(scope = "caller.id")]
async fn json(
    caller: Caller,
    db: web::Data<Db>,
    path: web::Path<u64>,
    query: web::Query<HashMap<String, String>>,
    req: HttpRequest,
    order: web::Json<NewOrder>,
) -> HttpResponse {
    let _: &Db = &db;
    HttpResponse::Created().body(format!(
        "{} {} {} {} {}",
        caller.id,
        path.into_inner(),
        query.len(),
        req.path(),
        order.sku
    ))
}

#[idempotent(scope = "caller.id")]
async fn form(caller: Caller, f: web::Form<HashMap<String, String>>) -> String {
    format!("{}: {}", caller.id, f.len())
}

#[idempotent(unscoped)]
async fn bytes(body: Bytes) -> String {
    body.len().to_string()
}

#[idempotent(unscoped)]
async fn text(body: String) -> String {
    body
}

fn main() {
    let _ = App::new()
        .app_data(web::Data::new(Db))
        .service(web::resource("/orders/{id}").route(web::post().to(json)))
        .route("/form", web::post().to(form))
        .route("/bytes", web::post().to(bytes))
        .route("/text", web::post().to(text));
}
