use actix_web::{HttpResponse, web};
use idempotent_actix::idempotent;

#[idempotent(scope = "ratio")]
async fn create(ratio: web::Path<f64>) -> HttpResponse {
    HttpResponse::Created().body(ratio.to_string())
}

fn main() {}
