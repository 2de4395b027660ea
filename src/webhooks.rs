//! Webhook endpoints and their deliveries, as stored: the SQL behind
//! `/v1/webhook_endpoints`, `GET /v1/events/{id}/deliveries`, and the
//! delivery engine's reads and writes (`delivery.rs` sends; this file only
//! reads and records).
//!
//! A delivery row is queued by `events::record` in the transaction of its
//! event, one per live subscribed endpoint. It is `pending` with a
//! `next_attempt_at` until an attempt succeeds (`succeeded`), the attempts
//! run out or its endpoint is deleted (`failed`).

use serde::Serialize;

use crate::config::WEBHOOK_ENDPOINTS_MAX;
use crate::error::{Error, Result};
use crate::ids;
use crate::ledger::UnknownCursor;
use crate::model::{ListObject, Page, WebhookEndpointRequest};
use crate::signature;
use crate::store::{params, Db, Row};
use crate::time::rfc3339;

/// Why a delivery stopped when its endpoint was deleted (its `last_error`).
pub const DELETED_ERROR: &str = "endpoint deleted before this delivery succeeded";

/// A webhook endpoint as the API shows it. `secret` is only ever set in
/// the answer to its creation (and that answer's replays).
#[derive(Debug, Clone, Serialize)]
pub struct EndpointObject {
    pub id: String,
    pub object: &'static str,
    pub url: String,
    pub enabled_events: Vec<String>,
    pub description: Option<String>,
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    pub created_at: String,
}

/// The answer to `DELETE /v1/webhook_endpoints/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct DeletedObject {
    pub id: String,
    pub object: &'static str,
    pub deleted: bool,
}

/// What creating an endpoint did.
#[derive(Debug)]
pub enum CreateOutcome {
    /// Created; the object carries the secret, shown this once.
    Created(EndpointObject),
    /// The consumer already has [`WEBHOOK_ENDPOINTS_MAX`] live endpoints.
    LimitReached,
}

fn endpoint_object(r: &dyn Row) -> Result<EndpointObject> {
    let events: String = r.get(2)?;
    Ok(EndpointObject {
        id: r.get(0)?,
        object: "webhook_endpoint",
        url: r.get(1)?,
        enabled_events: serde_json::from_str(&events).unwrap_or_default(),
        description: r.get(3)?,
        status: "enabled",
        secret: None,
        created_at: rfc3339(r.get(4)?),
    })
}

const ENDPOINT_COLUMNS: &str = "public_id, url, enabled_events, description, created_at";

/// Creates an endpoint with a new secret, unless the consumer is at its cap
/// of live endpoints (counted in this transaction: two racing creations
/// cannot both pass it).
pub fn create(
    tx: &dyn Db,
    consumer_id: i64,
    req: &WebhookEndpointRequest,
    now_ms: i64,
) -> Result<CreateOutcome> {
    let live: i64 = tx.query_value(
        "SELECT count(*) FROM webhook_endpoints \
         WHERE consumer_id = ?1 AND deleted_at IS NULL",
        params![consumer_id],
    )?;
    if live >= WEBHOOK_ENDPOINTS_MAX as i64 {
        return Ok(CreateOutcome::LimitReached);
    }
    let (key, secret) = signature::new_secret().map_err(|e| Error::Other(e.to_string()))?;
    let public_id = ids::new_id(ids::WEBHOOK_ENDPOINT);
    let events = serde_json::to_string(&req.enabled_events).expect("strings serialize");
    tx.execute(
        "INSERT INTO webhook_endpoints \
         (consumer_id, public_id, url, enabled_events, description, secret, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            consumer_id,
            public_id,
            req.url,
            events,
            req.description,
            &key[..],
            now_ms
        ],
    )?;
    Ok(CreateOutcome::Created(EndpointObject {
        id: public_id,
        object: "webhook_endpoint",
        url: req.url.clone(),
        enabled_events: req.enabled_events.clone(),
        description: req.description.clone(),
        status: "enabled",
        secret: Some(secret),
        created_at: rfc3339(now_ms),
    }))
}

/// The live endpoint `public_id` of this consumer, without its secret.
pub fn get(db: &dyn Db, consumer_id: i64, public_id: &str) -> Result<Option<EndpointObject>> {
    db.query_opt(
        &format!(
            "SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints \
             WHERE consumer_id = ?1 AND public_id = ?2 AND deleted_at IS NULL"
        ),
        params![consumer_id, public_id],
        endpoint_object,
    )
}

/// A page of the consumer's live endpoints, newest first. A cursor may name
/// an endpoint deleted since the previous page was read.
pub fn list(
    db: &dyn Db,
    consumer_id: i64,
    page: &Page,
) -> Result<std::result::Result<ListObject<EndpointObject>, UnknownCursor>> {
    crate::ledger::page(
        db,
        consumer_id,
        page,
        "SELECT id FROM webhook_endpoints WHERE consumer_id = ?1 AND public_id = ?2",
        &format!(
            "SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints \
             WHERE consumer_id = ?1 AND deleted_at IS NULL AND id < ?2 \
             ORDER BY id DESC LIMIT ?3"
        ),
        endpoint_object,
    )
}

/// Deletes the endpoint `public_id`: no new delivery is queued for it, and
/// its pending deliveries become `failed` with [`DELETED_ERROR`]. `None` if
/// the consumer never had it; deleting it again answers the same (a retried
/// DELETE whose first answer was lost must not see 404). Returns how many
/// deliveries it stopped.
pub fn delete(
    tx: &dyn Db,
    consumer_id: i64,
    public_id: &str,
    now_ms: i64,
) -> Result<Option<usize>> {
    let found: Option<(i64, Option<i64>)> = tx.query_opt(
        "SELECT id, deleted_at FROM webhook_endpoints \
         WHERE consumer_id = ?1 AND public_id = ?2",
        params![consumer_id, public_id],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    let Some((id, deleted_at)) = found else {
        return Ok(None);
    };
    if deleted_at.is_some() {
        return Ok(Some(0));
    }
    tx.execute(
        "UPDATE webhook_endpoints SET deleted_at = ?2 WHERE id = ?1",
        params![id, now_ms],
    )?;
    let stopped = tx.execute(
        "UPDATE deliveries SET status = 'failed', next_attempt_at = NULL, \
         last_error = ?2, updated_at = ?3 \
         WHERE endpoint_id = ?1 AND status = 'pending'",
        params![id, DELETED_ERROR, now_ms],
    )?;
    Ok(Some(stopped))
}

/// One delivery as `GET /v1/events/{id}/deliveries` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct DeliveryObject {
    pub object: &'static str,
    /// The endpoint's id (`we_...`), deleted or not.
    pub endpoint: String,
    pub status: String,
    pub attempts: i64,
    /// The HTTP status of the last attempt; null if it got none (never
    /// tried, refused, timed out, closed).
    pub last_status: Option<i64>,
    /// Why the last attempt failed, or why the delivery stopped.
    pub last_error: Option<String>,
    pub next_attempt_at: Option<String>,
}

/// The deliveries of the consumer's event `event` (one per endpoint that
/// was subscribed when it was recorded: at most [`WEBHOOK_ENDPOINTS_MAX`],
/// so there is no page), oldest endpoint first; `None` if there is no such
/// event.
pub fn deliveries(
    db: &dyn Db,
    consumer_id: i64,
    event: &str,
) -> Result<Option<ListObject<DeliveryObject>>> {
    let Some(event_id): Option<i64> = db.query_opt(
        "SELECT id FROM events WHERE consumer_id = ?1 AND public_id = ?2",
        params![consumer_id, event],
        |r| r.get(0),
    )?
    else {
        return Ok(None);
    };
    let data = db.query_all(
        "SELECT e.public_id, d.status, d.attempts, d.last_status, d.last_error, \
         d.next_attempt_at FROM deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id \
         WHERE d.event_id = ?1 ORDER BY d.endpoint_id",
        params![event_id],
        |r| {
            Ok(DeliveryObject {
                object: "delivery",
                endpoint: r.get(0)?,
                status: r.get(1)?,
                attempts: r.get(2)?,
                last_status: r.get(3)?,
                last_error: r.get(4)?,
                next_attempt_at: r.get::<Option<i64>>(5)?.map(rfc3339),
            })
        },
    )?;
    Ok(Some(ListObject {
        object: "list",
        data,
        has_more: false,
    }))
}

/// A delivery due now, with everything an attempt needs.
#[derive(Debug, Clone)]
pub struct Due {
    pub id: i64,
    pub endpoint_id: i64,
    /// Attempts made before this one.
    pub attempts: u32,
    /// The event's public id: the `webhook-id` of every attempt.
    pub event: String,
    pub body: Vec<u8>,
    pub url: String,
    pub key: Vec<u8>,
}

/// Up to `limit` pending deliveries due at `now_ms` that no other node has
/// leased, the longest due first, leased to `node` until `lease_until_ms`:
/// on a database that several servers share (PostgreSQL), where two nodes
/// must never send one delivery at once. One statement: the rows are
/// chosen `FOR UPDATE SKIP LOCKED` (a row another node is claiming now is
/// passed over, not waited for) and leased. Rows this node leased before
/// come back, so a dispatcher that reads again finds what it read.
pub fn claim_due(
    db: &dyn Db,
    node: &str,
    now_ms: i64,
    lease_until_ms: i64,
    limit: usize,
) -> Result<Vec<Due>> {
    let mut claimed: Vec<(i64, Due)> = db.query_all(
        "UPDATE deliveries d SET leased_by = ?2, leased_until = ?3 \
         FROM events ev, webhook_endpoints e \
         WHERE ev.id = d.event_id AND e.id = d.endpoint_id AND d.id IN ( \
           SELECT id FROM deliveries WHERE status = 'pending' AND next_attempt_at <= ?1 \
           AND (leased_until < ?1 OR leased_by = ?2) \
           ORDER BY next_attempt_at LIMIT ?4 FOR UPDATE SKIP LOCKED) \
         RETURNING d.next_attempt_at, d.id, d.endpoint_id, d.attempts, ev.public_id, ev.body, \
           e.url, e.secret",
        params![now_ms, node, lease_until_ms, limit as i64],
        |r| Ok((r.get(0)?, due_row(r, 1)?)),
    )?;
    claimed.sort_by_key(|(at, due)| (*at, due.id));
    Ok(claimed.into_iter().map(|(_, due)| due).collect())
}

/// A [`Due`] from the columns of a row, starting at column `at`.
fn due_row(r: &dyn Row, at: usize) -> Result<Due> {
    Ok(Due {
        id: r.get(at)?,
        endpoint_id: r.get(at + 1)?,
        attempts: u32::try_from(r.get::<i64>(at + 2)?).unwrap_or(u32::MAX),
        event: r.get(at + 3)?,
        body: r.get(at + 4)?,
        url: r.get(at + 5)?,
        key: r.get(at + 6)?,
    })
}

/// Up to `limit` pending deliveries due at `now_ms`, the longest due first:
/// on a database only this server writes (SQLite), where its dispatcher's
/// lease in memory is the whole lease.
pub fn due(db: &dyn Db, now_ms: i64, limit: usize) -> Result<Vec<Due>> {
    db.query_all(
        "SELECT d.id, d.endpoint_id, d.attempts, ev.public_id, ev.body, e.url, e.secret \
         FROM deliveries d \
         JOIN events ev ON ev.id = d.event_id \
         JOIN webhook_endpoints e ON e.id = d.endpoint_id \
         WHERE d.status = 'pending' AND d.next_attempt_at <= ?1 \
         ORDER BY d.next_attempt_at LIMIT ?2",
        params![now_ms, limit as i64],
        |r| due_row(r, 0),
    )
}

/// Pending deliveries, due or not (the `idem_webhook_backlog` gauge).
pub fn backlog(db: &dyn Db) -> Result<u64> {
    let n: i64 = db.query_value(
        "SELECT count(*) FROM deliveries WHERE status = 'pending'",
        params![],
    )?;
    Ok(n.max(0) as u64)
}

/// How one attempt ended, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    Succeeded,
    /// Another attempt is due at `next_attempt_at`.
    Retried,
    /// That was the last attempt.
    Failed,
    /// The delivery was no longer pending (its endpoint was deleted while
    /// the attempt was on the wire, or its event expired): nothing changed.
    Gone,
}

/// One attempt's outcome, as the delivery engine records it.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    /// The delivery.
    pub id: i64,
    /// A 2xx arrived.
    pub ok: bool,
    /// The HTTP status, if a response arrived.
    pub status: Option<u16>,
    /// Why the attempt failed.
    pub error: Option<String>,
    /// When to try again, or `None` if no attempt is left.
    pub next_attempt_at: Option<i64>,
}

/// Records one attempt of a delivery, if it is still pending (a delivery
/// its endpoint's deletion stopped is `Gone`).
pub fn record_attempt(tx: &dyn Db, a: &AttemptRecord, now_ms: i64) -> Result<Recorded> {
    let (state, next, recorded) = match (a.ok, a.next_attempt_at) {
        (true, _) => ("succeeded", None, Recorded::Succeeded),
        (false, Some(at)) => ("pending", Some(at), Recorded::Retried),
        (false, None) => ("failed", None, Recorded::Failed),
    };
    let n = tx.execute(
        "UPDATE deliveries SET status = ?2, attempts = attempts + 1, last_status = ?3, \
         last_error = ?4, next_attempt_at = ?5, updated_at = ?6 \
         WHERE id = ?1 AND status = 'pending'",
        params![a.id, state, a.status, a.error, next, now_ms],
    )?;
    Ok(if n == 1 { recorded } else { Recorded::Gone })
}
