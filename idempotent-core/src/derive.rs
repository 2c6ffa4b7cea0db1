//! Keys for downstream calls, derived from the request's own key.
//!
//! A handler that calls another system (a payment provider, an email service) passes that
//! system an idempotency key of its own, so a re-run of the handler (after a crash, a 5xx, a
//! panic) does not charge twice downstream. The key must be the same on every run of the
//! same (scope, key), on every instance and after a restart, and reveal neither the caller
//! nor the client's key: it is an HMAC-SHA-256, under a server secret, of the length-prefixed
//! (scope, key, label), formatted as a UUID (version 8, RFC 9562), which providers accept
//! wherever they take a UUID or a string of up to 255 visible ASCII characters.
//!
//! ```
//! use idempotent_core::{DeriveSecret, Idempotent, IdempotencyKey, Scope};
//!
//! // In production the secret comes from your secret manager: the same bytes on every
//! // instance and across restarts (see "Rotation" in `DeriveSecret`).
//! let secret = DeriveSecret::new(b"0123456789abcdef0123456789abcdef")?;
//! let key = IdempotencyKey::parse(b"order-42")?;
//! let ctx = Idempotent::keyed(&secret, &Scope::new("acct_1")?, &key);
//!
//! let provider_key = ctx.derive("payment-provider");
//! // Stable: the same on every run, instance and restart...
//! let again = Idempotent::keyed(&secret, &Scope::new("acct_1")?, &key);
//! assert_eq!(again.derive("payment-provider"), provider_key);
//! // ...and distinct per label, per key and per caller.
//! assert_ne!(ctx.derive("email"), provider_key);
//! let other = Idempotent::keyed(&secret, &Scope::new("acct_2")?, &key);
//! assert_ne!(other.derive("payment-provider"), provider_key);
//! assert_eq!(provider_key.to_string().len(), 36); // 8-4-4-4-12 hex digits
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::key::IdempotencyKey;
use crate::scope::Scope;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

type HmacSha256 = Hmac<Sha256>;

/// Separates these MACs from any other use of the same secret; its version changes if the
/// derivation ever does (every derived key would change with it).
const DOMAIN: &[u8] = b"idempotent/derive/v1";

/// The server secret that derived keys are computed under: at least
/// [`DeriveSecret::MIN_LEN`] bytes, from your secret manager.
///
/// There is **no default**: a secret made up at start-up would give other keys after a
/// restart or on another instance, and a retry that re-runs the handler there would reach the
/// provider with a new key, which is a double charge downstream. Configure the same secret on
/// every instance that serves the same store.
///
/// # Rotation
/// A record's derived keys must stay the same for its whole ttl, and for as long as a retry
/// can still run its handler again, which can be longer: a released operation (a 5xx, a
/// panic) leaves no record, and a crashed one is taken over whenever its retry arrives, so
/// such an operation re-runs whenever its client retries, however late. Every re-run must
/// reach the provider with the key the first run used. A new secret therefore applies only
/// to operations first run after the switch; switch when no operation run under the old
/// secret can run again: after the longest ttl, and after your clients' retry deadline and
/// the provider's own key window (Stripe keeps keys 24 hours), whichever is latest. Or
/// accept that a handler re-run across the switch sends a new key downstream. Treat the
/// secret like a signing key: leaking it does not let anyone replay records, but lets them
/// link derived keys to the clients' keys.
///
/// # Reuse of a key
/// The derivation covers (scope, key, label), not the request: after a record expires, or
/// after a release, a client that reuses its key for a *different* request gets the same
/// downstream key, and the provider sees a key reused with other parameters (Stripe refuses
/// it with an error). Clients should use a fresh key per operation, as the IETF draft asks.
#[derive(Clone)]
pub struct DeriveSecret {
    /// The HMAC with the secret and the domain absorbed; each derivation clones it.
    mac: HmacSha256,
}

/// Why bytes cannot be a [`DeriveSecret`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// Fewer than [`DeriveSecret::MIN_LEN`] bytes.
    #[error(
        "the derive secret is {len} bytes long; use at least {} random bytes",
        DeriveSecret::MIN_LEN
    )]
    TooShort {
        /// Its length in bytes.
        len: usize,
    },
}

impl DeriveSecret {
    /// Shortest secret accepted, in bytes (256 bits, SHA-256's output size).
    pub const MIN_LEN: usize = 32;

    /// A secret from its bytes (for example 32 random bytes, or a long random string).
    ///
    /// # Errors
    /// [`SecretError::TooShort`] under [`DeriveSecret::MIN_LEN`] bytes.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, SecretError> {
        let secret = secret.as_ref();
        if secret.len() < Self::MIN_LEN {
            return Err(SecretError::TooShort { len: secret.len() });
        }
        let mut mac = HmacSha256::new_from_slice(secret)
            .map_err(|_| SecretError::TooShort { len: secret.len() })?;
        field(&mut mac, DOMAIN);
        Ok(DeriveSecret { mac })
    }

    /// The key of the logs' record hashes ([`crate::observe`]): one field after the domain,
    /// where a derived key has three, so it is never a derived key.
    pub(crate) fn log_key(&self) -> [u8; 32] {
        let mut mac = self.mac.clone();
        field(&mut mac, b"idempotent/log-hash/v1");
        mac.finalize().into_bytes().into()
    }
}

impl fmt::Debug for DeriveSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DeriveSecret(..)")
    }
}

/// Feeds one length-prefixed field, so no two field lists feed the same bytes (scope `a:b`
/// with key `c` and scope `a` with key `b:c` stay apart).
fn field(mac: &mut HmacSha256, bytes: &[u8]) {
    mac.update(&(bytes.len() as u64).to_be_bytes());
    mac.update(bytes);
}

/// The idempotency context of one execution: what a handler asks for keys to pass
/// downstream ([`Idempotent::derive`]).
///
/// `#[idempotent]` fills a handler parameter of this type (`idem: Idempotent`); the route's
/// configuration must then hold a [`DeriveSecret`], or its requests are refused with a logged
/// error and a 500, and the handler never runs.
#[derive(Clone)]
pub struct Idempotent {
    origin: Origin,
}

#[derive(Clone)]
enum Origin {
    /// The MAC with the secret, the domain, the scope and the key absorbed.
    Keyed(HmacSha256),
    /// A request without a key: one operation of its own.
    Unkeyed(uuid::Uuid),
}

impl Idempotent {
    /// The context of a request with (scope, key), under `secret`.
    pub fn keyed(secret: &DeriveSecret, scope: &Scope, key: &IdempotencyKey) -> Self {
        let mut mac = secret.mac.clone();
        field(&mut mac, scope.as_str().as_bytes());
        field(&mut mac, key.as_str().as_bytes());
        Idempotent {
            origin: Origin::Keyed(mac),
        }
    }

    /// The context of a request that runs without a key (a safe method, or no key on a route
    /// where it is optional): nothing ties it to another request, so it is its own logical
    /// operation, and its derived keys are random (the same for each label within it).
    pub fn unkeyed() -> Self {
        Idempotent {
            origin: Origin::Unkeyed(uuid::Uuid::new_v4()),
        }
    }

    /// Whether the request carried a key (derived keys are then stable across its retries).
    pub fn is_keyed(&self) -> bool {
        matches!(self.origin, Origin::Keyed(_))
    }

    /// The key to send to the downstream system named `label` (any text naming the call,
    /// such as `"payment-provider"` or `"welcome-email"`): the same on every run of this
    /// (scope, key), different for each label, revealing neither the scope nor the key.
    ///
    /// ```
    /// # use idempotent_core::{DeriveSecret, Idempotent, IdempotencyKey, Scope};
    /// # let secret = DeriveSecret::new([7u8; 32])?;
    /// # let idem = Idempotent::keyed(&secret, &Scope::new("acct_1")?, &IdempotencyKey::parse(b"k1")?);
    /// let key = idem.derive("payment-provider");
    /// // e.g. `Idempotency-Key: 5c0b…-…` on the call to the provider
    /// let header = key.to_string();
    /// assert!(header.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-'));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn derive(&self, label: &str) -> DerivedKey {
        let mut bytes = [0u8; 16];
        match &self.origin {
            Origin::Keyed(mac) => {
                let mut mac = mac.clone();
                field(&mut mac, label.as_bytes());
                bytes.copy_from_slice(&mac.finalize().into_bytes()[..16]);
            }
            Origin::Unkeyed(seed) => {
                // A hash of the per-request random seed: one random key per label.
                use sha2::Digest;
                let mut hash = Sha256::new();
                hash.update(seed.as_bytes());
                hash.update((label.len() as u64).to_be_bytes());
                hash.update(label.as_bytes());
                bytes.copy_from_slice(&hash.finalize()[..16]);
            }
        }
        DerivedKey(uuid::Builder::from_custom_bytes(bytes).into_uuid())
    }
}

impl fmt::Debug for Idempotent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the MAC state: it is a function of the secret, the scope and the key.
        f.debug_struct("Idempotent")
            .field("keyed", &self.is_keyed())
            .finish_non_exhaustive()
    }
}

/// A key for a downstream call ([`Idempotent::derive`]): a version-8 UUID whose 122 free bits
/// come from the MAC. `Display` writes the hyphenated lower-case form (36 characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DerivedKey(uuid::Uuid);

impl DerivedKey {
    /// As a UUID.
    pub fn as_uuid(&self) -> uuid::Uuid {
        self.0
    }
}

impl fmt::Display for DerivedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.hyphenated(), f)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn secret(b: u8) -> DeriveSecret {
        DeriveSecret::new([b; 32]).unwrap()
    }

    fn ctx(s: &DeriveSecret, scope: &str, key: &str) -> Idempotent {
        let scope = if scope.is_empty() {
            Scope::unscoped()
        } else {
            Scope::new(scope).unwrap()
        };
        Idempotent::keyed(s, &scope, &IdempotencyKey::parse(key.as_bytes()).unwrap())
    }

    #[test]
    fn matches_an_hmac_computed_by_hand() {
        // HMAC-SHA-256(secret, len(domain) ‖ domain ‖ len(scope) ‖ scope ‖ len(key) ‖ key ‖
        // len(label) ‖ label), first 16 bytes, version and variant bits set.
        let mut mac = HmacSha256::new_from_slice(&[1; 32]).unwrap();
        for part in [&b"idempotent/derive/v1"[..], b"acct", b"k1", b"pay"] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        let full = mac.finalize().into_bytes();
        let key = ctx(&secret(1), "acct", "k1").derive("pay").as_uuid();
        assert_eq!(key.get_version_num(), 8);
        assert_eq!(key.get_variant(), uuid::Variant::RFC4122);
        let b = key.as_bytes();
        // All bits but the 4 version and 2 variant bits are the MAC's.
        assert_eq!(b[..6], full[..6]);
        assert_eq!(b[6] & 0x0f, full[6] & 0x0f);
        assert_eq!(b[7], full[7]);
        assert_eq!(b[8] & 0x3f, full[8] & 0x3f);
        assert_eq!(b[9..], full[9..16]);
    }

    #[test]
    fn stable_and_separated() {
        let s = secret(1);
        let base = ctx(&s, "acct", "k1").derive("pay");
        assert_eq!(ctx(&s, "acct", "k1").derive("pay"), base);
        assert_ne!(ctx(&s, "acct", "k1").derive("pay2"), base);
        assert_ne!(ctx(&s, "acct", "k2").derive("pay"), base);
        assert_ne!(ctx(&s, "acct2", "k1").derive("pay"), base);
        assert_ne!(ctx(&s, "", "k1").derive("pay"), base);
        assert_ne!(ctx(&secret(2), "acct", "k1").derive("pay"), base);
        // Length prefixes: moving a boundary changes the key.
        assert_ne!(
            ctx(&s, "a:b", "c").derive("x"),
            ctx(&s, "a", "b:c").derive("x")
        );
        assert_ne!(
            ctx(&s, "ab", "c").derive("x"),
            ctx(&s, "a", "bc").derive("x")
        );
        assert_ne!(
            ctx(&s, "a", "b").derive("cx"),
            ctx(&s, "a", "bc").derive("x")
        );
        // The sf-string and bare forms of one key are one key.
        assert_eq!(
            ctx(&s, "a", "\"k1\"").derive("x"),
            ctx(&s, "a", "k1").derive("x")
        );
    }

    #[test]
    fn unkeyed_is_random_per_request_stable_per_label() {
        let a = Idempotent::unkeyed();
        assert!(!a.is_keyed());
        assert_eq!(a.derive("pay"), a.derive("pay"));
        assert_ne!(a.derive("pay"), a.derive("mail"));
        assert_ne!(a.derive("pay"), Idempotent::unkeyed().derive("pay"));
    }

    #[test]
    fn secrets_are_long_and_never_printed() {
        assert_eq!(
            DeriveSecret::new([0; 31]).unwrap_err(),
            SecretError::TooShort { len: 31 }
        );
        let s = DeriveSecret::new("a secret of at least thirty-two bytes").unwrap();
        assert_eq!(format!("{s:?}"), "DeriveSecret(..)");
        let c = ctx(&s, "acct", "k");
        assert!(!format!("{c:?}").contains("acct"));
    }
}
