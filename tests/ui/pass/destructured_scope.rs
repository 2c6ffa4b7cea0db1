use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_axum::idempotent;

#[derive(Clone)]
struct App;

struct AccountId(u64);

impl<S: Send + Sync> FromRequestParts<S> for AccountId {
    type Rejection = ();
    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, ()> {
        Ok(AccountId(1))
    }
}

#[idempotent(scope = "account_id", ttl = "24h", lease = "30s")]
async fn create_charge(
    State(_app): State<App>,
    AccountId(account_id): AccountId,
    Json(amount): Json<u64>,
) -> String {
    format!("{account_id}:{amount}")
}

#[idempotent(scope = "org")]
async fn nested(Path((org, user)): Path<(String, u32)>) -> String {
    format!("{org}/{user}")
}

fn main() {
    let _: Router = Router::new()
        .route("/charges", post(create_charge))
        .route("/orgs/{org}/users/{user}", post(nested))
        .with_state(App);
}
