//! Request types, parsed and validated once from JSON ("parse, then
//! validate"), and the JSON objects the API answers with.
//!
//! Decoding is strict: unknown fields, wrong types, floats where integers are
//! expected and out-of-range values are errors that name the field.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config::{
    ACCOUNT_ID_LEN_MAX, AMOUNT_MINOR_MAX, DESCRIPTION_LEN_MAX, METADATA_KEYS_MAX,
    METADATA_KEY_LEN_MAX, METADATA_VALUE_LEN_MAX, REFERENCE_LEN_MAX, WEBHOOK_URL_LEN_MAX,
};
use crate::events::EventType;
use crate::json::{self, StrictError};

/// Why a request body was rejected: 400 `invalid-request` naming `field`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        FieldError {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

type Fields = Map<String, Value>;

/// Parses a body as a JSON object (an empty body is `{}`). Strictly
/// ([`json::from_slice`]): an object that names a member twice, at any
/// depth, is an error naming the member's path, so no reader of the body can
/// see another value than the one idem acts on.
pub fn parse_object(body: &[u8]) -> Result<Value, FieldError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Object(Map::new()));
    }
    let value = json::from_slice(body).map_err(|e| match e {
        StrictError::Duplicate(path) => FieldError::new(
            path.to_string(),
            "duplicate member (each name may appear once per object)",
        ),
        StrictError::Malformed(e) => FieldError::new("", format!("malformed JSON: {e}")),
    })?;
    if !value.is_object() {
        return Err(FieldError::new("", "the body must be a JSON object"));
    }
    Ok(value)
}

fn fields<'a>(value: &'a Value, allowed: &[&str]) -> Result<&'a Fields, FieldError> {
    let map = value
        .as_object()
        .ok_or_else(|| FieldError::new("", "the body must be a JSON object"))?;
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(FieldError::new(unknown.clone(), "unknown field"));
    }
    Ok(map)
}

/// Present and not null.
fn field<'a>(map: &'a Fields, name: &str) -> Option<&'a Value> {
    map.get(name).filter(|v| !v.is_null())
}

fn amount(map: &Fields, name: &str) -> Result<Option<i64>, FieldError> {
    let Some(v) = field(map, name) else {
        return Ok(None);
    };
    let bad = || {
        FieldError::new(
            name,
            format!("must be an integer number of minor units from 1 to {AMOUNT_MINOR_MAX}"),
        )
    };
    let n = v.as_i64().ok_or_else(bad)?;
    if !(1..=AMOUNT_MINOR_MAX).contains(&n) {
        return Err(bad());
    }
    Ok(Some(n))
}

fn string<'a>(map: &'a Fields, name: &str, len_max: usize) -> Result<Option<&'a str>, FieldError> {
    let Some(v) = field(map, name) else {
        return Ok(None);
    };
    let s = v
        .as_str()
        .ok_or_else(|| FieldError::new(name, "must be a string"))?;
    if s.chars().count() > len_max {
        return Err(FieldError::new(
            name,
            format!("must be at most {len_max} characters"),
        ));
    }
    Ok(Some(s))
}

fn required<T>(v: Option<T>, name: &str) -> Result<T, FieldError> {
    v.ok_or_else(|| FieldError::new(name, "is required"))
}

/// An ISO 4217-shaped currency code: three upper-case ASCII letters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Currency(String);

impl Currency {
    pub fn parse(s: &str) -> Option<Currency> {
        (s.len() == 3 && s.bytes().all(|b| b.is_ascii_uppercase())).then(|| Currency(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn currency(map: &Fields) -> Result<Currency, FieldError> {
    let s = required(string(map, "currency", 3)?, "currency")?;
    Currency::parse(s)
        .ok_or_else(|| FieldError::new("currency", "must be three upper-case letters"))
}

/// An account id chosen by the client (`[A-Za-z0-9_-]{1,64}`) or generated.
pub fn valid_account_id(s: &str) -> bool {
    (1..=ACCOUNT_ID_LEN_MAX).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn account_ref(map: &Fields, name: &str) -> Result<String, FieldError> {
    let s = required(string(map, name, ACCOUNT_ID_LEN_MAX)?, name)?;
    if !valid_account_id(s) {
        return Err(FieldError::new(name, "must be an account id"));
    }
    Ok(s.to_string())
}

fn metadata(map: &Fields) -> Result<Value, FieldError> {
    let Some(v) = field(map, "metadata") else {
        return Ok(Value::Object(Map::new()));
    };
    let obj = v
        .as_object()
        .ok_or_else(|| FieldError::new("metadata", "must be an object"))?;
    if obj.len() > METADATA_KEYS_MAX {
        return Err(FieldError::new(
            "metadata",
            format!("must have at most {METADATA_KEYS_MAX} keys"),
        ));
    }
    for (k, v) in obj {
        if k.is_empty() || k.chars().count() > METADATA_KEY_LEN_MAX {
            return Err(FieldError::new(
                format!("metadata.{k}"),
                format!("keys must be 1 to {METADATA_KEY_LEN_MAX} characters"),
            ));
        }
        let s = v
            .as_str()
            .ok_or_else(|| FieldError::new(format!("metadata.{k}"), "must be a string"))?;
        if s.chars().count() > METADATA_VALUE_LEN_MAX {
            return Err(FieldError::new(
                format!("metadata.{k}"),
                format!("must be at most {METADATA_VALUE_LEN_MAX} characters"),
            ));
        }
    }
    Ok(v.clone())
}

/// `POST /v1/accounts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccountRequest {
    pub id: Option<String>,
    pub currency: Currency,
    pub allow_negative: bool,
    #[serde(deserialize_with = "json::deserialize")]
    pub metadata: Value,
}

impl AccountRequest {
    pub fn from_json(v: &Value) -> Result<AccountRequest, FieldError> {
        let map = fields(v, &["id", "currency", "allow_negative", "metadata"])?;
        let id = match string(map, "id", ACCOUNT_ID_LEN_MAX)? {
            Some(id) if !valid_account_id(id) => {
                return Err(FieldError::new("id", "must match [A-Za-z0-9_-]{1,64}"))
            }
            id => id.map(str::to_string),
        };
        let allow_negative = match field(map, "allow_negative") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| FieldError::new("allow_negative", "must be a boolean"))?,
        };
        Ok(AccountRequest {
            id,
            currency: currency(map)?,
            allow_negative,
            metadata: metadata(map)?,
        })
    }
}

/// `POST /v1/charges`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChargeRequest {
    pub amount: i64,
    pub currency: Currency,
    pub source: String,
    pub destination: String,
    pub reference: Option<String>,
    pub description: Option<String>,
    #[serde(deserialize_with = "json::deserialize")]
    pub metadata: Value,
    /// `false`: authorise and hold (`requires_capture`) instead of moving
    /// the money at once. Requests kept by a v1 key row lack it: `true`.
    #[serde(default = "yes")]
    pub capture: bool,
}

fn yes() -> bool {
    true
}

impl ChargeRequest {
    pub fn from_json(v: &Value) -> Result<ChargeRequest, FieldError> {
        let map = fields(
            v,
            &[
                "amount",
                "currency",
                "source",
                "destination",
                "reference",
                "description",
                "metadata",
                "capture",
            ],
        )?;
        let capture = match field(map, "capture") {
            None => true,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| FieldError::new("capture", "must be a boolean"))?,
        };
        let req = ChargeRequest {
            amount: required(amount(map, "amount")?, "amount")?,
            currency: currency(map)?,
            source: account_ref(map, "source")?,
            destination: account_ref(map, "destination")?,
            reference: string(map, "reference", REFERENCE_LEN_MAX)?.map(str::to_string),
            description: string(map, "description", DESCRIPTION_LEN_MAX)?.map(str::to_string),
            metadata: metadata(map)?,
            capture,
        };
        if req.reference.as_deref() == Some("") {
            return Err(FieldError::new("reference", "must not be empty"));
        }
        if req.source == req.destination {
            return Err(FieldError::new("destination", "must differ from source"));
        }
        Ok(req)
    }
}

/// `POST /v1/charges/{id}/refunds`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefundRequest {
    pub charge: String,
    pub amount: Option<i64>,
}

impl RefundRequest {
    pub fn from_json(charge: &str, v: &Value) -> Result<RefundRequest, FieldError> {
        let map = fields(v, &["amount"])?;
        Ok(RefundRequest {
            charge: charge.to_string(),
            amount: amount(map, "amount")?,
        })
    }
}

/// `POST /v1/charges/{id}/capture`: capture `amount` (default: all) of a
/// `requires_capture` charge and release the rest of its hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaptureRequest {
    pub charge: String,
    pub amount: Option<i64>,
}

impl CaptureRequest {
    /// Validates a capture body (`{"amount"?: int}`; empty is `{}`) for the
    /// charge named in the path.
    pub fn from_json(charge: &str, v: &Value) -> Result<CaptureRequest, FieldError> {
        let map = fields(v, &["amount"])?;
        Ok(CaptureRequest {
            charge: charge.to_string(),
            amount: amount(map, "amount")?,
        })
    }
}

/// `POST /v1/charges/{id}/cancel`: void the authorization and release the
/// hold. The body is empty or `{}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelRequest {
    pub charge: String,
}

impl CancelRequest {
    /// Validates a cancel body (empty, or `{}`: any member is unknown) for
    /// the charge named in the path.
    pub fn from_json(charge: &str, v: &Value) -> Result<CancelRequest, FieldError> {
        fields(v, &[])?;
        Ok(CancelRequest {
            charge: charge.to_string(),
        })
    }
}

/// `POST /v1/webhook_endpoints`: where to deliver and which events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WebhookEndpointRequest {
    /// An absolute `http://` or `https://` URL ([`check_webhook_url`]).
    pub url: String,
    /// `["*"]`, or distinct known event types, in the order given.
    pub enabled_events: Vec<String>,
    pub description: Option<String>,
}

impl WebhookEndpointRequest {
    pub fn from_json(v: &Value) -> Result<WebhookEndpointRequest, FieldError> {
        let map = fields(v, &["url", "enabled_events", "description"])?;
        let url = required(string(map, "url", WEBHOOK_URL_LEN_MAX)?, "url")?;
        check_webhook_url(url).map_err(|why| FieldError::new("url", why))?;
        let events = required(field(map, "enabled_events"), "enabled_events")?;
        let bad = || {
            FieldError::new(
                "enabled_events",
                "must be [\"*\"] or a non-empty array of distinct event types",
            )
        };
        let list = events.as_array().ok_or_else(bad)?;
        if list.is_empty() || list.len() > EventType::ALL.len() {
            return Err(bad());
        }
        let mut enabled_events: Vec<String> = Vec::with_capacity(list.len());
        for item in list {
            let name = item.as_str().ok_or_else(bad)?;
            if name != "*" && EventType::parse(name).is_none() {
                return Err(FieldError::new(
                    "enabled_events",
                    format!("'{}' is not an event type", name.escape_debug()),
                ));
            }
            if enabled_events.iter().any(|e| e == name) {
                return Err(FieldError::new(
                    "enabled_events",
                    format!("'{}' is listed twice", name.escape_debug()),
                ));
            }
            enabled_events.push(name.to_string());
        }
        if enabled_events.len() > 1 && enabled_events.iter().any(|e| e == "*") {
            return Err(FieldError::new(
                "enabled_events",
                "\"*\" stands alone: it already names every type",
            ));
        }
        let description = string(map, "description", DESCRIPTION_LEN_MAX)?.map(str::to_string);
        Ok(WebhookEndpointRequest {
            url: url.to_string(),
            enabled_events,
            description,
        })
    }
}

/// Checks a webhook URL strictly: `http://` or `https://` (lower case),
/// printable ASCII only (an internationalised host goes in its punycode
/// form), a host of letters, digits, `.` and `-` or a bracketed IPv6
/// address, an optional port from 1 to 65535, then an optional path and
/// query; no user information (a password in a URL ends up in logs) and no
/// fragment (never sent). The `http` crate's URI parser must agree.
pub fn check_webhook_url(url: &str) -> Result<(), &'static str> {
    if url.len() > WEBHOOK_URL_LEN_MAX {
        return Err("is too long");
    }
    if !url.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err("must be printable ASCII without spaces");
    }
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or("must start with http:// or https://")?;
    if url.contains('#') {
        return Err("must not have a fragment");
    }
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.contains('@') {
        return Err("must not carry user information");
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (addr, after) = v6.split_once(']').ok_or("has a bad IPv6 host")?;
        addr.parse::<std::net::Ipv6Addr>()
            .map_err(|_| "has a bad IPv6 host")?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or("has a bad port")?),
        };
        (addr, port)
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("must name a host");
    }
    if !authority.starts_with('[') {
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        };
        if host.len() > 253 || !host.trim_end_matches('.').split('.').all(label_ok) {
            return Err("has a bad host name");
        }
    }
    if let Some(port) = port {
        let ok = !port.is_empty()
            && port.len() <= 5
            && port.bytes().all(|b| b.is_ascii_digit())
            && port.parse::<u32>().is_ok_and(|p| (1..=65535).contains(&p));
        if !ok {
            return Err("has a bad port (1 to 65535)");
        }
    }
    if !(path.is_empty() || path.starts_with('/') || path.starts_with('?')) {
        return Err("has a bad path");
    }
    if url.parse::<ureq::http::Uri>().is_err() {
        return Err("is not a valid URI");
    }
    Ok(())
}

/// The validated request kept in a key row, so that the reaper (or whoever
/// takes the key over) can finish the work without the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Operation {
    Account(AccountRequest),
    Charge(ChargeRequest),
    Refund(RefundRequest),
    Capture(CaptureRequest),
    Cancel(CancelRequest),
    /// `POST /v1/webhook_endpoints` with an `Idempotency-Key`.
    WebhookEndpoint(WebhookEndpointRequest),
    /// `POST /v1/notification_sources` with an `Idempotency-Key`.
    NotificationSource(crate::inbound::SourceRequest),
}

// ---------------------------------------------------------------------------
// Response objects (field order is the contract's)

#[derive(Debug, Clone, Serialize)]
pub struct AccountObject {
    pub id: String,
    pub object: &'static str,
    pub currency: String,
    pub balance: i64,
    /// The sum of the holds on this account (`requires_capture` charges).
    pub held: i64,
    /// `balance - held`: what a new charge or hold may draw on.
    pub available: i64,
    pub allow_negative: bool,
    pub metadata: Value,
    pub created_at: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChargeObject {
    pub id: String,
    pub object: &'static str,
    pub amount: i64,
    pub currency: String,
    pub source: String,
    pub destination: String,
    /// `succeeded`, `requires_capture` or `canceled`.
    pub status: &'static str,
    pub amount_captured: i64,
    /// What a capture may still take: `amount` while `requires_capture`,
    /// else 0.
    pub amount_capturable: i64,
    pub amount_refunded: i64,
    pub amount_disputed: i64,
    /// The acquirer's authorization id.
    pub authorization: String,
    pub reference: Option<String>,
    pub description: Option<String>,
    pub metadata: Value,
    /// When an uncaptured hold expires (`requires_capture` only).
    pub expires_at: Option<String>,
    pub canceled_at: Option<String>,
    /// `requested` or `expired` (`canceled` only).
    pub cancellation_reason: Option<&'static str>,
    pub created_at: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct RefundObject {
    pub id: String,
    pub object: &'static str,
    pub charge: String,
    pub amount: i64,
    pub created_at: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct EntryObject {
    pub id: String,
    pub object: &'static str,
    pub account: String,
    pub amount: i64,
    pub charge: String,
    pub refund: Option<String>,
    /// The dispute (`dp_…`) whose chargeback wrote this entry.
    pub dispute: Option<String>,
    pub created_at: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ListObject<T> {
    pub object: &'static str,
    pub data: Vec<T>,
    pub has_more: bool,
}

/// A page request of a list endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub limit: usize,
    pub starting_after: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn charge(v: Value) -> Result<ChargeRequest, String> {
        ChargeRequest::from_json(&v).map_err(|e| e.field)
    }

    #[test]
    fn charge_decoding_names_the_bad_field() {
        let ok = json!({"amount": 100, "currency": "BRL", "source": "a", "destination": "b"});
        assert!(charge(ok.clone()).is_ok());
        let with = |k: &str, v: Value| {
            let mut o = ok.clone();
            o[k] = v;
            charge(o)
        };
        assert_eq!(with("amount", json!(1.5)), Err("amount".into()));
        assert_eq!(with("amount", json!(100.0)), Err("amount".into()));
        assert_eq!(with("amount", json!(0)), Err("amount".into()));
        assert_eq!(with("amount", json!(-5)), Err("amount".into()));
        assert_eq!(
            with("amount", json!(AMOUNT_MINOR_MAX + 1)),
            Err("amount".into())
        );
        assert!(with("amount", json!(AMOUNT_MINOR_MAX)).is_ok());
        assert_eq!(with("amount", json!("100")), Err("amount".into()));
        assert_eq!(with("currency", json!("brl")), Err("currency".into()));
        assert_eq!(with("currency", json!("BRLX")), Err("currency".into()));
        assert_eq!(with("source", json!("b")), Err("destination".into()));
        assert_eq!(with("source", json!("a b")), Err("source".into()));
        assert_eq!(with("reference", json!("")), Err("reference".into()));
        assert_eq!(
            with("reference", json!("r".repeat(129))),
            Err("reference".into())
        );
        assert_eq!(with("description", json!(5)), Err("description".into()));
        assert_eq!(with("metadata", json!([])), Err("metadata".into()));
        assert_eq!(with("metadata", json!({"k": 1})), Err("metadata.k".into()));
        assert_eq!(with("colour", json!("red")), Err("colour".into()));
    }

    #[test]
    fn empty_body_is_an_empty_object() {
        assert_eq!(parse_object(b"").unwrap(), json!({}));
        assert_eq!(parse_object(b"  \n").unwrap(), json!({}));
        assert!(parse_object(b"[1]").is_err());
        assert!(parse_object(b"{").is_err());
        let dup = parse_object(br#"{"m":{"a":1,"\u0061":2}}"#).unwrap_err();
        assert_eq!(dup.field, "m.a");
    }
}

#[cfg(test)]
mod roundtrip_tests {
    use super::*;
    use serde_json::json;

    /// The request kept in a key row reads back as it was written, whatever
    /// its metadata keys are named: serde_json's `Value` would read a
    /// metadata object whose key is its raw-value token as the JSON text in
    /// that key's string (here an array, which validation never allowed).
    #[test]
    fn an_operation_reads_back_as_written() {
        let metadata = json!({"$serde_json::private::RawValue": "[1,{\"x\":2}]"});
        let ops = [
            Operation::Charge(ChargeRequest {
                amount: 5,
                currency: Currency::parse("BRL").unwrap(),
                source: "card".into(),
                destination: "shop".into(),
                reference: None,
                description: None,
                metadata: metadata.clone(),
                capture: false,
            }),
            Operation::Account(AccountRequest {
                id: Some("a".into()),
                currency: Currency::parse("BRL").unwrap(),
                allow_negative: false,
                metadata,
            }),
        ];
        for op in ops {
            let stored = serde_json::to_string(&op).unwrap();
            let back: Operation = serde_json::from_str(&stored).unwrap();
            assert_eq!(back, op, "{stored}");
        }
    }
}
