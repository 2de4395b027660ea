//! The API's objects as typed values: what the client sends (`New*`,
//! [`Capture`]) and what the server answers ([`Account`], [`Charge`],
//! [`Refund`], [`Entry`], [`List`]). Unknown fields in answers are ignored,
//! so a newer server does not break an older client.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Metadata: string keys to string values (≤ 50 keys, values ≤ 500 chars).
pub type Metadata = BTreeMap<String, String>;

/// `POST /v1/accounts`: a new account.
///
/// ```
/// let card = idem_client::NewAccount::new("BRL").id("card").allow_negative(true);
/// assert_eq!(card.id.as_deref(), Some("card"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NewAccount {
    /// The account's id (`[A-Za-z0-9_-]{1,64}`), unique per consumer; the
    /// server generates `acct_…` without one. With an id, creating it again
    /// with the same fields answers the existing account (natural
    /// idempotency).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Three upper-case letters, e.g. `BRL`.
    pub currency: String,
    /// Whether the balance may go below zero (a funding account: a card
    /// network, a cash drawer).
    pub allow_negative: bool,
    /// Free-form string metadata.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: Metadata,
}

impl NewAccount {
    /// An account in `currency`, no id, not allowed below zero.
    ///
    /// ```
    /// assert_eq!(idem_client::NewAccount::new("BRL").currency, "BRL");
    /// ```
    pub fn new(currency: &str) -> NewAccount {
        NewAccount {
            currency: currency.to_string(),
            ..NewAccount::default()
        }
    }

    /// With this id.
    ///
    /// ```
    /// assert_eq!(idem_client::NewAccount::new("BRL").id("shop").id.unwrap(), "shop");
    /// ```
    pub fn id(mut self, id: &str) -> NewAccount {
        self.id = Some(id.to_string());
        self
    }

    /// Allowed below zero or not.
    ///
    /// ```
    /// assert!(idem_client::NewAccount::new("BRL").allow_negative(true).allow_negative);
    /// ```
    pub fn allow_negative(mut self, allow: bool) -> NewAccount {
        self.allow_negative = allow;
        self
    }
}

/// An account as the server answers it.
///
/// ```
/// let a: idem_client::Account = serde_json::from_str(r#"{"id":"shop","object":"account",
///     "currency":"BRL","balance":10,"held":0,"available":10,"allow_negative":false,
///     "metadata":{},"created_at":"2026-11-30T16:28:06.262Z"}"#).unwrap();
/// assert_eq!(a.balance, 10);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Account {
    /// Its id.
    pub id: String,
    /// Its currency.
    pub currency: String,
    /// Its balance in minor units: the sum of its entries.
    pub balance: i64,
    /// The amount held by charges awaiting capture that draw on it.
    #[serde(default)]
    pub held: i64,
    /// `balance - held`: what a new debit may use.
    #[serde(default)]
    pub available: i64,
    /// Whether it may go below zero.
    pub allow_negative: bool,
    /// Its metadata.
    #[serde(default)]
    pub metadata: Metadata,
    /// When it was created (RFC 3339, UTC).
    pub created_at: String,
}

/// `POST /v1/charges`: a new charge from `source` to `destination`.
///
/// ```
/// let c = idem_client::NewCharge::new(4990, "BRL", "card", "shop").reference("order-17");
/// assert_eq!(c.reference.as_deref(), Some("order-17"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NewCharge {
    /// Minor units, 1 ..= 10^15.
    pub amount: i64,
    /// The currency of both accounts.
    pub currency: String,
    /// The account debited.
    pub source: String,
    /// The account credited.
    pub destination: String,
    /// `false` authorises and holds the amount (`requires_capture`); the
    /// server's default (`None`) captures at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture: Option<bool>,
    /// A reference unique per consumer (an order number): a second charge
    /// with it and the same body answers the first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// Up to 500 characters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Free-form string metadata.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: Metadata,
}

impl NewCharge {
    /// A charge of `amount` in `currency` from `source` to `destination`,
    /// captured at once.
    ///
    /// ```
    /// assert_eq!(idem_client::NewCharge::new(100, "BRL", "a", "b").amount, 100);
    /// ```
    pub fn new(amount: i64, currency: &str, source: &str, destination: &str) -> NewCharge {
        NewCharge {
            amount,
            currency: currency.to_string(),
            source: source.to_string(),
            destination: destination.to_string(),
            ..NewCharge::default()
        }
    }

    /// With this reference.
    ///
    /// ```
    /// let c = idem_client::NewCharge::new(1, "BRL", "a", "b").reference("r-1");
    /// assert_eq!(c.reference.unwrap(), "r-1");
    /// ```
    pub fn reference(mut self, reference: &str) -> NewCharge {
        self.reference = Some(reference.to_string());
        self
    }

    /// Captured at once (`true`) or only authorised and held (`false`).
    ///
    /// ```
    /// let c = idem_client::NewCharge::new(1, "BRL", "a", "b").capture(false);
    /// assert_eq!(c.capture, Some(false));
    /// ```
    pub fn capture(mut self, capture: bool) -> NewCharge {
        self.capture = Some(capture);
        self
    }
}

/// Where a charge stands.
///
/// ```
/// let s: idem_client::ChargeStatus = serde_json::from_str(r#""requires_capture""#).unwrap();
/// assert_eq!(s, idem_client::ChargeStatus::RequiresCapture);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChargeStatus {
    /// Captured: its entries are written.
    Succeeded,
    /// Authorised and held, awaiting capture or cancel.
    RequiresCapture,
    /// Canceled (requested, or its authorization expired).
    Canceled,
    /// A status this client version does not know.
    #[serde(other)]
    Unknown,
}

/// A charge as the server answers it.
///
/// ```
/// let c: idem_client::Charge = serde_json::from_str(r#"{"id":"ch_1","object":"charge",
///     "amount":4990,"currency":"BRL","source":"card","destination":"shop",
///     "status":"succeeded","amount_captured":4990,"amount_capturable":0,
///     "amount_refunded":0,"amount_disputed":0,"authorization":"auth_1",
///     "reference":null,"description":null,"metadata":{},"expires_at":null,
///     "canceled_at":null,"cancellation_reason":null,
///     "created_at":"2026-11-30T16:28:09.327Z"}"#).unwrap();
/// assert_eq!(c.status, idem_client::ChargeStatus::Succeeded);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Charge {
    /// `ch_…`.
    pub id: String,
    /// The amount authorised, in minor units.
    pub amount: i64,
    /// Its currency.
    pub currency: String,
    /// The account debited.
    pub source: String,
    /// The account credited.
    pub destination: String,
    /// Where it stands.
    pub status: ChargeStatus,
    /// The amount captured (entries written).
    #[serde(default)]
    pub amount_captured: i64,
    /// The amount still capturable (held).
    #[serde(default)]
    pub amount_capturable: i64,
    /// The amount refunded.
    pub amount_refunded: i64,
    /// The amount taken back by chargebacks.
    #[serde(default)]
    pub amount_disputed: i64,
    /// The acquirer's authorization id.
    #[serde(default)]
    pub authorization: Option<String>,
    /// Its reference, if it has one.
    pub reference: Option<String>,
    /// Its description, if it has one.
    pub description: Option<String>,
    /// Its metadata.
    #[serde(default)]
    pub metadata: Metadata,
    /// When an uncaptured hold expires.
    #[serde(default)]
    pub expires_at: Option<String>,
    /// When it was canceled.
    #[serde(default)]
    pub canceled_at: Option<String>,
    /// `requested` or `expired`, once canceled.
    #[serde(default)]
    pub cancellation_reason: Option<String>,
    /// When it was created (RFC 3339, UTC).
    pub created_at: String,
}

/// `POST /v1/charges/{id}/refunds`.
///
/// ```
/// assert_eq!(idem_client::NewRefund::amount(500).amount, Some(500));
/// assert_eq!(idem_client::NewRefund::default().amount, None); // all that is left
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NewRefund {
    /// The amount; `None` refunds what is left.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub amount: Option<i64>,
}

impl NewRefund {
    /// A refund of `amount`.
    ///
    /// ```
    /// assert_eq!(idem_client::NewRefund::amount(1).amount, Some(1));
    /// ```
    pub fn amount(amount: i64) -> NewRefund {
        NewRefund {
            amount: Some(amount),
        }
    }
}

/// A refund as the server answers it.
///
/// ```
/// let r: idem_client::Refund = serde_json::from_str(r#"{"id":"re_1","object":"refund",
///     "charge":"ch_1","amount":5,"created_at":"2026-11-30T16:28:09.327Z"}"#).unwrap();
/// assert_eq!(r.amount, 5);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Refund {
    /// `re_…`.
    pub id: String,
    /// The charge refunded.
    pub charge: String,
    /// The amount.
    pub amount: i64,
    /// When it was created (RFC 3339, UTC).
    pub created_at: String,
}

/// `POST /v1/charges/{id}/capture`.
///
/// ```
/// assert_eq!(idem_client::Capture::amount(300).amount, Some(300));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Capture {
    /// The amount; `None` captures all that is capturable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub amount: Option<i64>,
}

impl Capture {
    /// A capture of `amount`.
    ///
    /// ```
    /// assert_eq!(idem_client::Capture::amount(1).amount, Some(1));
    /// ```
    pub fn amount(amount: i64) -> Capture {
        Capture {
            amount: Some(amount),
        }
    }
}

/// A ledger entry: a signed amount on one account (positive credits it).
///
/// ```
/// let e: idem_client::Entry = serde_json::from_str(r#"{"id":"ent_1","object":"entry",
///     "account":"shop","amount":4990,"charge":"ch_1","refund":null,
///     "created_at":"2026-11-30T16:28:09.327Z"}"#).unwrap();
/// assert_eq!(e.charge.as_deref(), Some("ch_1"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Entry {
    /// `ent_…`.
    pub id: String,
    /// The account.
    pub account: String,
    /// Signed minor units.
    pub amount: i64,
    /// The charge that wrote it.
    pub charge: Option<String>,
    /// The refund that wrote it, if any.
    #[serde(default)]
    pub refund: Option<String>,
    /// When it was written (RFC 3339, UTC).
    pub created_at: String,
}

/// One page of a list, newest first.
///
/// ```
/// let l: idem_client::List<idem_client::Refund> =
///     serde_json::from_str(r#"{"object":"list","data":[],"has_more":false}"#).unwrap();
/// assert!(l.data.is_empty() && !l.has_more);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct List<T> {
    /// The items.
    pub data: Vec<T>,
    /// Whether more follow (ask again with `starting_after` the last id).
    pub has_more: bool,
}

/// `limit` and `starting_after` of a list request.
///
/// ```
/// let p = idem_client::Page { limit: Some(100), starting_after: None };
/// assert_eq!(p.limit, Some(100));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Page {
    /// 1–100; the server's default is 10.
    pub limit: Option<u32>,
    /// The last id of the previous page.
    pub starting_after: Option<String>,
}
