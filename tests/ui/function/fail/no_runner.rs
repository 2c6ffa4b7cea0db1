use idempotent_core::idempotent;

#[idempotent(key_from = "_id", unscoped)]
async fn book(_id: &str) -> Result<(), String> {
    Ok(())
}

fn main() {}
