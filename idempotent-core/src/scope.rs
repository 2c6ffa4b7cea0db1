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
/// **`call:` is reserved.** Idempotent functions keep their records under scopes
/// `call:<len>:<name>:<caller>` (see [`Call`](crate::call::Call)), which only the library
/// builds: [`Scope::new`], and so every [`ScopeValue`], refuses text starting with
/// [`Scope::RESERVED_PREFIX`] ([`ScopeError::Reserved`]; over HTTP, the 400 problem of any
/// unusable scope), so no caller can spell a function's namespace and hold its records.
///
/// A scope also knows whether every caller shares it (the unscoped namespace, and an unscoped
/// idempotent function's): that is set where the scope is built, never read from its text.
/// Two scopes with the same text are the same scope (equal, same hash), as they are in a SQL
/// store.
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
    /// The value starts with `call:`, the prefix reserved for idempotent functions' namespaces
    /// ([`Scope::RESERVED_PREFIX`]): a caller spelled so would share a function's records.
    #[error(
        "the scope value starts with `{}`, which is reserved for idempotent functions",
        Scope::RESERVED_PREFIX
    )]
    Reserved,
}

impl Scope {
    /// Longest scope accepted, in bytes.
    pub const MAX_LEN: usize = 1024;

    /// The prefix of idempotent functions' namespaces (`call:<len>:<name>:<caller>`, see
    /// [`Call`](crate::call::Call)), which no caller identity may start with.
    pub const RESERVED_PREFIX: &'static str = "call:";

    /// A scope from a caller identity.
    ///
    /// # Errors
    /// [`ScopeError`] when the value is empty, too long, holds NUL, or starts with
    /// [`Scope::RESERVED_PREFIX`] (`call:`): that text is an idempotent function's namespace,
    /// and a caller spelled so would share the function's records.
    pub fn new(value: impl Into<String>) -> Result<Self, ScopeError> {
        let value = value.into();
        if value.starts_with(Self::RESERVED_PREFIX) {
            return Err(ScopeError::Reserved);
        }
        Self::checked(value, false)
    }

    /// A scope of `value` if it is not empty, not too long and free of NUL.
    fn checked(value: String, shared: bool) -> Result<Self, ScopeError> {
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
            shared,
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
        // The one place a scope may start with the reserved prefix.
        let text = format!(
            "{}{}:{name}:{}",
            Self::RESERVED_PREFIX,
            name.len(),
            caller.as_str()
        );
        Self::checked(text, caller.shared)
    }

    /// Whether this is the unscoped namespace.
    pub fn is_unscoped(&self) -> bool {
        self.text.is_empty()
    }

    /// Whether every caller shares this namespace: the unscoped one, or an unscoped idempotent
    /// function's. Set where the scope was built ([`Scope::unscoped`], `Scope::function`),
    /// never guessed from its text.
    pub(crate) fn is_shared(&self) -> bool {
        self.shared
    }

    /// The scope's text (empty for [`Scope::unscoped`]).
    pub fn as_str(&self) -> &str {
        &self.text
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
    }

    /// No caller identity can spell a function's namespace: `call:` is reserved, so a caller
    /// whose id reads `call:4:book:acme` can never hold (or pre-claim) the records of function
    /// `book` for tenant `acme`, nor of the unscoped `book`.
    #[test]
    fn function_namespaces_cannot_be_spelled() {
        let unscoped_fn = Scope::function("book", &Scope::unscoped()).unwrap();
        let tenant_fn = Scope::function("book", &Scope::new("acme").unwrap()).unwrap();
        for (text, function) in [
            ("call:4:book:", &unscoped_fn),
            ("call:4:book:acme", &tenant_fn),
        ] {
            let spelled = Scope::new(text);
            assert!(
                spelled.as_ref() != Ok(function),
                "the identity {text:?} is the record scope of a function: {spelled:?}"
            );
            assert_eq!(spelled, Err(ScopeError::Reserved), "{text}");
            assert_eq!(text.to_scope(), Err(ScopeError::Reserved), "{text}");
            assert_eq!(String::from(text).to_scope(), Err(ScopeError::Reserved));
        }
        // Only the prefix is reserved: `call` alone, or `call:` inside an id, is an identity.
        for fine in ["call", "calls:1", "Call:4:book:", "acct:call:4:book:"] {
            assert!(Scope::new(fine).is_ok(), "{fine}");
        }
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
