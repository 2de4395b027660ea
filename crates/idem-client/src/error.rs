//! What a call can end in besides a value: a problem the server answered, a
//! key reused by mistake, retries given up, a transport failure.

use std::fmt;
use std::time::Duration;

/// The problem slugs of the contract (the `<slug>` of
/// `urn:idem:problem:<slug>`) that a client is likely to match on.
///
/// ```
/// use idem_client::{Problem, slug};
///
/// let p = Problem::new(402, slug::INSUFFICIENT_FUNDS, "Insufficient funds");
/// assert!(p.is(slug::INSUFFICIENT_FUNDS));
/// ```
pub mod slug {
    /// 400: malformed JSON, wrong types, unknown fields.
    pub const INVALID_REQUEST: &str = "invalid-request";
    /// 400: the route needs an `Idempotency-Key` and none was sent.
    pub const IDEMPOTENCY_KEY_MISSING: &str = "idempotency-key-missing";
    /// 400: the `Idempotency-Key` is not 1–255 printable ASCII characters.
    pub const IDEMPOTENCY_KEY_INVALID: &str = "idempotency-key-invalid";
    /// 401: missing or unknown bearer key.
    pub const UNAUTHORIZED: &str = "unauthorized";
    /// 402: the source's available balance does not cover the amount.
    pub const INSUFFICIENT_FUNDS: &str = "insufficient-funds";
    /// 402: the acquirer declined the card.
    pub const CARD_DECLINED: &str = "card-declined";
    /// 404: unknown route, or an id that does not exist for this consumer.
    pub const NOT_FOUND: &str = "not-found";
    /// 404: a charge names an account that does not exist for this consumer.
    pub const ACCOUNT_NOT_FOUND: &str = "account-not-found";
    /// 409: another attempt with this key is still in progress (retried).
    pub const IDEMPOTENCY_KEY_IN_USE: &str = "idempotency-key-in-use";
    /// 409: another key's charge with this `reference` is in progress (retried).
    pub const REFERENCE_IN_USE: &str = "reference-in-use";
    /// 409: a capture, cancel or refund of a charge in the wrong state.
    pub const INVALID_CHARGE_STATE: &str = "invalid-charge-state";
    /// 422: the key was used with another request body (never retried).
    pub const IDEMPOTENCY_KEY_REUSED: &str = "idempotency-key-reused";
    /// 422: an account id or charge reference exists with other fields.
    pub const RESOURCE_MISMATCH: &str = "resource-mismatch";
    /// 422: source and destination have different currencies.
    pub const CURRENCY_MISMATCH: &str = "currency-mismatch";
    /// 422: a refund larger than what is left to refund.
    pub const REFUND_EXCEEDS_CHARGE: &str = "refund-exceeds-charge";
    /// 422: a capture larger than the charge's `amount_capturable`.
    pub const CAPTURE_EXCEEDS_AUTHORIZATION: &str = "capture-exceeds-authorization";
    /// 503: a transient failure; retried after `Retry-After`.
    pub const TEMPORARILY_UNAVAILABLE: &str = "temporarily-unavailable";
}

/// An RFC 9457 problem the server answered: its slug, status, title and
/// detail, and the `Retry-After` it asked for, if any.
///
/// ```
/// use idem_client::Problem;
///
/// let p = Problem::new(409, "idempotency-key-in-use", "Idempotency key in use");
/// assert_eq!(p.to_string(), "409 idempotency-key-in-use: Idempotency key in use");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The status code of the answer.
    pub status: u16,
    /// The `<slug>` of `urn:idem:problem:<slug>`; see [`slug`]. An answer
    /// that was not a problem document (a proxy's HTML page, say) gets
    /// `http-<status>`.
    pub slug: String,
    /// The problem's short, human-readable summary.
    pub title: String,
    /// The explanation specific to this occurrence, if the server gave one.
    pub detail: Option<String>,
    /// `Retry-After` (delta-seconds), if the answer carried one.
    pub retry_after: Option<Duration>,
}

impl Problem {
    /// A problem with this status, slug and title, no detail and no
    /// `Retry-After`.
    ///
    /// ```
    /// let p = idem_client::Problem::new(404, "not-found", "Not found");
    /// assert_eq!((p.status, p.detail), (404, None));
    /// ```
    pub fn new(status: u16, slug: &str, title: &str) -> Problem {
        Problem {
            status,
            slug: slug.to_string(),
            title: title.to_string(),
            detail: None,
            retry_after: None,
        }
    }

    /// Whether this problem has the slug `slug`.
    ///
    /// ```
    /// use idem_client::{Problem, slug};
    ///
    /// assert!(Problem::new(404, "not-found", "Not found").is(slug::NOT_FOUND));
    /// ```
    pub fn is(&self, slug: &str) -> bool {
        self.slug == slug
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status, self.slug, self.title)?;
        if let Some(detail) = &self.detail {
            write!(f, " ({detail})")?;
        }
        Ok(())
    }
}

/// What went wrong below HTTP: the kind of failure and ureq's description
/// of it. The request may or may not have reached the server (and
/// committed): that is why the client retries these with the same key.
///
/// ```
/// use idem_client::{Transport, TransportKind};
///
/// let t = Transport::new(TransportKind::Timeout, "timeout: global");
/// assert_eq!(t.to_string(), "timed out: timeout: global");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transport {
    /// What kind of failure this was.
    pub kind: TransportKind,
    /// The HTTP library's description.
    pub message: String,
}

impl Transport {
    /// A transport failure of this kind.
    ///
    /// ```
    /// use idem_client::{Transport, TransportKind};
    ///
    /// assert!(Transport::new(TransportKind::Reset, "eof").is_retryable());
    /// ```
    pub fn new(kind: TransportKind, message: impl Into<String>) -> Transport {
        Transport {
            kind,
            message: message.into(),
        }
    }

    /// Whether a retry may help: everything except [`TransportKind::Other`]
    /// (a bad URL, a TLS configuration error, an answer over the size limit).
    ///
    /// ```
    /// use idem_client::{Transport, TransportKind};
    ///
    /// assert!(!Transport::new(TransportKind::Other, "bad uri").is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        self.kind != TransportKind::Other
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            TransportKind::Timeout => "timed out",
            TransportKind::Connect => "could not connect",
            TransportKind::Reset => "connection lost",
            TransportKind::Protocol => "malformed HTTP",
            TransportKind::Other => "request failed",
        };
        write!(f, "{kind}: {}", self.message)
    }
}

/// The kinds of [`Transport`] failure.
///
/// ```
/// use idem_client::TransportKind;
///
/// assert_ne!(TransportKind::Timeout, TransportKind::Reset);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// No answer within the per-request timeout (or what was left of the
    /// deadline). The server may have committed the request.
    Timeout,
    /// The connection could not be opened (refused, unreachable, DNS).
    Connect,
    /// The connection was reset or closed before a whole answer arrived.
    /// The server may have committed the request.
    Reset,
    /// The server's bytes were not valid HTTP.
    Protocol,
    /// Anything a retry will not fix.
    Other,
}

/// Why a call did not return a value.
///
/// ```
/// use idem_client::{Error, Problem};
///
/// let e = Error::KeyReused(Problem::new(422, "idempotency-key-reused", "Reused"));
/// assert_eq!(e.problem().map(|p| p.status), Some(422));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Error {
    /// A final answer that is not a success: a business outcome (402, 404,
    /// 409 `invalid-charge-state`, 422…) or a refusal (400, 401). Never
    /// retried: the same request would get the same answer.
    Problem(Problem),
    /// 422 `idempotency-key-reused`: this key was already used with another
    /// request body. That is a bug in the caller (a key reused across two
    /// intents, or a body that changed between retries), not a condition to
    /// retry; nothing was executed for this request.
    KeyReused(Problem),
    /// Every attempt failed in a retryable way and the attempt cap or the
    /// deadline was reached. The intent may or may not have taken effect:
    /// retry it later with the same key (see [`crate::Intent`]) to learn
    /// which.
    GaveUp {
        /// Attempts made.
        attempts: u32,
        /// Time from the first attempt to giving up.
        elapsed: std::time::Duration,
        /// The last attempt's failure (a [`Error::Problem`] such as a 503,
        /// or a [`Error::Transport`]).
        last: Box<Error>,
    },
    /// A transport failure. Retryable ones are retried and, at the end,
    /// reported inside [`Error::GaveUp`]; this variant alone is one that a
    /// retry cannot fix.
    Transport(Transport),
    /// The server answered with a body this client cannot read (another
    /// version of the API?). A 2xx that cannot be decoded did take effect.
    Decode {
        /// The answer's status.
        status: u16,
        /// What did not parse.
        message: String,
    },
    /// An idempotency key that is not 1–255 printable ASCII characters
    /// (0x21–0x7E), refused before anything is sent.
    InvalidKey(String),
    /// A client configuration that cannot work (a URL that is not
    /// `http://` or `https://`, a zero deadline…).
    Config(String),
}

impl Error {
    /// The server's problem, if this error is or ends in one (for
    /// [`Error::GaveUp`], the last attempt's).
    ///
    /// ```
    /// use idem_client::{Error, Problem};
    ///
    /// let last = Error::Problem(Problem::new(503, "temporarily-unavailable", "Unavailable"));
    /// let e = Error::GaveUp { attempts: 3, elapsed: Default::default(), last: Box::new(last) };
    /// assert_eq!(e.problem().unwrap().slug, "temporarily-unavailable");
    /// ```
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            Error::Problem(p) | Error::KeyReused(p) => Some(p),
            Error::GaveUp { last, .. } => last.problem(),
            _ => None,
        }
    }

    /// The HTTP status the server answered, if it answered.
    ///
    /// ```
    /// use idem_client::{Error, Problem};
    ///
    /// assert_eq!(Error::Problem(Problem::new(404, "not-found", "Not found")).status(), Some(404));
    /// assert_eq!(Error::Config("no".into()).status(), None);
    /// ```
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Decode { status, .. } => Some(*status),
            _ => self.problem().map(|p| p.status),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Problem(p) => write!(f, "{p}"),
            Error::KeyReused(p) => write!(
                f,
                "idempotency key reused with another request (a bug in the caller): {p}"
            ),
            Error::GaveUp {
                attempts,
                elapsed,
                last,
            } => write!(
                f,
                "gave up after {attempts} attempt(s) in {:.3} s; last: {last}",
                elapsed.as_secs_f64()
            ),
            Error::Transport(t) => write!(f, "{t}"),
            Error::Decode { status, message } => {
                write!(f, "could not read the {status} answer: {message}")
            }
            Error::InvalidKey(why) => write!(f, "invalid idempotency key: {why}"),
            Error::Config(why) => write!(f, "invalid client configuration: {why}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::GaveUp { last, .. } => Some(last.as_ref()),
            _ => None,
        }
    }
}
