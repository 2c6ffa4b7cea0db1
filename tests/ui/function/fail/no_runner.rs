use idempotent_core::idempotent;

#[idempotent(name = "book", key_from = "_id", unscoped)]
async fn book(_id: &str) -> Result<(), String> {
    Ok(())
}

fn main() {}
