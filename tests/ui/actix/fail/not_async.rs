use actix_web::HttpResponse;
use idempotent_actix::idempotent;

#[idempotent(unscoped)]
fn create() -> HttpResponse {
    HttpResponse::Created().finish()
}

fn main() {}
