//! The acquirer: the only work that leaves the process. A trait, so that an
//! embedding test can inject a slow or failing one, and the built-in
//! [`Simulator`].
//!
//! Every call carries an acquirer-side idempotency key derived from the
//! operation (its `op_id`), so the owner that takes a key over after a crash
//! gets the authorization the first owner got instead of a second one.

mod simulator;

pub use simulator::{Call, CallKind, Clock, Simulator, StoredAuthorization};

/// An approved authorization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorization {
    /// The acquirer's id of the authorization (the simulator's: `auth_…`).
    pub id: String,
}

/// The acquirer could not answer (network, timeout, outage): a transient
/// failure, answered 503, after which the key resumes from its recovery point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

/// A third party that authorizes payments. Implementations are called from
/// many operation threads at once, outside any database transaction.
pub trait Acquirer: Send + Sync {
    /// Authorizes `amount` of `currency`. Calls with the same `key` return
    /// the same authorization.
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
    ) -> Result<Authorization, Unavailable>;
}
