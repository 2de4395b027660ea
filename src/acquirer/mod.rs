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

/// The acquirer's answer to an authorization: approved, or declined (the
/// card issuer refused: a final business outcome, not a failure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthorizeOutcome {
    /// Authorized (and captured, for a sale).
    Approved(Authorization),
    /// Refused; no authorization exists, so nothing is to be voided. The
    /// charge answers 402 `card-declined`, stored and replayed.
    Declined(Declined),
}

impl AuthorizeOutcome {
    /// The authorization, if approved.
    pub fn approved(self) -> Option<Authorization> {
        match self {
            AuthorizeOutcome::Approved(a) => Some(a),
            AuthorizeOutcome::Declined(_) => None,
        }
    }
}

/// Why an authorization was declined, as the acquirer put it (logged, never
/// shown to the client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declined(pub String);

/// The acquirer could not answer (network, timeout, outage): a transient
/// failure, answered 503, after which the key resumes from its recovery point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

/// A third party that authorizes, captures, voids and refunds payments.
/// Implementations are called from many operation threads at once, outside
/// any database transaction. Every call carries an idempotency key derived
/// from the operation that makes it, so that a repeated call (a retry, a
/// takeover after a crash) has the effect of one.
pub trait Acquirer: Send + Sync {
    /// Authorizes `amount` of `currency`, or declines. Calls with the same
    /// `key` return the same authorization (and a real acquirer the same
    /// decline).
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
    ///
    /// With `capture`, the authorization is captured at once (a sale): a
    /// charge that moves the money now. Without, it is a hold, captured
    /// later by [`Acquirer::capture`] or released by [`Acquirer::void`].
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        deadline: Instant,
    ) -> Result<AuthorizeOutcome, Unavailable>;

    /// Captures `amount` (at most what was authorised) of `authorization`;
    /// the rest of it is released (one capture per authorization). Calls
    /// with the same `key` capture once. By `deadline`, as for
    /// [`Acquirer::authorize`].
    fn capture(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: Instant,
    ) -> Result<(), Unavailable>;

    /// Voids `authorization`: releases a hold, or reverses a sale that
    /// nothing was refunded of. Calls with the same `key` void once. By
    /// `deadline`.
    fn void(&self, key: &str, authorization: &str, deadline: Instant) -> Result<(), Unavailable>;

    /// Refunds `amount` of the captured `authorization`. Calls with the same
    /// `key` refund once. By `deadline`.
    fn refund(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: Instant,
    ) -> Result<(), Unavailable>;
}
