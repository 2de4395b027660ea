//! The acquirer: the only work that leaves the process. A trait, so that an
//! embedding test can inject a slow or failing one, and the built-in
//! [`Simulator`].
//!
//! Every call carries an acquirer-side idempotency key derived from the
//! operation (its `op_id`), so the owner that takes a key over after a crash
//! gets the authorization the first owner got instead of a second one.

mod simulator;

use std::time::Instant;

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
    ///
    /// Implementations must return by `deadline`: a real one uses the time
    /// left as its HTTP timeout (connect, request and response together)
    /// and answers [`Unavailable`] once it passes. The owner then unlocks
    /// its key and answers 503, and the next retry calls again with the
    /// same `key`, which is what makes giving up safe: the acquirer may
    /// have authorized, and will say so.
    ///
    /// The caller cannot cancel a call that overruns (a blocked thread
    /// cannot be interrupted), so it waits: the answer is still recorded if
    /// the owner still holds its key. An overrun long enough to pass the
    /// in-flight timeout gets the key taken over and this owner fenced off
    /// (its answer is never applied twice), but its client waits all that
    /// time, and an overrun is logged. The deadline is at most
    /// `--acquirer-timeout` away, and leaves at least as long again before
    /// the owner's lock could be taken over.
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        deadline: Instant,
    ) -> Result<Authorization, Unavailable>;
}
