use idempotent_core::call::Calls;
use idempotent_core::idempotent;

#[idempotent(name = "book", key_from = "message.id", unscoped)]
async fn book(_calls: &Calls, _msg: &str) -> Result<(), String> {
    Ok(())
}

fn main() {}
