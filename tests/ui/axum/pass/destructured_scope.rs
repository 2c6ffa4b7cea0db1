//! A scope named inside a destructured extractor pattern.

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

/// An authenticated (organisation, user) pair, destructured in the parameter pattern.
struct Member((String, u32));

impl<S: Send + Sync> FromRequestParts<S> for Member {
    type Rejection = ();
    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, ()> {
        Ok(Member(("org_1".to_owned(), 7)))
    }
}

#[idempotent(scope = "org")]
async fn nested(Member((org, user)): Member, Path(item): Path<u32>) -> String {
    format!("{org}/{user}/{item}")
}

fn main() {
    let _: Router = Router::new()
        .route("/charges", post(create_charge))
        .route("/items/{item}", post(nested))
        .with_state(App);
}
