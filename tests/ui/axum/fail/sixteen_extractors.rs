use axum::Router;
use axum::http::{HeaderMap, Method, Uri};
use axum::routing::post;
use idempotent_axum::idempotent;

// Sixteen extractors are as many as axum takes; the hidden context would be the seventeenth.
#[idempotent(unscoped)]
async fn handler(
    a: Method,
    b: Method,
    c: Method,
    d: Method,
    e: Uri,
    f: Uri,
    g: Uri,
    h: Uri,
    i: HeaderMap,
    j: HeaderMap,
    k: HeaderMap,
    l: HeaderMap,
    m: Method,
    n: Uri,
    o: HeaderMap,
    body: String,
) -> String {
    let _ = (a, b, c, d, e, f, g, h, i, j, k, l, m, n, o);
    body
}

fn main() {
    let _: Router = Router::new().route("/", post(handler));
}
