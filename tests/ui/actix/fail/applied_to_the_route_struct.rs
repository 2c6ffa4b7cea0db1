//! `#[idempotent]` on what is not a function (here: the unit struct a route macro makes).
use idempotent_actix::idempotent;

#[idempotent(unscoped)]
#[allow(non_camel_case_types)]
struct create;

fn main() {}
