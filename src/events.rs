//! The transactional outbox: one event per state change, written by the
//! ledger in the transaction that makes the change, so an event exists if
//! and only if its change committed (a replay, a 409 or a 422 changes
//! nothing and writes none). Each webhook endpoint subscribed to the event's
//! type gets a delivery row in the same transaction: the delivery engine
//! finds it after any crash.
//!
//! An event's body is rendered once, here, and stored as bytes: `GET
//! /v1/events/{id}` and every delivery attempt send exactly those bytes.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;
use serde_json::value::RawValue;

use crate::error::Result;
use crate::ids;
use crate::ledger::{self, UnknownCursor};
use crate::model::{ListObject, Page};
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

/// Writes the event of a state change, inside the caller's transaction, and
/// a pending delivery for every live endpoint of the consumer subscribed to
/// its type. `object` is the resource right after the change; `object_id`
/// its public id. Returns the number of deliveries queued.
pub fn record<T: Serialize>(
    tx: &Connection,
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
    tx.prepare_cached(
        "INSERT INTO events (consumer_id, public_id, type, object_id, body, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        consumer_id,
        public_id,
        kind.as_str(),
        object_id,
        body,
        now_ms
    ])?;
    let event_id = tx.last_insert_rowid();
    let queued = tx
        .prepare_cached(
            "INSERT INTO deliveries (event_id, endpoint_id, status, attempts, next_attempt_at, \
             updated_at) \
             SELECT ?1, e.id, 'pending', 0, ?2, ?2 FROM webhook_endpoints e \
             WHERE e.consumer_id = ?3 AND e.deleted_at IS NULL \
             AND EXISTS (SELECT 1 FROM json_each(e.enabled_events) j WHERE j.value IN ('*', ?4))",
        )?
        .execute(params![event_id, now_ms, consumer_id, kind.as_str()])?;
    Ok(queued)
}

/// One stored event: its body as it was rendered.
#[derive(Debug, Clone)]
pub struct StoredEvent {
    pub body: Vec<u8>,
}

/// The event `public_id` of this consumer.
pub fn get(conn: &Connection, consumer_id: i64, public_id: &str) -> Result<Option<StoredEvent>> {
    Ok(conn
        .prepare_cached(
            "SELECT body FROM events WHERE consumer_id = ?1 AND public_id = ?2",
        )?
        .query_row(params![consumer_id, public_id], |r| {
            Ok(StoredEvent { body: r.get(0)? })
        })
        .optional()?)
}

/// A page of the consumer's events, newest first, of one type if given.
/// The bodies go out as they are stored.
pub fn list(
    conn: &Connection,
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
    ledger::page(
        conn,
        consumer_id,
        page,
        "SELECT id FROM events WHERE consumer_id = ?1 AND public_id = ?2",
        &page_sql,
        |r| {
            // Stored as a BLOB of the bytes `record` rendered.
            let invalid = |e: Box<dyn std::error::Error + Send + Sync>| {
                crate::error::Error::Storage(format!("column 0 is not an event body: {e}"))
            };
            let body = String::from_utf8(r.get(0)?).map_err(|e| invalid(e.into()))?;
            RawValue::from_string(body).map_err(|e| invalid(e.into()))
        },
    )
}

/// Deletes up to `limit` of the oldest events created before `cutoff_ms`,
/// with their deliveries, and moves the horizon of `idem verify` (state
/// changes before it may have lost their event) up to the newest one
/// deleted. Events are deleted in id order, so a clock that stepped back
/// never leaves an old event behind a newer deleted one for long.
pub fn delete_expired(tx: &Connection, cutoff_ms: i64, limit: usize) -> Result<usize> {
    let ids: Vec<(i64, i64)> = tx
        .prepare_cached("SELECT id, created_at FROM events ORDER BY id LIMIT ?1")?
        .query_map([limit as i64], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let expired: Vec<(i64, i64)> = ids
        .into_iter()
        .take_while(|(_, at)| *at < cutoff_ms)
        .collect();
    let Some(&(last, _)) = expired.last() else {
        return Ok(0);
    };
    let newest = expired.iter().map(|(_, at)| *at).max().unwrap_or(0);
    tx.prepare_cached("DELETE FROM deliveries WHERE event_id <= ?1")?
        .execute([last])?;
    let n = tx
        .prepare_cached("DELETE FROM events WHERE id <= ?1")?
        .execute([last])?;
    tx.prepare_cached(
        "UPDATE event_horizon SET pruned_before = max(pruned_before, ?1 + 1) WHERE id = 1",
    )?
    .execute([newest])?;
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
