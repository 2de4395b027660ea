//! `idem keys list|show|evict`: idempotency keys seen by an operator, on a
//! database a server may be running on.
//!
//! The CLI is another process writing the SQLite file beside the server's
//! writer thread (as `idem consumers create` does), so [`evict`] decides and
//! deletes in one `BEGIN IMMEDIATE` transaction: it sees the key row as the
//! server last committed it, and no reservation, takeover or completion can
//! slip in between the decision and the delete.
//!
//! What is shown is the row's bookkeeping — state, fingerprint, recovery
//! point, operation, times, the stored status — never the request kept in the
//! row (its metadata is the client's) nor the stored answer's body (a webhook
//! endpoint's or a notification source's creation answer holds its secret).

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::acquirer::Simulator;
use crate::error::{Error, Result};
use crate::ledger;
use crate::store::{params, Admin, Db, Dialect, Row};
use crate::time::{millis, rfc3339};

/// One key row as an operator sees it (no request, no response body).
#[derive(Debug, Clone, Serialize)]
pub struct KeyInfo {
    /// The consumer's name.
    pub consumer: String,
    /// The method of the scope (always `POST` today).
    pub method: String,
    /// The concrete path of the scope, e.g. `/v1/charges/ch_…/capture`.
    pub path: String,
    /// The `Idempotency-Key` as the client sent it.
    pub key: String,
    /// The operation's id (also the acquirer-side key).
    pub op_id: String,
    /// What the operation is: `charge`, `capture`, `cancel`, `refund`,
    /// `account`, `webhook_endpoint`, `notification_source`.
    pub operation: Option<String>,
    /// `in_progress` or `completed`.
    pub state: String,
    /// For a key in progress: `live` (its owner proved it was alive within
    /// `--inflight-timeout`), `orphan` (silent longer), `unlocked` (its owner
    /// gave up after a transient failure); `null` once completed.
    pub owner: Option<&'static str>,
    /// `reserved`, `authorized`, `declined`, `captured`, `voided`, `applied`.
    pub recovery_point: String,
    /// The fencing token: 1, plus one per takeover.
    pub generation: i64,
    /// SHA-256 of the request body's canonical JSON (RFC 8785), hex.
    pub fingerprint: String,
    /// The acquirer's authorization id, once recorded.
    pub authorization: Option<String>,
    /// When the key was reserved (RFC 3339).
    pub created_at: String,
    /// The owner's last sign of life; `null` when unlocked or completed.
    pub locked_at: Option<String>,
    /// When the key completed.
    pub completed_at: Option<String>,
    /// The stored answer's HTTP status (its body is never shown).
    pub response_status: Option<u16>,
}

/// Which keys [`list`] returns.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this consumer's keys (by name).
    pub consumer: Option<String>,
    /// Only keys in this state: `Some(true)` in progress, `Some(false)`
    /// completed.
    pub in_progress: Option<bool>,
    /// At most this many, newest first.
    pub limit: usize,
}

/// The outcome of [`evict`].
#[derive(Debug)]
pub enum Eviction {
    /// The key row is gone: the next request with the key is new. For an
    /// orphaned capture or cancel, the hold it had claimed is released.
    Evicted {
        /// The row as it was.
        key: Box<KeyInfo>,
        /// The charge whose claim was released, if any.
        released_charge: Option<String>,
    },
    /// No such key (in that consumer's scope and path).
    NotFound,
    /// The key stays; the reason says why and what to do instead.
    Refused(String),
}

// Dialect split: the operation is the `kind` of the request kept as JSON
// text; SQLite's json_extract has no PostgreSQL spelling (->> on jsonb).
// `authorization` is quoted: a reserved word in PostgreSQL.
const COLUMNS_SQLITE: &str = "c.name, k.method, k.path, k.key, k.op_id, \
     json_extract(k.request, '$.kind'), k.state, k.recovery_point, k.generation, \
     k.fingerprint, k.\"authorization\", k.created_at, k.locked_at, k.completed_at, \
     k.response_status";
const COLUMNS_POSTGRES: &str = "c.name, k.method, k.path, k.key, k.op_id, \
     (k.request::jsonb ->> 'kind'), k.state, k.recovery_point, k.generation, \
     k.fingerprint, k.\"authorization\", k.created_at, k.locked_at, k.completed_at, \
     k.response_status";

/// The columns [`row_to_info`] reads, as `db` spells them.
fn columns(db: &dyn Db) -> &'static str {
    match db.dialect() {
        Dialect::Sqlite => COLUMNS_SQLITE,
        Dialect::Postgres => COLUMNS_POSTGRES,
    }
}

/// Reads one row of [`columns`]; `now_ms` and `inflight` decide `owner`.
fn row_to_info(r: &dyn Row, now_ms: i64, inflight: Duration) -> Result<KeyInfo> {
    let state: String = r.get(6)?;
    let fingerprint: Vec<u8> = r.get(9)?;
    let locked_at: i64 = r.get(12)?;
    let completed_at: Option<i64> = r.get(13)?;
    let status: Option<i64> = r.get(14)?;
    let in_progress = state == "in_progress";
    let owner = in_progress.then(|| owner_of(locked_at, now_ms, inflight));
    Ok(KeyInfo {
        consumer: r.get(0)?,
        method: r.get(1)?,
        path: r.get(2)?,
        key: r.get(3)?,
        op_id: r.get(4)?,
        operation: r.get(5)?,
        state,
        owner,
        recovery_point: r.get(7)?,
        generation: r.get(8)?,
        fingerprint: fingerprint.iter().map(|b| format!("{b:02x}")).collect(),
        authorization: r.get(10)?,
        created_at: rfc3339(r.get(11)?),
        locked_at: (in_progress && locked_at != 0).then(|| rfc3339(locked_at)),
        completed_at: completed_at.map(rfc3339),
        response_status: status.map(|s| s as u16),
    })
}

/// The decision table's test for an orphan (`idempotency::decide`): silent
/// for longer than the in-flight timeout, or unlocked (`locked_at = 0`).
fn owner_of(locked_at: i64, now_ms: i64, inflight: Duration) -> &'static str {
    if locked_at == 0 {
        "unlocked"
    } else if now_ms.saturating_sub(locked_at) > millis(inflight) {
        "orphan"
    } else {
        "live"
    }
}

/// The id of the consumer named `name`.
fn consumer_id(db: &dyn Db, name: &str) -> Result<i64> {
    db.query_opt(
        "SELECT id FROM consumers WHERE name = ?1",
        params![name],
        |r| r.get(0),
    )?
    .ok_or_else(|| {
        Error::Other(format!(
            "no consumer named '{name}' (see `idem consumers list`)"
        ))
    })
}

/// Keys, newest first, and whether more matched than `filter.limit`.
pub fn list(
    db: &dyn Db,
    filter: &Filter,
    now_ms: i64,
    inflight: Duration,
) -> Result<(Vec<KeyInfo>, bool)> {
    let consumer = match &filter.consumer {
        Some(name) => Some(consumer_id(db, name)?),
        None => None,
    };
    let state = filter
        .in_progress
        .map(|p| if p { "in_progress" } else { "completed" });
    // The casts type the parameters where PostgreSQL cannot infer a type
    // (`?1 IS NULL`); on SQLite they change nothing.
    let sql = format!(
        "SELECT {} FROM idempotency_keys k JOIN consumers c ON c.id = k.consumer_id \
         WHERE (CAST(?1 AS BIGINT) IS NULL OR k.consumer_id = ?1) \
         AND (CAST(?2 AS TEXT) IS NULL OR k.state = ?2) \
         ORDER BY k.created_at DESC, k.id DESC LIMIT ?3",
        columns(db)
    );
    let mut keys = db.query_all(
        &sql,
        params![consumer, state, filter.limit as i64 + 1],
        |r| row_to_info(r, now_ms, inflight),
    )?;
    let more = keys.len() > filter.limit;
    keys.truncate(filter.limit);
    Ok((keys, more))
}

/// The key `key` of consumer `consumer` on `POST path`.
pub fn show(
    db: &dyn Db,
    consumer: &str,
    path: &str,
    key: &str,
    now_ms: i64,
    inflight: Duration,
) -> Result<Option<KeyInfo>> {
    let consumer = consumer_id(db, consumer)?;
    load(db, consumer, path, key, now_ms, inflight)
}

fn load(
    db: &dyn Db,
    consumer: i64,
    path: &str,
    key: &str,
    now_ms: i64,
    inflight: Duration,
) -> Result<Option<KeyInfo>> {
    let sql = format!(
        "SELECT {} FROM idempotency_keys k JOIN consumers c ON c.id = k.consumer_id \
         WHERE k.consumer_id = ?1 AND k.method = 'POST' AND k.path = ?2 AND k.key = ?3",
        columns(db)
    );
    db.query_opt(&sql, params![consumer, path, key], |r| {
        row_to_info(r, now_ms, inflight)
    })
}

/// Deletes a key so that the next request with it is new, if that is safe:
///
/// - a **completed** key: always (its effect stays; a retry makes a second
///   one — a second charge for a charge key);
/// - a key **in progress** whose owner is alive (it proved so within
///   `inflight`, the server's `--inflight-timeout`): never — it may be
///   calling the acquirer right now;
/// - an **orphan** (silent past `inflight`, or unlocked): only while it is at
///   recovery point `reserved` and the built-in acquirer's file beside `db`
///   has never heard of its operation. Past `reserved` — or once the acquirer
///   has seen it (a crash between the call and the recovery point) — money
///   has moved or is held at the acquirer, and deleting the key would leave
///   that side without its ledger side (and a retry would authorize
///   again); a server finishes such an orphan instead (a retry with the key,
///   or the reaper), and its completed key can then be evicted. An orphaned
///   capture or cancel releases the claim on its hold in the same
///   transaction, so the hold can be captured or canceled again.
///
/// One write transaction on `admin` (on SQLite `BEGIN IMMEDIATE`), beside
/// any running server; `acquirer_store` is the built-in acquirer's file.
pub fn evict(
    admin: &mut Admin,
    acquirer_store: &Path,
    consumer: &str,
    path: &str,
    key: &str,
    now_ms: i64,
    inflight: Duration,
) -> Result<Eviction> {
    // A refusal writes nothing, so committing it changes nothing.
    admin.write(|db| evict_in(db, acquirer_store, consumer, path, key, now_ms, inflight))
}

/// The body of [`evict`], inside the caller's write transaction on `db`:
/// decides and, if it is safe, releases the claim and deletes the key row.
fn evict_in(
    db: &dyn Db,
    acquirer_store: &Path,
    consumer: &str,
    path: &str,
    key: &str,
    now_ms: i64,
    inflight: Duration,
) -> Result<Eviction> {
    let consumer_id = consumer_id(db, consumer)?;
    let Some(info) = load(db, consumer_id, path, key, now_ms, inflight)? else {
        return Ok(Eviction::NotFound);
    };
    let mut released_charge = None;
    if let Some(owner) = info.owner {
        if owner == "live" {
            return Ok(Eviction::Refused(format!(
                "key '{key}' is in progress and its owner is alive (it last proved so at {}, \
                 within --inflight-timeout {}): it may be calling the acquirer right now. \
                 Retry the request with the key instead, or wait until it completes",
                info.locked_at.as_deref().unwrap_or("?"),
                humantime(inflight)
            )));
        }
        if info.recovery_point != "reserved" {
            return Ok(Eviction::Refused(format!(
                "key '{key}' is an orphan at recovery point '{}': the acquirer has already \
                 acted on it, and evicting it would leave that without its ledger side. \
                 Let a server finish it (a retry with the key takes it over; `idem serve`'s \
                 reaper does within --reaper-interval), then evict the completed key",
                info.recovery_point
            )));
        }
        if Simulator::knows_operation(acquirer_store, &info.op_id)? {
            return Ok(Eviction::Refused(format!(
                "key '{key}' is an orphan at recovery point 'reserved', but the acquirer has \
                 already seen its operation {} (the owner stopped after the call, before \
                 recording it). Let a server finish it (a retry with the key takes it over; \
                 `idem serve`'s reaper does within --reaper-interval), then evict the \
                 completed key",
                info.op_id
            )));
        }
        released_charge = ledger::release_claim(db, &info.op_id)?;
    }
    db.execute(
        "DELETE FROM idempotency_keys WHERE consumer_id = ?1 AND method = 'POST' \
         AND path = ?2 AND key = ?3",
        params![consumer_id, path, key],
    )?;
    Ok(Eviction::Evicted {
        key: Box::new(info),
        released_charge,
    })
}

/// `60s`, `1500ms`: a duration as the flags spell it.
fn humantime(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}
