//! Runnable demos of `idempotent` (the charges example arrives with its issue).
