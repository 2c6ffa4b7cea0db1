use idempotent_core::call::Calls;
use idempotent_core::idempotent;

#[idempotent(name = "book", key_from = "_id", unscoped)]
async fn book(_calls: &Calls, _id: &str) -> String {
    String::new()
}

fn main() {}
