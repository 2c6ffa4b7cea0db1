//! The fence: the token a claim hands out and every later write to the record carries.
//!
//! A claim makes a fresh [`LeaseToken`] and stores it in the record with the lease's end.
//! `complete`, `release` and `extend` name the record *and* the token, and each store applies
//! them only while the record still holds that token (`WHERE token = $1` in SQL, a comparison
//! under the shard's lock in memory). After a take-over the record holds the new attempt's
//! token, so a late write from the attempt that lost its lease is refused
//! ([`StoreError::StaleLease`](crate::StoreError::StaleLease)) and can never overwrite the
//! new attempt's record or a stored response.

use std::fmt;
use std::time::SystemTime;

/// The secret that fences one attempt's writes to its record (a random UUID v4).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(uuid::Uuid);

impl LeaseToken {
    /// A fresh random token.
    pub fn generate() -> Self {
        LeaseToken(uuid::Uuid::new_v4())
    }

    /// The token as a UUID (for stores).
    pub fn as_uuid(&self) -> uuid::Uuid {
        self.0
    }

    /// Rebuilds a token read from a store.
    pub fn from_uuid(id: uuid::Uuid) -> Self {
        LeaseToken(id)
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({})", self.0)
    }
}

/// An attempt's ownership of an `in_progress` record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Fences `complete`, `release` and `extend`.
    pub token: LeaseToken,
    /// Until when (store clock) no other attempt can take the record over.
    pub locked_until: SystemTime,
    /// Whether this claim took over an expired record or a lease that had run out.
    pub took_over: bool,
}
