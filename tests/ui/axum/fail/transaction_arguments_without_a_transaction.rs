use idempotent_axum::idempotent;

#[idempotent(unscoped, commit = "two", wait = "5s")]
async fn plain(body: String) -> String {
    body
}

#[idempotent(unscoped, commit = "three")]
async fn bad_path(body: String) -> String {
    body
}

// `wait` applies to every route, but never past the lease of the attempt it waits for.
#[idempotent(unscoped, lease = "2s", wait = "5s")]
async fn waits_past_its_lease(body: String) -> String {
    body
}

fn main() {}
