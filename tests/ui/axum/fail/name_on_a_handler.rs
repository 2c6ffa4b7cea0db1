use idempotent_axum::idempotent;

#[idempotent(unscoped, name = "create_charge")]
async fn create_charge() -> &'static str {
    "ok"
}

fn main() {}
