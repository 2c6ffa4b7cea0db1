//! The caller a record belongs to.

use std::fmt;

/// The caller's identity (account, tenant, user), as text.
///
/// A record is keyed by (scope, idempotency key): one caller can never replay, see or collide
/// with another caller's record. Routes without a caller use [`Scope::unscoped`], which no
/// scope value can produce (scope values are never empty).
///
/// **A scope is text.** An integer scope is its decimal text, so account `42` (an integer id)
/// and account `"42"` (the same id as a string) are one caller, as they are one account in
/// the application: an application that moves its ids from integers to strings, or reads the
/// id from a token where it is a string, keeps its records. Strings are compared exactly
/// (`"042"` is not `42`). An application whose integer and string ids name *different*
/// callers must give them different text through its own [`ScopeValue`] (a prefix, as in
/// `acct_7` below).
///
/// ```
/// use idempotent_core::{Scope, ScopeValue};
///
/// let a = 42_u64.to_scope()?;
/// let b = "42".to_scope()?;
/// assert_eq!(a, b);
/// assert_ne!(a, Scope::unscoped());
/// # Ok::<(), idempotent_core::ScopeError>(())
/// ```
///
/// A scope also knows whether every caller shares it (the unscoped namespace, and an unscoped
/// idempotent function's): that is set where the scope is built, never read from its text, so
/// a caller whose identity is spelled like a shared namespace is still one caller. Two scopes
/// with the same text are the same scope (equal, same hash), as they are in a SQL store.
#[derive(Clone)]
pub struct Scope {
    text: Box<str>,
    shared: bool,
}

impl PartialEq for Scope {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Scope {}

impl std::hash::Hash for Scope {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.text.hash(state);
    }
}

impl PartialOrd for Scope {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scope {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.text.cmp(&other.text)
    }
}

/// Why a value cannot be a scope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScopeError {
    /// The value is empty: an empty caller identity would share the unscoped namespace.
    #[error("the scope value is empty")]
    Empty,
    /// The value is longer than [`Scope::MAX_LEN`] bytes.
    #[error(
        "the scope value is {len} bytes long; at most {} are allowed",
        Scope::MAX_LEN
    )]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The value contains a NUL character, which SQL stores cannot hold.
    #[error("the scope value contains a NUL character")]
    Nul,
}

impl Scope {
    /// Longest scope accepted, in bytes.
    pub const MAX_LEN: usize = 1024;

    /// A scope from a caller identity.
    ///
    /// # Errors
    /// [`ScopeError`] when the value is empty, too long or holds NUL.
    pub fn new(value: impl Into<String>) -> Result<Self, ScopeError> {
        let value = value.into();
        if value.is_empty() {
            return Err(ScopeError::Empty);
        }
        if value.len() > Self::MAX_LEN {
            return Err(ScopeError::TooLong { len: value.len() });
        }
        if value.contains('\0') {
            return Err(ScopeError::Nul);
        }
        Ok(Scope {
            text: value.into_boxed_str(),
            shared: false,
        })
    }

    /// The namespace of routes that declared `unscoped`: every caller shares it.
    pub fn unscoped() -> Self {
        Scope {
            text: Box::default(),
            shared: true,
        }
    }

    /// The namespace of the idempotent function `name` for `caller`
    /// (`call:<len>:<name>:<caller>`, see [`Call`](crate::call::Call)): shared by every
    /// caller when `caller` is.
    pub(crate) fn function(name: &str, caller: &Scope) -> Result<Self, ScopeError> {
        let mut scope = Scope::new(format!("call:{}:{name}:{}", name.len(), caller.as_str()))?;
        scope.shared = caller.shared;
        Ok(scope)
    }

    /// Whether this is the unscoped namespace.
    pub fn is_unscoped(&self) -> bool {
        self.text.is_empty()
    }

    /// Whether every caller shares this namespace: the unscoped one, or an unscoped idempotent
    /// function's. Set where the scope was built ([`Scope::unscoped`], `Scope::function`),
    /// never guessed from its text; a scope read back from a store is shared only if it is
    /// the unscoped one.
    pub(crate) fn is_shared(&self) -> bool {
        self.shared
    }

    /// The scope's text (empty for [`Scope::unscoped`]).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Rebuilds a scope read back from a store (no validation: stores only hold valid scopes).
    #[doc(hidden)]
    pub fn from_stored(value: String) -> Self {
        Scope {
            shared: value.is_empty(),
            text: value.into_boxed_str(),
        }
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_unscoped() {
            f.write_str("Scope(<unscoped>)")
        } else {
            f.debug_tuple("Scope").field(&&*self.text).finish()
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_unscoped() {
            f.write_str("<unscoped>")
        } else {
            f.write_str(&self.text)
        }
    }
}

/// A value that identifies the caller, usable as `#[idempotent(scope = "…")]`.
///
/// Implemented for strings, integers, [`uuid::Uuid`], [`Scope`] and references to any of
/// them. Implement it for your own identity type (an `AccountId` newtype, say) by returning
/// the stable text that identifies the caller.
///
/// ```
/// use idempotent_core::{Scope, ScopeError, ScopeValue};
///
/// struct AccountId(u64);
/// impl ScopeValue for AccountId {
///     fn to_scope(&self) -> Result<Scope, ScopeError> {
///         Scope::new(format!("acct_{}", self.0))
///     }
/// }
/// assert_eq!(AccountId(7).to_scope()?.as_str(), "acct_7");
/// # Ok::<(), ScopeError>(())
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idempotency scope",
    label = "this parameter is named in `scope = \"…\"`, so its type must implement `ScopeValue`",
    note = "implement `ScopeValue` for `{Self}` (it is re-exported by your adapter: `idempotent_axum::ScopeValue` or `idempotent_actix::ScopeValue`) returning the caller's stable id, or name a field with `scope = \"param.field\"`"
)]
pub trait ScopeValue {
    /// The scope this value stands for.
    ///
    /// # Errors
    /// [`ScopeError`] when the value cannot identify a caller (for example, it is empty).
    fn to_scope(&self) -> Result<Scope, ScopeError>;
}

impl ScopeValue for Scope {
    fn to_scope(&self) -> Result<Scope, ScopeError> {
        Ok(self.clone())
    }
}

impl ScopeValue for str {
    fn to_scope(&self) -> Result<Scope, ScopeError> {
        Scope::new(self)
    }
}

impl ScopeValue for String {
    fn to_scope(&self) -> Result<Scope, ScopeError> {
        Scope::new(self.as_str())
    }
}

impl ScopeValue for std::borrow::Cow<'_, str> {
    fn to_scope(&self) -> Result<Scope, ScopeError> {
        Scope::new(self.as_ref())
    }
}

impl ScopeValue for uuid::Uuid {
    fn to_scope(&self) -> Result<Scope, ScopeError> {
        Scope::new(self.hyphenated().to_string())
    }
}

impl<T: ScopeValue + ?Sized> ScopeValue for &T {
    fn to_scope(&self) -> Result<Scope, ScopeError> {
        (**self).to_scope()
    }
}

impl<T: ScopeValue + ?Sized> ScopeValue for Box<T> {
    fn to_scope(&self) -> Result<Scope, ScopeError> {
        (**self).to_scope()
    }
}

impl<T: ScopeValue + ?Sized> ScopeValue for std::sync::Arc<T> {
    fn to_scope(&self) -> Result<Scope, ScopeError> {
        (**self).to_scope()
    }
}

macro_rules! int_scope {
    ($($t:ty),*) => {$(
        impl ScopeValue for $t {
            fn to_scope(&self) -> Result<Scope, ScopeError> {
                Scope::new(self.to_string())
            }
        }
    )*};
}
int_scope!(
    u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize
);
int_scope!(
    std::num::NonZeroU32,
    std::num::NonZeroU64,
    std::num::NonZeroI32,
    std::num::NonZeroI64
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values() {
        assert_eq!("".to_scope(), Err(ScopeError::Empty));
        assert_eq!("a\0b".to_scope(), Err(ScopeError::Nul));
        assert_eq!(String::from("acct").to_scope().unwrap().as_str(), "acct");
        assert_eq!((-3_i32).to_scope().unwrap().as_str(), "-3");
        let id = uuid::Uuid::nil();
        assert_eq!(
            id.to_scope().unwrap().as_str(),
            "00000000-0000-0000-0000-000000000000"
        );
        assert!(Scope::unscoped().is_unscoped());
        assert!("x".repeat(Scope::MAX_LEN + 1).to_scope().is_err());
    }

    /// Sharedness is set where a scope is built, never read from its text.
    #[test]
    fn shared_namespaces() {
        assert!(Scope::unscoped().is_shared());
        let unscoped_fn = Scope::function("book", &Scope::unscoped()).unwrap();
        assert_eq!(unscoped_fn.as_str(), "call:4:book:");
        assert!(unscoped_fn.is_shared());
        let tenant_fn = Scope::function("book", &Scope::new("acme").unwrap()).unwrap();
        assert_eq!(tenant_fn.as_str(), "call:4:book:acme");
        assert!(!tenant_fn.is_shared());
        // A caller spelled like a shared namespace is one caller, yet the same record scope.
        let spelled = Scope::new("call:4:book:").unwrap();
        assert!(!spelled.is_shared());
        assert_eq!(spelled, unscoped_fn);
        assert!(Scope::from_stored(String::new()).is_shared());
        assert!(!Scope::from_stored("call:4:book:".into()).is_shared());
    }

    /// Integer and string ids with the same decimal text are one scope; anything else is not.
    #[test]
    fn integer_and_string_scopes() {
        let text = "42".to_scope().unwrap();
        for same in [
            42_u64.to_scope(),
            42_i32.to_scope(),
            42_u8.to_scope(),
            std::num::NonZeroU64::new(42).unwrap().to_scope(),
            String::from("42").to_scope(),
        ] {
            assert_eq!(same.unwrap(), text);
        }
        for other in ["042", "+42", "42.0", " 42", "-42"] {
            assert_ne!(other.to_scope().unwrap(), text, "{other}");
        }
        assert_ne!((-42_i64).to_scope().unwrap(), text);
    }
}
