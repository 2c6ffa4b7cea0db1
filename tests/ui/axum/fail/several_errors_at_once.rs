use idempotent_axum::idempotent;

#[idempotent(scope = "nobody", ttl = "soon", retries = 3)]
async fn handler(body: String) -> String {
    body
}

fn main() {}
