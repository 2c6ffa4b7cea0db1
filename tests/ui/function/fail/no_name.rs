use idempotent_core::call::Calls;
use idempotent_core::idempotent;

#[idempotent(key_from = "_id", unscoped)]
async fn book_payment(_calls: &Calls, _id: &str) -> Result<(), String> {
    Ok(())
}

fn main() {}
