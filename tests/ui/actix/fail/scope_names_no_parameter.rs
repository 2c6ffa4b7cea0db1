use actix_web::{HttpResponse, web};
use idempotent_actix::idempotent;

#[idempotent(scope = "acount")]
async fn create(account: web::Path<String>, body: web::Bytes) -> HttpResponse {
    HttpResponse::Created().body(format!("{account}: {}", body.len()))
}

fn main() {}
