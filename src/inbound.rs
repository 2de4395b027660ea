//! Inbound notifications: the acquirer's webhooks, keyed by the sender.
//!
//! A **source** (`src_…`) is a sender with its own secret; a notification
//! to `POST /v1/notifications/{source}` carries no bearer key and is
//! authenticated only by its Standard Webhooks signature
//! ([`crate::signature::verify`]). The sender's `webhook-id` is the
//! idempotency key, scoped to the source, with the same canonical
//! fingerprint as every other request: the same id and body is a replay of
//! the stored answer, another body is 422.
//!
//! [`receive`] is ONE writer command: it looks the id up again under the
//! write lock, compares fingerprints, stores the notification with its
//! answer and applies its effect, so that any number of concurrent
//! deliveries of one id are decided by the database and produce one effect.
//!
//! A `chargeback.created` names a charge by its acquirer authorization.
//! When that charge is captured, the dispute is applied at once
//! ([`apply_dispute`]: the destination debited — forced, it may go below
//! zero — the source credited, `amount_disputed` raised, a `disputes` row,
//! two entries naming it and the event `charge.dispute.created`). When no
//! captured money is recorded for the authorization yet (the notification
//! overtook the answer it describes, or the charge is a hold), it is stored
//! `unmatched`, and the ledger transaction that records the captured money
//! applies it ([`settle_unmatched`], called by `ledger::apply_charge` and
//! `ledger::apply_capture`); a hold released without a capture marks it
//! `ignored` ([`release_unmatched`]). Any other type is stored `ignored`,
//! so the sender stops retrying.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::api::Problem;
use crate::config::{AMOUNT_MINOR_MAX, IDEMPOTENCY_KEY_LEN_MAX};
use crate::error::{Error, Result};
use crate::events::{self, EventType};
use crate::idempotency::{Fingerprint, StoredResponse};
use crate::ids;
use crate::ledger::UnknownCursor;
use crate::model::{FieldError, ListObject, Page};
use crate::signature;
use crate::store::{params, Db, Row};
use crate::time::rfc3339;

/// Longest source name, in characters.
pub const SOURCE_NAME_LEN_MAX: usize = 64;
/// Longest notification `type`, in characters.
pub const NOTIFICATION_TYPE_LEN_MAX: usize = 128;
/// Longest chargeback `authorization`, in characters.
pub const AUTHORIZATION_LEN_MAX: usize = 255;
/// Longest chargeback `reason`, in characters.
pub const REASON_LEN_MAX: usize = 500;

/// The one notification type idem acts on.
pub const CHARGEBACK_CREATED: &str = "chargeback.created";

// ---------------------------------------------------------------------------
// Sources

/// `POST /v1/notification_sources`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceRequest {
    pub name: String,
}

impl SourceRequest {
    /// Validates `{"name": string}`: 1 to [`SOURCE_NAME_LEN_MAX`]
    /// characters, no control characters; any other member is unknown.
    pub fn from_json(v: &Value) -> std::result::Result<SourceRequest, FieldError> {
        let map = members(v, "", &["name"])?;
        let name = text(map, "", "name", SOURCE_NAME_LEN_MAX)?
            .ok_or_else(|| FieldError::new("name", "is required"))?;
        Ok(SourceRequest {
            name: name.to_string(),
        })
    }
}

/// A notification source as the API shows it. `secret` is there only in
/// the answer that created it (and that answer's replays).
#[derive(Debug, Clone, Serialize)]
pub struct SourceObject {
    pub id: String,
    pub object: &'static str,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    pub created_at: String,
}

/// Creates a source with a new random secret; the object carries the
/// secret (`whsec_…`), shown this once.
pub fn create_source(
    tx: &dyn Db,
    consumer_id: i64,
    req: &SourceRequest,
    now_ms: i64,
) -> Result<SourceObject> {
    let (key, secret) = signature::new_secret()?;
    let public_id = ids::new_id(ids::NOTIFICATION_SOURCE);
    tx.execute(
        "INSERT INTO notification_sources (consumer_id, public_id, name, secret, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![consumer_id, public_id, req.name, key.as_slice(), now_ms],
    )?;
    Ok(SourceObject {
        id: public_id,
        object: "notification_source",
        name: req.name.clone(),
        secret: Some(secret),
        created_at: rfc3339(now_ms),
    })
}

fn row_to_source(r: &dyn Row) -> Result<SourceObject> {
    Ok(SourceObject {
        id: r.get(0)?,
        object: "notification_source",
        name: r.get(1)?,
        secret: None,
        created_at: rfc3339(r.get(2)?),
    })
}

/// The consumer's source `public_id`, without its secret.
pub fn get_source(
    db: &dyn Db,
    consumer_id: i64,
    public_id: &str,
) -> Result<Option<SourceObject>> {
    db.query_opt(
        "SELECT public_id, name, created_at FROM notification_sources \
         WHERE consumer_id = ?1 AND public_id = ?2",
        params![consumer_id, public_id],
        row_to_source,
    )
}

/// A page of the consumer's sources, newest first, without secrets.
pub fn list_sources(
    db: &dyn Db,
    consumer_id: i64,
    p: &Page,
) -> Result<std::result::Result<ListObject<SourceObject>, UnknownCursor>> {
    crate::ledger::page(
        db,
        consumer_id,
        p,
        "SELECT id FROM notification_sources WHERE consumer_id = ?1 AND public_id = ?2",
        "SELECT public_id, name, created_at FROM notification_sources \
         WHERE consumer_id = ?1 AND id < ?2 ORDER BY id DESC LIMIT ?3",
        row_to_source,
    )
}

/// What verifying a notification needs of its source.
#[derive(Debug, Clone)]
pub struct SourceKey {
    pub id: i64,
    pub consumer_id: i64,
    pub public_id: String,
    pub key: Vec<u8>,
}

/// The source `public_id` of any consumer (the notification route has no
/// bearer key: the source's secret is the authentication).
pub fn source_key(db: &dyn Db, public_id: &str) -> Result<Option<SourceKey>> {
    db.query_opt(
        "SELECT id, consumer_id, public_id, secret FROM notification_sources \
         WHERE public_id = ?1",
        params![public_id],
        |r| {
            Ok(SourceKey {
                id: r.get(0)?,
                consumer_id: r.get(1)?,
                public_id: r.get(2)?,
                key: r.get(3)?,
            })
        },
    )
}

// ---------------------------------------------------------------------------
// Notifications: validation

/// A `webhook-id` is valid as an idempotency key: 1 to 255 printable ASCII
/// characters (0x21–0x7E), taken as sent (the signature covers it as sent,
/// so no structured-field unquoting).
pub fn valid_webhook_id(id: &[u8]) -> bool {
    (1..=IDEMPOTENCY_KEY_LEN_MAX).contains(&id.len())
        && id.iter().all(|b| (0x21..=0x7e).contains(b))
}

/// The data of a `chargeback.created`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chargeback {
    pub authorization: String,
    pub amount: i64,
    pub reason: Option<String>,
}

/// A validated notification body `{"type", "data"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotificationRequest {
    pub kind: String,
    /// For `chargeback.created`; `None` for a type idem does not act on.
    pub chargeback: Option<Chargeback>,
}

impl NotificationRequest {
    /// Validates a body: `type` a string of 1 to 128 characters, `data` an
    /// object, nothing else. A `chargeback.created`'s data is checked
    /// strictly too (`authorization` 1..=255 characters, `amount` an integer
    /// 1..=10^15, `reason` optional, at most 500 characters, no other
    /// member); another type's data is kept as sent and not read.
    pub fn from_json(v: &Value) -> std::result::Result<NotificationRequest, FieldError> {
        let map = members(v, "", &["type", "data"])?;
        let kind = text(map, "", "type", NOTIFICATION_TYPE_LEN_MAX)?
            .ok_or_else(|| FieldError::new("type", "is required"))?
            .to_string();
        let data = map
            .get("data")
            .ok_or_else(|| FieldError::new("data", "is required"))?;
        if !data.is_object() {
            return Err(FieldError::new("data", "must be an object"));
        }
        let chargeback = if kind == CHARGEBACK_CREATED {
            let d = members(data, "data.", &["authorization", "amount", "reason"])?;
            let authorization = text(d, "data.", "authorization", AUTHORIZATION_LEN_MAX)?
                .ok_or_else(|| FieldError::new("data.authorization", "is required"))?
                .to_string();
            let amount = match d.get("amount") {
                Some(n) => n
                    .as_i64()
                    .filter(|n| (1..=AMOUNT_MINOR_MAX).contains(n))
                    .ok_or_else(|| {
                        FieldError::new(
                            "data.amount",
                            format!(
                                "must be an integer number of minor units from 1 to \
                                 {AMOUNT_MINOR_MAX}"
                            ),
                        )
                    })?,
                None => return Err(FieldError::new("data.amount", "is required")),
            };
            let reason = match d.get("reason") {
                None | Some(Value::Null) => None,
                Some(_) => text(d, "data.", "reason", REASON_LEN_MAX)?.map(str::to_string),
            };
            Some(Chargeback {
                authorization,
                amount,
                reason,
            })
        } else {
            None
        };
        Ok(NotificationRequest { kind, chargeback })
    }
}

fn members<'a>(
    v: &'a Value,
    prefix: &str,
    allowed: &[&str],
) -> std::result::Result<&'a Map<String, Value>, FieldError> {
    let map = v
        .as_object()
        .ok_or_else(|| FieldError::new(prefix.trim_end_matches('.'), "must be a JSON object"))?;
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(FieldError::new(
            format!("{prefix}{unknown}"),
            "unknown field",
        ));
    }
    Ok(map)
}

/// A member that, if present, is a string of 1 to `len_max` characters
/// without control characters.
fn text<'a>(
    map: &'a Map<String, Value>,
    prefix: &str,
    name: &str,
    len_max: usize,
) -> std::result::Result<Option<&'a str>, FieldError> {
    let Some(v) = map.get(name) else {
        return Ok(None);
    };
    let field = || format!("{prefix}{name}");
    let s = v
        .as_str()
        .ok_or_else(|| FieldError::new(field(), "must be a string"))?;
    let n = s.chars().count();
    if n == 0 || n > len_max || s.chars().any(char::is_control) {
        return Err(FieldError::new(
            field(),
            format!("must be 1 to {len_max} characters, none of them a control character"),
        ));
    }
    Ok(Some(s))
}

// ---------------------------------------------------------------------------
// Notifications: the decision

/// A notification's status, as stored and shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Its effect is in the ledger (a chargeback: its dispute).
    Applied,
    /// Stored and not acted on: an unknown type, a chargeback that exceeds
    /// its charge, one whose hold was released; `detail` says why.
    Ignored,
    /// A chargeback whose authorization has no captured money yet.
    Unmatched,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Applied => "applied",
            Status::Ignored => "ignored",
            Status::Unmatched => "unmatched",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        [Status::Applied, Status::Ignored, Status::Unmatched]
            .into_iter()
            .find(|st| st.as_str() == s)
    }

    /// Its index in `Metrics::notifications`.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A notification as the API shows it: the answer to its first delivery,
/// and the items of `GET /v1/notifications` (with its current status).
#[derive(Debug, Clone, Serialize)]
pub struct NotificationObject {
    pub id: String,
    pub object: &'static str,
    pub source: String,
    pub webhook_id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub status: &'static str,
    /// Why it is `ignored` or `unmatched`; null once applied.
    pub detail: Option<String>,
    /// The dispute it produced, once applied (chargebacks).
    pub dispute: Option<String>,
    pub received_at: String,
}

/// A dispute, the `data.object` of `charge.dispute.created` (Stripe's
/// choice: the dispute, not the charge, is the object of its event).
#[derive(Debug, Clone, Serialize)]
pub struct DisputeObject {
    pub id: String,
    pub object: &'static str,
    pub charge: String,
    pub amount: i64,
    pub reason: Option<String>,
    pub notification: String,
    pub created_at: String,
}

/// One delivery, authenticated and validated, ready for the writer.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub source: SourceKey,
    pub webhook_id: String,
    pub fingerprint: Fingerprint,
    /// The body as received (what the signature covered).
    pub body: Vec<u8>,
    pub request: NotificationRequest,
}

/// What a delivery got.
#[derive(Debug, Clone)]
pub enum Received {
    /// First delivery of this id: stored with this status and answer.
    New(Status, StoredResponse),
    /// This id with this body was stored before: its answer.
    Replay(StoredResponse),
    /// This id was stored with another body: 422, nothing happens.
    Reused,
}

/// The decision for a delivery of an id already stored (`None`: not
/// stored yet). Runs on a reader first and again in the writer command.
pub fn settle(
    db: &dyn Db,
    source_id: i64,
    webhook_id: &str,
    fp: &Fingerprint,
) -> Result<Option<Received>> {
    let seen = db.query_opt(
        "SELECT fingerprint, response_status, response_body FROM notifications \
         WHERE source_id = ?1 AND webhook_id = ?2",
        params![source_id, webhook_id],
        |r| {
            let status = r.get::<i64>(1)?;
            let status = u16::try_from(status).map_err(|_| {
                Error::Storage(format!("column 1 holds {status}, not an HTTP status"))
            })?;
            Ok((r.get::<Vec<u8>>(0)?, status, r.get::<Vec<u8>>(2)?))
        },
    )?;
    Ok(seen.map(|(stored_fp, status, body)| {
        if stored_fp.as_slice() == fp.as_slice() {
            Received::Replay(StoredResponse { status, body })
        } else {
            Received::Reused
        }
    }))
}

/// The writer command of a delivery: decide again under the write lock,
/// then store the notification, its answer and its effect together.
/// `before_commit` runs last, inside the transaction (the crash tests abort
/// there).
pub fn receive(
    tx: &dyn Db,
    d: &Delivery,
    now_ms: i64,
    before_commit: impl FnOnce(),
) -> Result<Received> {
    if let Some(decided) = settle(tx, d.source.id, &d.webhook_id, &d.fingerprint)? {
        return Ok(decided);
    }
    let consumer_id = d.source.consumer_id;
    let public_id = ids::new_id(ids::NOTIFICATION);
    // What the chargeback finds, decided before anything is written.
    let (status, detail, problem, charge) = match &d.request.chargeback {
        None => (
            Status::Ignored,
            Some(format!(
                "type '{}' is not one idem acts on; stored and not applied",
                d.request.kind
            )),
            None,
            None,
        ),
        Some(cb) => match find_charge(tx, consumer_id, &cb.authorization)? {
            None => (
                Status::Unmatched,
                Some(UNMATCHED_NO_CHARGE.to_string()),
                None,
                None,
            ),
            Some(c) if c.status == "requires_capture" => (
                Status::Unmatched,
                Some(UNMATCHED_HOLD.to_string()),
                None,
                None,
            ),
            Some(c) if c.status != "succeeded" => (
                Status::Ignored,
                Some(format!(
                    "charge {} was {} without a capture",
                    c.public_id, c.status
                )),
                None,
                None,
            ),
            Some(c) => match check_dispute(tx, &c, cb.amount)? {
                Ok(()) => (Status::Applied, None, None, Some(c)),
                Err(refusal) => (
                    Status::Ignored,
                    Some(refusal.detail(&c)),
                    Some(refusal.problem()),
                    None,
                ),
            },
        },
    };
    let dispute_id = charge.as_ref().map(|_| ids::new_id(ids::DISPUTE));
    let stored = match &problem {
        Some(p) => StoredResponse {
            status: p.status(),
            body: p.body(),
        },
        None => StoredResponse {
            status: 200,
            body: serde_json::to_vec(&NotificationObject {
                id: public_id.clone(),
                object: "notification",
                source: d.source.public_id.clone(),
                webhook_id: d.webhook_id.clone(),
                kind: d.request.kind.clone(),
                status: status.as_str(),
                detail: detail.clone(),
                dispute: dispute_id.clone(),
                received_at: rfc3339(now_ms),
            })
            .expect("a notification serializes"),
        },
    };
    // "authorization" is quoted wherever it is named: a reserved word on
    // PostgreSQL, a plain name on SQLite.
    let notification_id = tx.query_value::<i64>(
        "INSERT INTO notifications (consumer_id, source_id, public_id, webhook_id, fingerprint, \
         type, status, \"authorization\", body, detail, response_status, response_body, \
         received_at, applied_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14) RETURNING id",
        params![
            consumer_id,
            d.source.id,
            public_id,
            d.webhook_id,
            d.fingerprint.as_slice(),
            d.request.kind,
            status.as_str(),
            d.request
                .chargeback
                .as_ref()
                .map(|cb| cb.authorization.as_str()),
            d.body,
            detail,
            stored.status,
            stored.body,
            now_ms,
            (status == Status::Applied).then_some(now_ms),
        ],
    )?;
    if let (Some(c), Some(cb), Some(dp)) = (&charge, &d.request.chargeback, dispute_id) {
        apply_dispute(
            tx,
            consumer_id,
            c,
            notification_id,
            &public_id,
            dp,
            cb,
            now_ms,
        )?;
    }
    before_commit();
    Ok(Received::New(status, stored))
}

const UNMATCHED_NO_CHARGE: &str =
    "no charge with this authorization yet; applied when its authorization is recorded";
const UNMATCHED_HOLD: &str = "the authorization is held, not captured; applied when it is captured";

// ---------------------------------------------------------------------------
// Disputes

/// What a chargeback needs of its charge.
#[derive(Debug, Clone)]
struct ChargeRef {
    id: i64,
    public_id: String,
    status: String,
    /// `amount_captured - amount_refunded - amount_disputed`.
    left: i64,
    source_id: i64,
    destination_id: i64,
}

fn find_charge(tx: &dyn Db, consumer_id: i64, authorization: &str) -> Result<Option<ChargeRef>> {
    tx.query_opt(
        "SELECT id, public_id, status, amount_captured - amount_refunded - amount_disputed, \
         source_id, destination_id FROM charges \
         WHERE consumer_id = ?1 AND authorization_id = ?2 ORDER BY id LIMIT 1",
        params![consumer_id, authorization],
        |r| {
            Ok(ChargeRef {
                id: r.get(0)?,
                public_id: r.get(1)?,
                status: r.get(2)?,
                left: r.get(3)?,
                source_id: r.get(4)?,
                destination_id: r.get(5)?,
            })
        },
    )
}

/// Why a chargeback is not applied to a captured charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// More than the charge has left.
    Exceeds,
    /// A balance would leave the range of i64 (forced or not, a dispute
    /// cannot write a number SQLite would store as a float).
    Overflow,
}

impl Refusal {
    fn problem(self) -> Problem {
        match self {
            Refusal::Exceeds => Problem::DisputeExceedsCharge,
            Refusal::Overflow => Problem::BalanceOverflow,
        }
    }

    fn detail(self, c: &ChargeRef) -> String {
        match self {
            Refusal::Exceeds => format!(
                "dispute-exceeds-charge: charge {} has {} left to dispute",
                c.public_id, c.left
            ),
            Refusal::Overflow => format!(
                "balance-overflow: a balance of charge {}'s accounts would leave the 64-bit range",
                c.public_id
            ),
        }
    }
}

/// Whether `amount` may be disputed on `c`: at most what is left of it;
/// the destination's balance minus the amount, and the source's balance
/// plus what its holds may still credit plus the amount, stay i64. The
/// destination may go below zero (the network forces the chargeback).
fn check_dispute(
    tx: &dyn Db,
    c: &ChargeRef,
    amount: i64,
) -> Result<std::result::Result<(), Refusal>> {
    if amount > c.left {
        return Ok(Err(Refusal::Exceeds));
    }
    let balances = |id: i64| -> Result<(i64, i64)> {
        tx.query_one(
            "SELECT balance, pending_credit FROM accounts WHERE id = ?1",
            params![id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
    };
    let (destination, _) = balances(c.destination_id)?;
    let (source, source_pending) = balances(c.source_id)?;
    let fits = destination.checked_sub(amount).is_some()
        && source
            .checked_add(source_pending)
            .and_then(|b| b.checked_add(amount))
            .is_some();
    Ok(if fits { Ok(()) } else { Err(Refusal::Overflow) })
}

/// Applies a checked chargeback: the dispute row, `amount_disputed`, the
/// destination's debit and the source's credit (both naming the dispute),
/// and the event `charge.dispute.created`.
#[allow(clippy::too_many_arguments)]
fn apply_dispute(
    tx: &dyn Db,
    consumer_id: i64,
    c: &ChargeRef,
    notification_id: i64,
    notification_public_id: &str,
    dispute_public_id: String,
    cb: &Chargeback,
    now_ms: i64,
) -> Result<()> {
    let dispute_id = tx.query_value::<i64>(
        "INSERT INTO disputes (consumer_id, public_id, charge_id, notification_id, amount, \
         reason, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) RETURNING id",
        params![
            consumer_id,
            dispute_public_id,
            c.id,
            notification_id,
            cb.amount,
            cb.reason,
            now_ms
        ],
    )?;
    tx.execute(
        "UPDATE charges SET amount_disputed = amount_disputed + ?2 WHERE id = ?1",
        params![c.id, cb.amount],
    )?;
    for (account_id, amount) in [(c.destination_id, -cb.amount), (c.source_id, cb.amount)] {
        tx.execute(
            "INSERT INTO entries (public_id, account_id, amount, charge_id, dispute_id, \
             created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                ids::new_id(ids::ENTRY),
                account_id,
                amount,
                c.id,
                dispute_id,
                now_ms
            ],
        )?;
        let n = tx.execute(
            "UPDATE accounts SET balance = balance + ?2 WHERE id = ?1",
            params![account_id, amount],
        )?;
        assert_eq!(n, 1, "dispute entry for a missing account {account_id}");
    }
    let object = DisputeObject {
        id: dispute_public_id,
        object: "dispute",
        charge: c.public_id.clone(),
        amount: cb.amount,
        reason: cb.reason.clone(),
        notification: notification_public_id.to_string(),
        created_at: rfc3339(now_ms),
    };
    events::record(
        tx,
        consumer_id,
        EventType::ChargeDisputeCreated,
        &object.id,
        &object,
        now_ms,
    )?;
    Ok(())
}

/// Applies, in the caller's transaction, every `unmatched` chargeback of
/// `authorization`, oldest first, now that its charge's captured money is
/// recorded (`ledger::apply_charge` captured at once, `ledger::apply_capture`).
/// One that exceeds what is left (or would overflow a balance) is marked
/// `ignored` with the reason. Without unmatched notifications this is one
/// lookup in the partial index `notifications_unmatched`, which holds
/// only unmatched rows.
pub fn settle_unmatched(
    tx: &dyn Db,
    consumer_id: i64,
    authorization: &str,
    now_ms: i64,
) -> Result<()> {
    let pending: Vec<(i64, String, Vec<u8>)> = tx.query_all(
        "SELECT id, public_id, body FROM notifications \
         WHERE consumer_id = ?1 AND \"authorization\" = ?2 AND status = 'unmatched' ORDER BY id",
        params![consumer_id, authorization],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    for (id, public_id, body) in pending {
        let chargeback = crate::json::from_slice(&body)
            .ok()
            .and_then(|v| NotificationRequest::from_json(&v).ok())
            .and_then(|r| r.chargeback);
        let charge = find_charge(tx, consumer_id, authorization)?;
        let outcome = match (&chargeback, &charge) {
            (Some(cb), Some(c)) if c.status == "succeeded" => {
                check_dispute(tx, c, cb.amount)?.map_err(|refusal| refusal.detail(c))
            }
            _ => Err("the stored notification is not a chargeback of a captured charge".into()),
        };
        match (outcome, chargeback, charge) {
            (Ok(()), Some(cb), Some(c)) => {
                tx.execute(
                    "UPDATE notifications SET status = 'applied', detail = NULL, applied_at = ?2 \
                     WHERE id = ?1",
                    params![id, now_ms],
                )?;
                let dispute = ids::new_id(ids::DISPUTE);
                apply_dispute(tx, consumer_id, &c, id, &public_id, dispute, &cb, now_ms)?;
            }
            (outcome, _, _) => {
                let detail = outcome.err().unwrap_or_default();
                tx.execute(
                    "UPDATE notifications SET status = 'ignored', detail = ?2 WHERE id = ?1",
                    params![id, detail],
                )?;
            }
        }
    }
    Ok(())
}

/// Marks `ignored`, in the caller's transaction, every `unmatched`
/// chargeback of an authorization whose hold was released without a
/// capture (`why`: canceled or expired): there is no captured money to
/// take back.
pub fn release_unmatched(
    tx: &dyn Db,
    consumer_id: i64,
    authorization: &str,
    why: &str,
) -> Result<()> {
    tx.execute(
        "UPDATE notifications SET status = 'ignored', detail = ?3 \
         WHERE consumer_id = ?1 AND \"authorization\" = ?2 AND status = 'unmatched'",
        params![
            consumer_id,
            authorization,
            format!("the authorization's hold was {why} without a capture; nothing to take back")
        ],
    )?;
    Ok(())
}

/// A page of the consumer's notifications, newest first, of one status
/// if given, each with its current status.
pub fn list(
    db: &dyn Db,
    consumer_id: i64,
    status: Option<Status>,
    p: &Page,
) -> Result<std::result::Result<ListObject<NotificationObject>, UnknownCursor>> {
    // The filter is one of three static strings, never client text.
    let filter = status
        .map(|s| format!("AND n.status = '{}'", s.as_str()))
        .unwrap_or_default();
    let page_sql = format!(
        "SELECT n.public_id, s.public_id, n.webhook_id, n.type, n.status, n.detail, \
         (SELECT d.public_id FROM disputes d WHERE d.notification_id = n.id), n.received_at \
         FROM notifications n JOIN notification_sources s ON s.id = n.source_id \
         WHERE n.consumer_id = ?1 AND n.id < ?2 {filter} ORDER BY n.id DESC LIMIT ?3"
    );
    crate::ledger::page(
        db,
        consumer_id,
        p,
        "SELECT id FROM notifications WHERE consumer_id = ?1 AND public_id = ?2",
        &page_sql,
        |r| {
            let status: String = r.get(4)?;
            Ok(NotificationObject {
                id: r.get(0)?,
                object: "notification",
                source: r.get(1)?,
                webhook_id: r.get(2)?,
                kind: r.get(3)?,
                status: Status::parse(&status).unwrap_or(Status::Ignored).as_str(),
                detail: r.get(5)?,
                dispute: r.get(6)?,
                received_at: rfc3339(r.get(7)?),
            })
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bodies_are_validated_strictly() {
        let ok = NotificationRequest::from_json(&json!({
            "type": "chargeback.created",
            "data": {"authorization": "auth_1", "amount": 5, "reason": "fraud"}
        }))
        .unwrap();
        assert_eq!(ok.chargeback.unwrap().amount, 5);
        let other = NotificationRequest::from_json(&json!({"type": "x.y", "data": {"a": 1}}));
        assert_eq!(other.unwrap().chargeback, None);
        let field = |v: Value| NotificationRequest::from_json(&v).unwrap_err().field;
        assert_eq!(field(json!({"type": "x", "data": {}, "extra": 1})), "extra");
        assert_eq!(field(json!({"data": {}})), "type");
        assert_eq!(field(json!({"type": "", "data": {}})), "type");
        assert_eq!(field(json!({"type": "x", "data": []})), "data");
        assert_eq!(field(json!({"type": "x"})), "data");
        let cb = |data: Value| field(json!({"type": "chargeback.created", "data": data}));
        assert_eq!(cb(json!({"amount": 1})), "data.authorization");
        assert_eq!(cb(json!({"authorization": "a"})), "data.amount");
        assert_eq!(
            cb(json!({"authorization": "a", "amount": 0})),
            "data.amount"
        );
        assert_eq!(
            cb(json!({"authorization": "a", "amount": AMOUNT_MINOR_MAX + 1})),
            "data.amount"
        );
        assert_eq!(
            cb(json!({"authorization": "a", "amount": 1.5})),
            "data.amount"
        );
        assert_eq!(
            cb(json!({"authorization": "a", "amount": 1, "x": 1})),
            "data.x"
        );
        assert_eq!(
            cb(json!({"authorization": "a", "amount": 1, "reason": 7})),
            "data.reason"
        );
    }

    #[test]
    fn webhook_ids_are_idempotency_keys() {
        assert!(valid_webhook_id(b"msg_1"));
        assert!(valid_webhook_id(&[b'a'; 255]));
        assert!(!valid_webhook_id(&[b'a'; 256]));
        assert!(!valid_webhook_id(b""));
        assert!(!valid_webhook_id(b"a b"));
        assert!(!valid_webhook_id("é".as_bytes()));
    }
}
