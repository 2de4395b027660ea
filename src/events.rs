//! The transactional outbox: one event per state change, written by the
//! ledger in the transaction that makes the change, so an event exists if
//! and only if its change committed (a replay, a 409 or a 422 changes
//! nothing and writes none). Each webhook endpoint subscribed to the event's
//! type gets a delivery row in the same transaction: the delivery engine
//! finds it after any crash.
//!
//! An event's body is rendered once, here, and stored as bytes: `GET
//! /v1/events/{id}` and every delivery attempt send exactly those bytes.

use serde::Serialize;
use serde_json::value::RawValue;

use crate::error::{Error, Result};
use crate::ids;
use crate::ledger::UnknownCursor;
use crate::model::{ListObject, Page};
use crate::store::{params, Db, Dialect};
use crate::time::rfc3339;

/// What happened. The names are the contract's event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventType {
    AccountCreated,
    /// A charge captured at once.
    ChargeSucceeded,
    /// A hold placed (`capture: false`).
    ChargeAuthorized,
    ChargeCaptured,
    /// A hold released: requested, or expired.
    ChargeCanceled,
    RefundCreated,
    ChargeDisputeCreated,
}

impl EventType {
    /// Every type, in the contract's order.
    pub const ALL: [EventType; 7] = [
        EventType::AccountCreated,
        EventType::ChargeSucceeded,
        EventType::ChargeAuthorized,
        EventType::ChargeCaptured,
        EventType::ChargeCanceled,
        EventType::RefundCreated,
        EventType::ChargeDisputeCreated,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::AccountCreated => "account.created",
            EventType::ChargeSucceeded => "charge.succeeded",
            EventType::ChargeAuthorized => "charge.authorized",
            EventType::ChargeCaptured => "charge.captured",
            EventType::ChargeCanceled => "charge.canceled",
            EventType::RefundCreated => "refund.created",
            EventType::ChargeDisputeCreated => "charge.dispute.created",
        }
    }

    pub fn parse(s: &str) -> Option<EventType> {
        EventType::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

#[derive(Serialize)]
struct EventBody<'a, T: Serialize> {
    id: &'a str,
    object: &'static str,
    #[serde(rename = "type")]
    kind: &'static str,
    created_at: String,
    data: EventData<'a, T>,
}

#[derive(Serialize)]
struct EventData<'a, T: Serialize> {
    object: &'a T,
}

/// The deliveries of a new event (`?1`), due at once (`?2`), one per live
/// endpoint of its consumer (`?3`) subscribed to its type (`?4`) or to `*`.
const QUEUE_DELIVERIES_SQLITE: &str =
    "INSERT INTO deliveries (event_id, endpoint_id, status, attempts, next_attempt_at, \
     updated_at) \
     SELECT ?1, e.id, 'pending', 0, ?2, ?2 FROM webhook_endpoints e \
     WHERE e.consumer_id = ?3 AND e.deleted_at IS NULL \
     AND EXISTS (SELECT 1 FROM json_each(e.enabled_events) j WHERE j.value IN ('*', ?4))";
/// [`QUEUE_DELIVERIES_SQLITE`] for PostgreSQL: the array's elements as text;
/// the select list's parameters cast, so that their types do not hang on
/// how PostgreSQL infers them through `INSERT … SELECT`.
const QUEUE_DELIVERIES_POSTGRES: &str =
    "INSERT INTO deliveries (event_id, endpoint_id, status, attempts, next_attempt_at, \
     updated_at) \
     SELECT CAST(?1 AS BIGINT), e.id, 'pending', 0, CAST(?2 AS BIGINT), CAST(?2 AS BIGINT) \
     FROM webhook_endpoints e \
     WHERE e.consumer_id = ?3 AND e.deleted_at IS NULL \
     AND EXISTS (SELECT 1 FROM jsonb_array_elements_text(e.enabled_events::jsonb) AS j(value) \
     WHERE j.value IN ('*', CAST(?4 AS TEXT)))";

/// Writes the event of a state change, inside the caller's transaction, and
/// a pending delivery for every live endpoint of the consumer subscribed to
/// its type. `object` is the resource right after the change; `object_id`
/// its public id. Returns the number of deliveries queued.
pub fn record<T: Serialize>(
    tx: &dyn Db,
    consumer_id: i64,
    kind: EventType,
    object_id: &str,
    object: &T,
    now_ms: i64,
) -> Result<usize> {
    let public_id = ids::new_id(ids::EVENT);
    let body = serde_json::to_vec(&EventBody {
        id: &public_id,
        object: "event",
        kind: kind.as_str(),
        created_at: rfc3339(now_ms),
        data: EventData { object },
    })
    .expect("an event serializes");
    let event_id = tx.query_value::<i64>(
        "INSERT INTO events (consumer_id, public_id, type, object_id, body, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6) RETURNING id",
        params![
            consumer_id,
            public_id,
            kind.as_str(),
            object_id,
            body,
            now_ms
        ],
    )?;
    // Dialect split: the endpoint's `enabled_events` is a JSON array in a
    // TEXT column, which only the engines' own JSON functions can open.
    let queue_sql = match tx.dialect() {
        Dialect::Sqlite => QUEUE_DELIVERIES_SQLITE,
        Dialect::Postgres => QUEUE_DELIVERIES_POSTGRES,
    };
    let queued = tx.execute(
        queue_sql,
        params![event_id, now_ms, consumer_id, kind.as_str()],
    )?;
    Ok(queued)
}

/// One stored event: its body as it was rendered.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub body: Vec<u8>,
}

/// The event `public_id` of this consumer.
pub fn get(db: &dyn Db, consumer_id: i64, public_id: &str) -> Result<Option<StoredEvent>> {
    db.query_opt(
        "SELECT body FROM events WHERE consumer_id = ?1 AND public_id = ?2",
        params![consumer_id, public_id],
        |r| Ok(StoredEvent { body: r.get(0)? }),
    )
}

/// A page of the consumer's events, newest first, of one type if given.
/// The bodies go out as they are stored.
pub fn list(
    db: &dyn Db,
    consumer_id: i64,
    kind: Option<EventType>,
    page: &Page,
) -> Result<std::result::Result<ListObject<Box<RawValue>>, UnknownCursor>> {
    // The filter is one of the contract's static type names, never client text.
    let filter = kind
        .map(|k| format!("AND type = '{}'", k.as_str()))
        .unwrap_or_default();
    let page_sql = format!(
        "SELECT body FROM events WHERE consumer_id = ?1 {filter} AND id < ?2 \
         ORDER BY id DESC LIMIT ?3"
    );
    crate::ledger::page(
        db,
        consumer_id,
        page,
        "SELECT id FROM events WHERE consumer_id = ?1 AND public_id = ?2",
        &page_sql,
        |r| {
            // Stored as a BLOB of the bytes `record` rendered.
            let invalid = |e: &dyn std::fmt::Display| {
                Error::Storage(format!("column 0 holds an event body that is not JSON: {e}"))
            };
            let body = String::from_utf8(r.get(0)?).map_err(|e| invalid(&e))?;
            RawValue::from_string(body).map_err(|e| invalid(&e))
        },
    )
}

/// Deletes up to `limit` of the oldest events created before `cutoff_ms`,
/// with their deliveries, and moves the horizon of `idem verify` (state
/// changes before it may have lost their event) up to the newest one
/// deleted. Events are deleted in id order, so a clock that stepped back
/// never leaves an old event behind a newer deleted one for long.
pub fn delete_expired(tx: &dyn Db, cutoff_ms: i64, limit: usize) -> Result<usize> {
    let ids: Vec<(i64, i64)> = tx.query_all(
        "SELECT id, created_at FROM events ORDER BY id LIMIT ?1",
        params![limit as i64],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    let expired: Vec<(i64, i64)> = ids
        .into_iter()
        .take_while(|(_, at)| *at < cutoff_ms)
        .collect();
    let Some(&(last, _)) = expired.last() else {
        return Ok(0);
    };
    let newest = expired.iter().map(|(_, at)| *at).max().unwrap_or(0);
    tx.execute(
        "DELETE FROM deliveries WHERE event_id <= ?1",
        params![last],
    )?;
    let n = tx.execute("DELETE FROM events WHERE id <= ?1", params![last])?;
    // Scalar max() is SQLite's: a CASE on both engines (pruned_before is NOT
    // NULL). The cast types `?1` as BIGINT on PostgreSQL, which would infer
    // a 32-bit integer from `?1 + 1`.
    tx.execute(
        "UPDATE event_horizon SET pruned_before = CASE \
         WHEN pruned_before > CAST(?1 AS BIGINT) + 1 THEN pruned_before \
         ELSE CAST(?1 AS BIGINT) + 1 END \
         WHERE id = 1",
        params![newest],
    )?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_round_trip() {
        for t in EventType::ALL {
            assert_eq!(EventType::parse(t.as_str()), Some(t));
        }
        assert_eq!(EventType::parse("charge.refunded"), None);
    }
}
