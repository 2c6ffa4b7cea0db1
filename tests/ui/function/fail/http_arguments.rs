use idempotent_core::call::Calls;
use idempotent_core::idempotent;

#[idempotent(name = "book", key_from = "_id", unscoped, key = "optional", store_server_errors, commit = "two")]
async fn book(_calls: &Calls, _id: &str) -> Result<(), String> {
    Ok(())
}

fn main() {}
