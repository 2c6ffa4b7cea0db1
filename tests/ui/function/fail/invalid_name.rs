use idempotent_core::call::Calls;
use idempotent_core::idempotent;

#[idempotent(name = "payments::book", key_from = "_id", unscoped)]
async fn book(_calls: &Calls, _id: &str) -> Result<(), String> {
    Ok(())
}

fn main() {}
