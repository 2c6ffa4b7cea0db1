//! A scope named as a field of an extractor (`auth.account_id`).

use axum::Router;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::routing::post;
use idempotent_axum::idempotent;

struct Auth {
    account_id: String,
    #[allow(dead_code)]
    role: &'static str,
}

impl<S: Send + Sync> FromRequestParts<S> for Auth {
    type Rejection = ();
    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, ()> {
        Ok(Auth {
            account_id: "acct".into(),
            role: "admin",
        })
    }
}

#[idempotent(
    scope = "auth.account_id",
    key = "optional",
    store_server_errors,
    max_response = "64KiB"
)]
async fn handler(auth: Auth, body: String) -> String {
    format!("{} {body}", auth.account_id)
}

fn main() {
    let _: Router = Router::new().route("/", post(handler));
}
