use idempotent_axum::idempotent;

use axum::extract::Path;

#[idempotent(scope = "acount_id")]
async fn create_charge(Path(account_id): Path<String>, body: String) -> String {
    format!("{account_id} {body}")
}

fn main() {}
