//! What the API answers, as plain data: [`Reply`] (status, headers, body) and
//! [`Problem`], the one place where an error becomes a status, a problem slug
//! and an RFC 9457 body. Knows no HTTP library.

use serde::Serialize;

use crate::config::{RETRY_AFTER_IN_USE_SECONDS, RETRY_AFTER_UNAVAILABLE_SECONDS};
use crate::idempotency::StoredResponse;

pub const JSON: &str = "application/json";
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The OpenAPI 3.1 document of this API, served at `GET /openapi.json`
/// byte for byte as the repository keeps it (`openapi.json`).
pub const OPENAPI_DOCUMENT: &str = include_str!("../openapi.json");

/// A response, independent of the HTTP engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    /// Extra headers; names in lower case.
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    /// Close the connection after this response (the body was not read).
    pub close: bool,
    /// How the engine hands it over: at once, after a wait, or not at all
    /// (the sandbox's `response=` and `crash=` directives).
    pub handover: Handover,
}

/// How the HTTP engine hands a [`Reply`] over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Handover {
    /// Send it now (every reply outside the sandbox).
    #[default]
    Send,
    /// Send it after this long, on the connection task: no thread waits.
    After(std::time::Duration),
    /// Close the connection without answering, as a crashed process or a
    /// lost answer would.
    Abandon,
}

impl Reply {
    pub fn json(status: u16, body: &impl Serialize) -> Reply {
        Reply::raw(
            status,
            JSON,
            serde_json::to_vec(body).expect("serialisable body"),
        )
    }

    pub fn raw(status: u16, content_type: &'static str, body: Vec<u8>) -> Reply {
        Reply {
            status,
            content_type,
            headers: Vec::new(),
            body,
            close: false,
            handover: Handover::Send,
        }
    }

    /// No answer at all: the connection is closed unanswered (a sandbox
    /// crash or `response=drop`). Seen without HTTP ([`Answer::wait`]) it
    /// is a 500, since nothing was answered.
    pub fn abandoned() -> Reply {
        Reply {
            handover: Handover::Abandon,
            ..Problem::Internal.reply()
        }
    }

    /// A stored answer, byte for byte. `replayed` adds
    /// `Idempotent-Replayed: true`: a replay of a key, or a first answer that
    /// names what already existed (an account's natural id, a charge's
    /// `reference`).
    pub fn stored(stored: StoredResponse, replayed: bool) -> Reply {
        let content_type = if stored.status >= 400 {
            PROBLEM_JSON
        } else {
            JSON
        };
        let reply = Reply::raw(stored.status, content_type, stored.body);
        if replayed {
            reply.header("idempotent-replayed", "true")
        } else {
            reply
        }
    }

    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Reply {
        self.headers.push((name, value.into()));
        self
    }

    #[cfg(any(test, feature = "internals"))]
    pub fn to_stored(&self) -> StoredResponse {
        StoredResponse {
            status: self.status,
            body: self.body.clone(),
        }
    }
}

/// Hands a reply to whoever waits for it (the HTTP connection).
pub type Deliver = Box<dyn FnOnce(Reply) + Send>;

/// What a handler returns: a reply now, or work that will deliver its reply
/// later from another thread, so the handler's thread is free at once (an
/// owned charge may wait seconds for its acquirer; a duplicate of it, a GET
/// or /healthz must not wait behind it).
pub enum Answer {
    Now(Reply),
    /// Called once with where to deliver; must not block.
    Later(Box<dyn FnOnce(Deliver) + Send>),
}

impl Answer {
    /// Blocks until the reply is there: for callers without an event loop
    /// (the benches' no-HTTP floor, through `Server::app`).
    #[cfg(any(test, feature = "internals"))]
    pub fn wait(self) -> Reply {
        match self {
            Answer::Now(reply) => reply,
            Answer::Later(start) => {
                let (tx, rx) = crossbeam_channel::bounded(1);
                start(Box::new(move |reply| {
                    let _ = tx.send(reply);
                }));
                rx.recv().unwrap_or_else(|_| Problem::Internal.reply())
            }
        }
    }

    /// Calls `f` exactly once with the reply when it is there (for
    /// metrics) — with a 500 if the reply is never delivered (a task that
    /// panicked drops its `Deliver`, and the client gets a 500).
    pub fn inspect(self, f: impl FnOnce(&Reply) + Send + 'static) -> Answer {
        match self {
            Answer::Now(reply) => {
                f(&reply);
                Answer::Now(reply)
            }
            Answer::Later(start) => Answer::Later(Box::new(move |deliver: Deliver| {
                let mut once = OnDrop(Some(f));
                start(Box::new(move |reply| {
                    if let Some(f) = once.0.take() {
                        f(&reply);
                    }
                    deliver(reply);
                }))
            })),
        }
    }
}

/// Holds an observer; if dropped before it ran, it observes a 500.
struct OnDrop<F: FnOnce(&Reply)>(Option<F>);

impl<F: FnOnce(&Reply)> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(&Problem::Internal.reply());
        }
    }
}

impl From<Reply> for Answer {
    fn from(reply: Reply) -> Answer {
        Answer::Now(reply)
    }
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answer::Now(reply) => f.debug_tuple("Now").field(reply).finish(),
            Answer::Later(_) => f.write_str("Later(..)"),
        }
    }
}

/// Every error the API answers, with the contract's slugs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    InvalidRequest(String),
    BodyTooLarge,
    IdempotencyKeyMissing,
    IdempotencyKeyInvalid,
    IdempotencyKeyReused,
    IdempotencyKeyInUse,
    /// Another key's charge with the same `reference` is in progress.
    ReferenceInUse,
    Unauthorized,
    NotFound,
    MethodNotAllowed {
        allow: &'static str,
    },
    AccountNotFound,
    InsufficientFunds,
    CurrencyMismatch,
    ResourceMismatch,
    RefundExceedsCharge,
    /// A capture or cancel of a charge that is not `requires_capture` (or
    /// that another capture or cancel claimed first), a capture after the
    /// hold expired, or a refund of money not captured; the detail says
    /// which.
    InvalidChargeState(String),
    /// A capture of more than the charge's `amount_capturable`.
    CaptureExceedsAuthorization,
    /// A balance would leave the range of a 64-bit integer.
    BalanceOverflow,
    /// The consumer already has `WEBHOOK_ENDPOINTS_MAX` live webhook
    /// endpoints.
    WebhookEndpointLimit,
    /// An inbound notification's signature is missing, wrong or too old,
    /// or its source does not exist (indistinguishable on purpose); the
    /// detail says which header or rule, never whether the source exists.
    SignatureInvalid(String),
    /// A notification's `webhook-id` (its idempotency key) is not 1 to 255
    /// printable ASCII characters.
    WebhookIdInvalid,
    /// A chargeback of more than the charge has left
    /// (`amount_captured - amount_refunded - amount_disputed`).
    DisputeExceedsCharge,
    TemporarilyUnavailable(String),
    /// The acquirer declined the authorization (in the sandbox:
    /// `Idem-Simulate: acquirer=decline`); stored and replayed.
    CardDeclined,
    /// An `Idem-Simulate` header outside sandbox mode.
    SimulationDisabled,
    Internal,
}

#[derive(Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: String,
}

impl Problem {
    pub fn status(&self) -> u16 {
        match self {
            Problem::InvalidRequest(_)
            | Problem::IdempotencyKeyMissing
            | Problem::IdempotencyKeyInvalid
            | Problem::SimulationDisabled => 400,
            Problem::WebhookIdInvalid => 400,
            Problem::Unauthorized | Problem::SignatureInvalid(_) => 401,
            Problem::InsufficientFunds | Problem::CardDeclined => 402,
            Problem::NotFound | Problem::AccountNotFound => 404,
            Problem::MethodNotAllowed { .. } => 405,
            Problem::IdempotencyKeyInUse
            | Problem::ReferenceInUse
            | Problem::InvalidChargeState(_) => 409,
            Problem::BodyTooLarge => 413,
            Problem::IdempotencyKeyReused
            | Problem::CurrencyMismatch
            | Problem::ResourceMismatch
            | Problem::RefundExceedsCharge
            | Problem::CaptureExceedsAuthorization
            | Problem::BalanceOverflow
            | Problem::WebhookEndpointLimit => 422,
            Problem::DisputeExceedsCharge => 422,
            Problem::Internal => 500,
            Problem::TemporarilyUnavailable(_) => 503,
        }
    }

    pub fn slug(&self) -> &'static str {
        match self {
            Problem::InvalidRequest(_) => "invalid-request",
            Problem::BodyTooLarge => "body-too-large",
            Problem::IdempotencyKeyMissing => "idempotency-key-missing",
            Problem::IdempotencyKeyInvalid => "idempotency-key-invalid",
            Problem::IdempotencyKeyReused => "idempotency-key-reused",
            Problem::IdempotencyKeyInUse => "idempotency-key-in-use",
            Problem::ReferenceInUse => "reference-in-use",
            Problem::Unauthorized => "unauthorized",
            Problem::NotFound => "not-found",
            Problem::MethodNotAllowed { .. } => "method-not-allowed",
            Problem::AccountNotFound => "account-not-found",
            Problem::InsufficientFunds => "insufficient-funds",
            Problem::CurrencyMismatch => "currency-mismatch",
            Problem::ResourceMismatch => "resource-mismatch",
            Problem::RefundExceedsCharge => "refund-exceeds-charge",
            Problem::InvalidChargeState(_) => "invalid-charge-state",
            Problem::CaptureExceedsAuthorization => "capture-exceeds-authorization",
            Problem::BalanceOverflow => "balance-overflow",
            Problem::WebhookEndpointLimit => "webhook-endpoint-limit",
            Problem::SignatureInvalid(_) => "signature-invalid",
            Problem::WebhookIdInvalid => "idempotency-key-invalid",
            Problem::DisputeExceedsCharge => "dispute-exceeds-charge",
            Problem::TemporarilyUnavailable(_) => "temporarily-unavailable",
            Problem::CardDeclined => "card-declined",
            Problem::SimulationDisabled => "simulation-disabled",
            Problem::Internal => "internal-error",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Problem::InvalidRequest(_) => "Invalid request",
            Problem::BodyTooLarge => "Request body too large",
            Problem::IdempotencyKeyMissing => "Idempotency-Key header missing",
            Problem::IdempotencyKeyInvalid => "Idempotency-Key header invalid",
            Problem::IdempotencyKeyReused => "Idempotency key reused with another request",
            Problem::IdempotencyKeyInUse => "Idempotency key in use",
            Problem::ReferenceInUse => "Reference in use",
            Problem::Unauthorized => "Unauthorized",
            Problem::NotFound => "Not found",
            Problem::MethodNotAllowed { .. } => "Method not allowed",
            Problem::AccountNotFound => "Account not found",
            Problem::InsufficientFunds => "Insufficient funds",
            Problem::CurrencyMismatch => "Currency mismatch",
            Problem::ResourceMismatch => "Resource mismatch",
            Problem::RefundExceedsCharge => "Refund exceeds charge",
            Problem::InvalidChargeState(_) => "Invalid charge state",
            Problem::CaptureExceedsAuthorization => "Capture exceeds authorization",
            Problem::BalanceOverflow => "Balance overflow",
            Problem::WebhookEndpointLimit => "Too many webhook endpoints",
            Problem::SignatureInvalid(_) => "Signature invalid",
            Problem::WebhookIdInvalid => "webhook-id header invalid",
            Problem::DisputeExceedsCharge => "Dispute exceeds charge",
            Problem::TemporarilyUnavailable(_) => "Temporarily unavailable",
            Problem::CardDeclined => "Card declined",
            Problem::SimulationDisabled => "Simulation disabled",
            Problem::Internal => "Internal error",
        }
    }

    fn detail(&self) -> String {
        match self {
            Problem::InvalidRequest(detail)
            | Problem::TemporarilyUnavailable(detail)
            | Problem::InvalidChargeState(detail)
            | Problem::SignatureInvalid(detail) => detail.clone(),
            Problem::WebhookIdInvalid => format!(
                "a webhook-id is 1 to {} printable ASCII characters without spaces",
                crate::config::IDEMPOTENCY_KEY_LEN_MAX
            ),
            Problem::DisputeExceedsCharge => "the chargeback exceeds what is left of the charge \
                 (amount_captured - amount_refunded - amount_disputed)"
                .into(),
            Problem::BodyTooLarge => format!(
                "the body is larger than {} bytes",
                crate::config::BODY_SIZE_MAX_BYTES
            ),
            Problem::IdempotencyKeyMissing => {
                "this route requires an Idempotency-Key header".into()
            }
            Problem::IdempotencyKeyInvalid => format!(
                "an Idempotency-Key is 1 to {} printable ASCII characters without spaces",
                crate::config::IDEMPOTENCY_KEY_LEN_MAX
            ),
            Problem::IdempotencyKeyReused => {
                "this key was used with a different request body".into()
            }
            Problem::IdempotencyKeyInUse => {
                "a request with this key is still in progress; retry later".into()
            }
            Problem::ReferenceInUse => {
                "a charge with this reference is in progress under another key; retry later".into()
            }
            Problem::Unauthorized => "send Authorization: Bearer <secret key>".into(),
            Problem::NotFound => "no such resource".into(),
            Problem::MethodNotAllowed { allow } => format!("allowed: {allow}"),
            Problem::AccountNotFound => "the source or destination account does not exist".into(),
            Problem::InsufficientFunds => {
                "the account would go below zero and does not allow it".into()
            }
            Problem::CurrencyMismatch => {
                "the charge currency differs from an account's currency".into()
            }
            Problem::ResourceMismatch => {
                "a resource with this id or reference exists with other fields".into()
            }
            Problem::RefundExceedsCharge => "the amount exceeds what is left to refund".into(),
            Problem::CaptureExceedsAuthorization => {
                "the amount exceeds the charge's amount_capturable".into()
            }
            Problem::BalanceOverflow => "a balance would exceed the representable range".into(),
            Problem::WebhookEndpointLimit => format!(
                "a consumer may have at most {} webhook endpoints; delete one first",
                crate::config::WEBHOOK_ENDPOINTS_MAX
            ),
            Problem::CardDeclined => "the acquirer declined the authorization".into(),
            Problem::SimulationDisabled => {
                "Idem-Simulate is honoured only by a server started with --sandbox".into()
            }
            Problem::Internal => "an internal error occurred; the request can be retried".into(),
        }
    }

    pub fn body(&self) -> Vec<u8> {
        serde_json::to_vec(&ProblemBody {
            kind: format!("urn:idem:problem:{}", self.slug()),
            title: self.title(),
            status: self.status(),
            detail: self.detail(),
        })
        .expect("serialisable problem")
    }

    pub fn reply(&self) -> Reply {
        let reply = Reply::raw(self.status(), PROBLEM_JSON, self.body());
        match self {
            Problem::IdempotencyKeyInUse | Problem::ReferenceInUse => {
                reply.header("retry-after", RETRY_AFTER_IN_USE_SECONDS.to_string())
            }
            Problem::TemporarilyUnavailable(_) => {
                reply.header("retry-after", RETRY_AFTER_UNAVAILABLE_SECONDS.to_string())
            }
            Problem::MethodNotAllowed { allow } => reply.header("allow", *allow),
            // RFC 9110 §11.6.1: a 401 names the scheme it wants.
            Problem::Unauthorized => reply.header("www-authenticate", "Bearer"),
            _ => reply,
        }
    }
}

impl From<crate::error::Error> for Problem {
    fn from(e: crate::error::Error) -> Problem {
        if e.is_transient() {
            Problem::TemporarilyUnavailable(e.to_string())
        } else {
            log::error!("internal error: {e}");
            Problem::Internal
        }
    }
}
