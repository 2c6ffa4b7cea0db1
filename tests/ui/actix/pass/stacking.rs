//! With actix's route macros both orders work: `#[post]` above `#[idempotent]` (actix wraps
//! the rewritten handler) and below it (the attribute is kept and applied to the rewritten
//! handler).
use actix_web::{App, HttpResponse, post, web};
use idempotent_actix::idempotent;

#[post("/above")]
#[idempotent(unscoped, ttl = "1h")]
async fn route_macro_above(body: web::Bytes) -> HttpResponse {
    HttpResponse::Created().body(body)
}

#[idempotent(unscoped, ttl = "1h")]
#[post("/below")]
async fn route_macro_below(body: web::Bytes) -> HttpResponse {
    HttpResponse::Created().body(body)
}

fn main() {
    let _ = App::new()
        .service(route_macro_above)
        .service(route_macro_below);
}
