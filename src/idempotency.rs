//! The idempotency protocol: key syntax and scope, the canonical fingerprint,
//! the decision table as a pure function, and the key-row operations
//! (reserve, take over, fence, record a recovery point, complete, unlock).
//!
//! The functions that touch the database take a [`Db`] inside the caller's
//! write transaction (the writer thread's), so every read-decide-write below
//! is atomic: the database picks the winner of a race.

use std::cmp::Ordering;
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::IDEMPOTENCY_KEY_LEN_MAX;
use crate::error::Result;
use crate::ids;
use crate::store::{params, Db, Dialect, Row};

/// A validated `Idempotency-Key`: 1–255 characters in 0x21–0x7E.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    Invalid,
}

impl IdempotencyKey {
    /// Parses the header value. A structured-field string (`"abc"`, with `\"`
    /// and `\\` escapes) is accepted and unquoted; the result must still be
    /// printable ASCII without spaces.
    pub fn parse(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
        let raw = raw.trim_ascii();
        let unquoted = match raw {
            [b'"', inner @ .., b'"'] => unescape_sf_string(inner).ok_or(KeyError::Invalid)?,
            // An opening quote promises a structured-field string.
            [b'"', ..] => return Err(KeyError::Invalid),
            _ => raw.to_vec(),
        };
        let len_ok = (1..=IDEMPOTENCY_KEY_LEN_MAX).contains(&unquoted.len());
        if !len_ok || !unquoted.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(KeyError::Invalid);
        }
        Ok(IdempotencyKey(
            String::from_utf8(unquoted).expect("ASCII is UTF-8"),
        ))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn unescape_sf_string(inner: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return None,
            },
            b'"' => return None,
            _ => out.push(b),
        }
    }
    Some(out)
}

/// What a key is unique within: the same key from two consumers, or on two
/// routes, names two unrelated requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    pub consumer_id: i64,
    pub method: &'static str,
    /// The concrete path, e.g. `/v1/charges/ch_…/refunds`.
    pub path: String,
}

/// SHA-256 of the canonical JSON of a request body.
pub type Fingerprint = [u8; 32];

pub fn fingerprint(body: &Value) -> Fingerprint {
    let mut canonical = String::new();
    write_canonical(body, &mut canonical);
    Sha256::digest(canonical.as_bytes()).into()
}

/// RFC 8785 (JCS) serialisation: object keys sorted by their UTF-16 code
/// units, recursively; no insignificant whitespace; strings escaped as
/// ECMAScript's `JSON.stringify` does; numbers as ECMAScript's
/// `Number.prototype.toString` writes them (`write_number`).
pub fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => out.push_str(&Value::String(s.clone()).to_string()),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| utf16_cmp(a.0, b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
    }
}

/// A number as RFC 8785 §3.2.2.3 writes it (ECMAScript's
/// `Number.prototype.toString`): the shortest digits that read back as the
/// same double, in plain notation from 1e-6 up to 1e21 and in exponent
/// notation (`1e+21`, `1.5e-7`) outside it; `-0` is `0`.
///
/// One deliberate difference: an integer — or a double with an integral
/// value below 1e21 — is written with its exact digits, where JCS would
/// round anything past 2^53 to a double first. Below 2^53 the two agree;
/// above, JCS would give 2^53 and 2^53 + 1 one fingerprint, and two
/// different requests must never share one.
fn write_number(n: &serde_json::Number, out: &mut String) {
    if let Some(i) = n.as_i64() {
        out.push_str(&i.to_string());
        return;
    }
    if let Some(u) = n.as_u64() {
        out.push_str(&u.to_string());
        return;
    }
    // Without serde_json's `arbitrary_precision` a number is an i64, a u64
    // or a finite f64.
    let f = n.as_f64().expect("a finite double");
    if f == 0.0 {
        out.push('0');
        return;
    }
    if f.fract() == 0.0 && f.abs() < 1e21 {
        out.push_str(&format!("{f:.0}"));
        return;
    }
    if f < 0.0 {
        out.push('-');
    }
    let (digits, n) = shortest_digits(f.abs());
    let k = digits.len() as i32;
    let zeros = |count: i32| "0".repeat(count as usize);
    if k <= n && n <= 21 {
        out.push_str(&digits);
        out.push_str(&zeros(n - k));
    } else if 0 < n && n <= 21 {
        out.push_str(&digits[..n as usize]);
        out.push('.');
        out.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.push_str(&zeros(-n));
        out.push_str(&digits);
    } else {
        out.push_str(&digits[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push_str(&format!(
            "e{}{}",
            if n > 0 { "+" } else { "-" },
            (n - 1).abs()
        ));
    }
}

/// The shortest digits `s` that read back as `f` (> 0), and `n` such that
/// `f` = 0.s × 10^n. Of two equally short candidates, ECMAScript takes the
/// closer one and, on an exact tie, the even one; Rust's `{:e}` rounds a tie
/// up, so a tie is checked against `f`'s exact expansion (at most 767
/// significant digits).
fn shortest_digits(f: f64) -> (String, i32) {
    let split = |sci: String| {
        let (mantissa, exponent) = sci.split_once('e').expect("{:e} writes an exponent");
        let digits = mantissa.replace('.', "");
        let n = exponent.parse::<i32>().expect("an integer exponent") + 1;
        (digits, n)
    };
    let (digits, n) = split(format!("{f:e}"));
    let (exact, exact_n) = split(format!("{f:.767e}"));
    let exact = exact.trim_end_matches('0');
    let k = digits.len();
    if exact.len() == k + 1 && exact.ends_with('5') {
        // Exactly halfway between `down` and the next k-digit number.
        let down = &exact[..k];
        let even = down.ends_with(['0', '2', '4', '6', '8']);
        let reads_back = format!("0.{down}e{exact_n}").parse::<f64>() == Ok(f);
        if even && reads_back {
            return (down.to_string(), exact_n);
        }
    }
    (digits, n)
}

fn utf16_cmp(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

// ---------------------------------------------------------------------------
// The decision table

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    InProgress,
    Completed,
}

/// What the decision needs to know about a stored key row.
#[derive(Debug, Clone, Copy)]
pub struct RowView {
    pub state: KeyState,
    pub same_fingerprint: bool,
    /// When the owner last proved it was alive (0 = unlocked).
    pub locked_at_ms: i64,
    pub completed_at_ms: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Sync,
    /// `Prefer: respond-async`.
    Async,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// No live row: reserve the key and execute.
    Execute,
    /// Completed with the same fingerprint: the stored answer, byte for byte.
    Replay,
    /// Another body under this key: 422 `idempotency-key-reused`.
    Reused,
    /// In progress, owner alive, synchronous request: 409 with `Retry-After`.
    InUse,
    /// In progress, owner alive, async request: 202 and the operation.
    Accepted,
    /// In progress, owner silent past the in-flight timeout: take it over.
    TakeOver,
}

#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub inflight: Duration,
    pub retention: Duration,
}

/// The contract's decision table. A completed row past retention counts as
/// absent whatever its fingerprint; then the fingerprint; then the state.
pub fn decide(row: Option<RowView>, mode: Mode, now_ms: i64, t: Timeouts) -> Decision {
    let Some(row) = row else {
        return Decision::Execute;
    };
    let expired = row
        .completed_at_ms
        .is_some_and(|at| now_ms.saturating_sub(at) > crate::time::millis(t.retention));
    if row.state == KeyState::Completed && expired {
        return Decision::Execute;
    }
    if !row.same_fingerprint {
        return Decision::Reused;
    }
    match row.state {
        KeyState::Completed => Decision::Replay,
        KeyState::InProgress
            if now_ms.saturating_sub(row.locked_at_ms) > crate::time::millis(t.inflight) =>
        {
            Decision::TakeOver
        }
        KeyState::InProgress => match mode {
            Mode::Sync => Decision::InUse,
            Mode::Async => Decision::Accepted,
        },
    }
}

// ---------------------------------------------------------------------------
// Key rows

/// Where an operation's work stands, recorded in the key row. Every step
/// that leaves the database (an acquirer call) lies between two of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryPoint {
    /// Reserved; nothing has left the database yet.
    Reserved,
    /// The acquirer authorised; its authorization is stored in the row.
    Authorized,
    /// The ledger declined after the authorization: the answer is decided
    /// and stored, the authorization's void is due.
    Declined,
    /// The acquirer captured; the ledger phase is due.
    Captured,
    /// The acquirer voided; the ledger phase is due.
    Voided,
    /// A refund's ledger effect and answer are committed; the acquirer's
    /// refund is due.
    Applied,
}

impl RecoveryPoint {
    /// The name stored in the key row.
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryPoint::Reserved => "reserved",
            RecoveryPoint::Authorized => "authorized",
            RecoveryPoint::Declined => "declined",
            RecoveryPoint::Captured => "captured",
            RecoveryPoint::Voided => "voided",
            RecoveryPoint::Applied => "applied",
        }
    }
    fn parse(s: &str) -> RecoveryPoint {
        match s {
            "authorized" => RecoveryPoint::Authorized,
            "declined" => RecoveryPoint::Declined,
            "captured" => RecoveryPoint::Captured,
            "voided" => RecoveryPoint::Voided,
            "applied" => RecoveryPoint::Applied,
            _ => RecoveryPoint::Reserved,
        }
    }
}

/// A stored answer: status and the exact body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub body: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct KeyRow {
    pub id: i64,
    pub consumer_id: i64,
    pub key: String,
    pub op_id: String,
    pub fingerprint: Vec<u8>,
    pub state: KeyState,
    pub generation: i64,
    pub locked_at_ms: i64,
    pub recovery_point: RecoveryPoint,
    pub request: String,
    pub authorization: Option<String>,
    /// The final answer; an in-progress row may hold it already when it was
    /// decided before one last acquirer call (`Declined`, `Applied`).
    pub response: Option<StoredResponse>,
    pub completed_at_ms: Option<i64>,
    /// Not stored: the operation's pre-check ran in the transaction that
    /// reserved this row and found nothing final, so whoever runs it now
    /// need not check again before calling the acquirer.
    pub prechecked: bool,
}

impl KeyRow {
    pub fn view(&self, fp: &Fingerprint) -> RowView {
        RowView {
            state: self.state,
            same_fingerprint: self.fingerprint.as_slice() == fp.as_slice(),
            locked_at_ms: self.locked_at_ms,
            completed_at_ms: self.completed_at_ms,
        }
    }

    /// The request's fingerprint (stored as a 32-byte blob).
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
            .as_slice()
            .try_into()
            .expect("fingerprints are 32 bytes")
    }

    pub fn owner(&self) -> Owner {
        Owner {
            key_id: self.id,
            generation: self.generation,
            op_id: self.op_id.clone(),
            consumer_id: self.consumer_id,
            key: self.key.clone(),
        }
    }
}

/// The right to finish one operation: the key row and the fencing token
/// (generation) that was current when it was acquired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub key_id: i64,
    pub generation: i64,
    pub op_id: String,
    pub consumer_id: i64,
    pub key: String,
}

// `authorization` is a reserved word in PostgreSQL: quoted (as an
// identifier, which SQLite reads the same) wherever a statement names it.
const KEY_COLUMNS: &str =
    "id, consumer_id, key, op_id, fingerprint, state, generation, locked_at, \
     recovery_point, request, \"authorization\", response_status, response_body, completed_at";

fn row_to_key(r: &dyn Row) -> Result<KeyRow> {
    let state: String = r.get(5)?;
    let recovery: String = r.get(8)?;
    let status: Option<i64> = r.get(11)?;
    let body: Option<Vec<u8>> = r.get(12)?;
    Ok(KeyRow {
        id: r.get(0)?,
        consumer_id: r.get(1)?,
        key: r.get(2)?,
        op_id: r.get(3)?,
        fingerprint: r.get(4)?,
        state: if state == "completed" {
            KeyState::Completed
        } else {
            KeyState::InProgress
        },
        generation: r.get(6)?,
        locked_at_ms: r.get(7)?,
        recovery_point: RecoveryPoint::parse(&recovery),
        request: r.get(9)?,
        authorization: r.get(10)?,
        response: status.map(|s| StoredResponse {
            status: s as u16,
            body: body.unwrap_or_default(),
        }),
        completed_at_ms: r.get(13)?,
        prechecked: false,
    })
}

pub fn load(db: &dyn Db, scope: &Scope, key: &IdempotencyKey) -> Result<Option<KeyRow>> {
    let sql = format!(
        "SELECT {KEY_COLUMNS} FROM idempotency_keys \
         WHERE consumer_id = ?1 AND method = ?2 AND path = ?3 AND key = ?4"
    );
    db.query_opt(
        &sql,
        params![scope.consumer_id, scope.method, scope.path, key.as_str()],
        row_to_key,
    )
}

pub fn load_by_id(db: &dyn Db, id: i64) -> Result<Option<KeyRow>> {
    let sql = format!("SELECT {KEY_COLUMNS} FROM idempotency_keys WHERE id = ?1");
    db.query_opt(&sql, params![id], row_to_key)
}

/// The operation `op_id` of `consumer_id` (other consumers' are absent).
pub fn load_operation(db: &dyn Db, consumer_id: i64, op_id: &str) -> Result<Option<KeyRow>> {
    let sql =
        format!("SELECT {KEY_COLUMNS} FROM idempotency_keys WHERE op_id = ?1 AND consumer_id = ?2");
    db.query_opt(&sql, params![op_id, consumer_id], row_to_key)
}

/// The outcome of trying to reserve a key.
#[derive(Debug)]
pub enum Reservation {
    /// This request owns the operation; `row` is as it stands after the
    /// reservation or takeover (its recovery point says where to resume).
    Owned {
        row: KeyRow,
        took_over: bool,
    },
    /// Completed earlier: answer the stored response.
    Replay(StoredResponse),
    Reused,
    /// Someone alive owns it: 409 (sync) or 202 (async) naming `op_id`.
    Busy {
        op_id: String,
    },
    /// Another key's request with the same `reference` is in progress: 409
    /// `reference-in-use`; this key stays free.
    ReferenceBusy,
}

/// One request asking for its key.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub scope: Scope,
    pub key: IdempotencyKey,
    pub fingerprint: Fingerprint,
    /// The validated request, kept in the row for whoever finishes it.
    pub request_json: String,
    pub mode: Mode,
    /// A charge's natural key, claimed while the key is in progress.
    pub reference: Option<String>,
}

/// The answer the decision table gives without any write (replay, 422,
/// 409/202), or `None` when the key must be reserved or taken over.
///
/// Safe on a reader's snapshot: a completed row never changes before it
/// expires, a fingerprint never changes, and an owner seen alive was alive a
/// moment ago — the client's retry sees what happened since. A snapshot that
/// shows no row, or an orphan, settles nothing: only the writer may act.
pub fn settle(row: Option<&KeyRow>, a: &Attempt, now_ms: i64, t: Timeouts) -> Option<Reservation> {
    let row = row?;
    match decide(Some(row.view(&a.fingerprint)), a.mode, now_ms, t) {
        Decision::Replay => Some(Reservation::Replay(
            row.response
                .clone()
                .expect("completed rows have a response"),
        )),
        Decision::Reused => Some(Reservation::Reused),
        Decision::InUse | Decision::Accepted => Some(Reservation::Busy {
            op_id: row.op_id.clone(),
        }),
        Decision::Execute | Decision::TakeOver => None,
    }
}

/// Reserves the attempt's key, or tells why not. Runs the decision table on
/// the row as it is inside the caller's write transaction.
pub fn reserve(db: &dyn Db, a: &Attempt, now_ms: i64, t: Timeouts) -> Result<Reservation> {
    let (scope, key, fp) = (&a.scope, &a.key, &a.fingerprint);
    let existing = load(db, scope, key)?;
    if let Some(answer) = settle(existing.as_ref(), a, now_ms, t) {
        return Ok(answer);
    }
    match existing {
        // None, or a completed row past retention, which makes way.
        existing
            if existing
                .as_ref()
                .is_none_or(|r| r.state == KeyState::Completed) =>
        {
            if let Some(reference) = &a.reference {
                let claimed = db.exists(
                    "SELECT 1 FROM idempotency_keys WHERE consumer_id = ?1 AND reference = ?2 \
                     AND state = 'in_progress'",
                    params![scope.consumer_id, reference],
                )?;
                if claimed {
                    return Ok(Reservation::ReferenceBusy);
                }
            }
            if let Some(old) = existing {
                // A completed key past retention: the row makes way.
                db.execute(
                    "DELETE FROM idempotency_keys WHERE id = ?1",
                    params![old.id],
                )?;
            }
            let op_id = ids::new_id(ids::OPERATION);
            let id = db.query_value::<i64>(
                "INSERT INTO idempotency_keys (consumer_id, method, path, key, fingerprint, op_id, \
                 state, generation, locked_at, recovery_point, request, reference, created_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'in_progress', 1, ?7, 'reserved', ?8, ?9, ?7) \
                 RETURNING id",
                params![
                    scope.consumer_id,
                    scope.method,
                    scope.path,
                    key.as_str(),
                    fp.as_slice(),
                    op_id,
                    now_ms,
                    a.request_json,
                    a.reference,
                ],
            )?;
            let row = KeyRow {
                id,
                consumer_id: scope.consumer_id,
                key: key.as_str().to_string(),
                op_id,
                fingerprint: fp.to_vec(),
                state: KeyState::InProgress,
                generation: 1,
                locked_at_ms: now_ms,
                recovery_point: RecoveryPoint::Reserved,
                request: a.request_json.clone(),
                authorization: None,
                response: None,
                completed_at_ms: None,
                prechecked: false,
            };
            Ok(Reservation::Owned {
                row,
                took_over: false,
            })
        }
        // An in-progress orphan.
        Some(row) => Ok(Reservation::Owned {
            row: take_over(db, &row, now_ms)?,
            took_over: true,
        }),
        None => unreachable!("handled above"),
    }
}

/// Takes an orphan over: bumps the fencing token and relocks it now. Any
/// later commit by the previous owner fails its fence check.
pub fn take_over(db: &dyn Db, row: &KeyRow, now_ms: i64) -> Result<KeyRow> {
    db.execute(
        "UPDATE idempotency_keys SET generation = generation + 1, locked_at = ?2 \
         WHERE id = ?1 AND state = 'in_progress'",
        params![row.id, now_ms],
    )?;
    Ok(KeyRow {
        generation: row.generation + 1,
        locked_at_ms: now_ms,
        prechecked: false,
        ..row.clone()
    })
}

/// Whether `owner` still holds its key: same generation, still in progress.
pub fn holds(db: &dyn Db, owner: &Owner) -> Result<bool> {
    db.exists(
        "SELECT 1 FROM idempotency_keys \
         WHERE id = ?1 AND generation = ?2 AND state = 'in_progress'",
        params![owner.key_id, owner.generation],
    )
}

/// Records the acquirer's answer as a recovery point and refreshes the lock.
/// Returns false (and changes nothing) if `owner` was fenced off.
pub fn record_authorization(
    db: &dyn Db,
    owner: &Owner,
    authorization: &str,
    now_ms: i64,
) -> Result<bool> {
    let n = db.execute(
        "UPDATE idempotency_keys SET recovery_point = ?3, \"authorization\" = ?4, \
         locked_at = ?5 WHERE id = ?1 AND generation = ?2 AND state = 'in_progress'",
        params![
            owner.key_id,
            owner.generation,
            RecoveryPoint::Authorized.as_str(),
            authorization,
            now_ms
        ],
    )?;
    Ok(n == 1)
}

/// Records that an acquirer call (a capture, a void) happened: the recovery
/// point moves on and the lock is refreshed. Returns false (and changes
/// nothing) if `owner` was fenced off.
pub fn record_point(
    db: &dyn Db,
    owner: &Owner,
    point: RecoveryPoint,
    now_ms: i64,
) -> Result<bool> {
    let n = db.execute(
        "UPDATE idempotency_keys SET recovery_point = ?3, locked_at = ?4 \
         WHERE id = ?1 AND generation = ?2 AND state = 'in_progress'",
        params![owner.key_id, owner.generation, point.as_str(), now_ms],
    )?;
    Ok(n == 1)
}

/// Stores the answer, decided now, of an operation that has one acquirer
/// call left before it completes (`Declined`: a void; `Applied`: a refund),
/// and moves to `point`. The key stays in progress: a retry meanwhile gets
/// 409, and whoever resumes makes the call and then [`finish`]es. Returns
/// false (and changes nothing) if `owner` was fenced off.
pub fn record_answer(
    db: &dyn Db,
    owner: &Owner,
    point: RecoveryPoint,
    response: &StoredResponse,
    now_ms: i64,
) -> Result<bool> {
    let n = db.execute(
        "UPDATE idempotency_keys SET recovery_point = ?3, response_status = ?4, \
         response_body = ?5, locked_at = ?6 \
         WHERE id = ?1 AND generation = ?2 AND state = 'in_progress'",
        params![
            owner.key_id,
            owner.generation,
            point.as_str(),
            response.status,
            response.body,
            now_ms
        ],
    )?;
    Ok(n == 1)
}

/// Completes a key whose answer was recorded earlier ([`record_answer`]), now that its last
/// acquirer call is done; returns that answer. `None` (and no change) if
/// `owner` was fenced off.
pub fn finish(db: &dyn Db, owner: &Owner, now_ms: i64) -> Result<Option<StoredResponse>> {
    let n = db.execute(
        "UPDATE idempotency_keys SET state = 'completed', completed_at = ?3 \
         WHERE id = ?1 AND generation = ?2 AND state = 'in_progress' \
         AND response_status IS NOT NULL",
        params![owner.key_id, owner.generation, now_ms],
    )?;
    if n == 0 {
        return Ok(None);
    }
    Ok(load_by_id(db, owner.key_id)?.and_then(|row| row.response))
}

/// Stores the final answer and completes the key. Returns false (and changes
/// nothing) if `owner` was fenced off.
pub fn complete(
    db: &dyn Db,
    owner: &Owner,
    response: &StoredResponse,
    now_ms: i64,
) -> Result<bool> {
    let n = db.execute(
        "UPDATE idempotency_keys SET state = 'completed', response_status = ?3, \
         response_body = ?4, completed_at = ?5 \
         WHERE id = ?1 AND generation = ?2 AND state = 'in_progress'",
        params![
            owner.key_id,
            owner.generation,
            response.status,
            response.body,
            now_ms
        ],
    )?;
    Ok(n == 1)
}

/// Gives the key up after a transient failure: the next request (or the
/// reaper) takes it over at once and resumes from its recovery point.
pub fn unlock(db: &dyn Db, owner: &Owner) -> Result<bool> {
    let n = db.execute(
        "UPDATE idempotency_keys SET locked_at = 0 \
         WHERE id = ?1 AND generation = ?2 AND state = 'in_progress'",
        params![owner.key_id, owner.generation],
    )?;
    Ok(n == 1)
}

/// Ids of in-progress keys whose owner has been silent since before `cutoff_ms`.
pub fn orphans(db: &dyn Db, cutoff_ms: i64, limit: usize) -> Result<Vec<i64>> {
    db.query_all(
        "SELECT id FROM idempotency_keys WHERE state = 'in_progress' AND locked_at < ?1 \
         ORDER BY locked_at LIMIT ?2",
        params![cutoff_ms, limit as i64],
        |r| r.get(0),
    )
}

/// Takes over the orphan `id` if it still is one (the reaper's entry point).
pub fn take_over_orphan(
    db: &dyn Db,
    id: i64,
    now_ms: i64,
    inflight: Duration,
) -> Result<Option<KeyRow>> {
    // Several servers' reapers may find one orphan (PostgreSQL): the one
    // that locks the row first takes it over, the others pass it by at once
    // rather than wait for that transaction (and then find it live).
    if db.dialect() == Dialect::Postgres
        && !db.exists(
            "SELECT 1 FROM idempotency_keys WHERE id = ?1 FOR UPDATE SKIP LOCKED",
            params![id],
        )?
    {
        return Ok(None);
    }
    let Some(row) = load_by_id(db, id)? else {
        return Ok(None);
    };
    let orphaned = row.state == KeyState::InProgress
        && now_ms.saturating_sub(row.locked_at_ms) > crate::time::millis(inflight);
    if !orphaned {
        return Ok(None);
    }
    take_over(db, &row, now_ms).map(Some)
}

/// Deletes up to `limit` completed keys that completed before `cutoff_ms`.
pub fn delete_expired(db: &dyn Db, cutoff_ms: i64, limit: usize) -> Result<usize> {
    db.execute(
        "DELETE FROM idempotency_keys WHERE id IN (SELECT id FROM idempotency_keys \
         WHERE state = 'completed' AND completed_at < ?1 LIMIT ?2)",
        params![cutoff_ms, limit as i64],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_syntax() {
        let ok = |raw: &str, want: &str| {
            assert_eq!(
                IdempotencyKey::parse(raw.as_bytes()).map(|k| k.0),
                Ok(want.to_string()),
                "{raw:?}"
            )
        };
        let bad = |raw: &[u8]| {
            assert_eq!(
                IdempotencyKey::parse(raw),
                Err(KeyError::Invalid),
                "{raw:?}"
            )
        };
        ok("abc", "abc");
        ok("  abc ", "abc");
        ok("\"abc\"", "abc");
        ok(r#""a\"b\\c""#, r#"a"b\c"#);
        ok(
            "6b0c1a38-6c1b-4f5e-9f0e-2f6d2a7c9e11",
            "6b0c1a38-6c1b-4f5e-9f0e-2f6d2a7c9e11",
        );
        ok(&"x".repeat(255), &"x".repeat(255));
        bad(b"");
        bad(b"\"\"");
        bad("x".repeat(256).as_bytes());
        bad(b"a b");
        bad(b"\"a b\"");
        bad(b"a\tb");
        bad("caf\u{e9}".as_bytes());
        bad(b"\"a\\nb\"");
        bad(b"\"a\"b\"");
        bad(b"\"unterminated");
        bad(b"\"");
        bad(b"\x7f");
    }

    #[test]
    fn canonical_json_sorts_keys_and_drops_whitespace() {
        let mut s = String::new();
        let v: Value = serde_json::from_str(
            r#"{ "b": 1, "a": {"z": [3, {"y": null, "x": true}], "\u00e9": "\n"}, "A": -7 }"#,
        )
        .unwrap();
        write_canonical(&v, &mut s);
        assert_eq!(
            s,
            r#"{"A":-7,"a":{"z":[3,{"x":true,"y":null}],"é":"\n"},"b":1}"#
        );
    }

    #[test]
    fn canonical_json_orders_by_utf16_code_units() {
        // U+FF61 sorts before U+1F600 in UTF-8 byte order (EF… < F0…) but
        // after it in UTF-16 (FF61 > D83D, the emoji's high surrogate).
        let mut s = String::new();
        write_canonical(&json!({"\u{FF61}": 2, "\u{1F600}": 1}), &mut s);
        assert_eq!(s, "{\"\u{1F600}\":1,\"\u{FF61}\":2}");
    }

    #[test]
    fn fingerprint_ignores_order_and_whitespace_but_not_values() {
        let a: Value = serde_json::from_str(r#"{"amount":100,"currency":"BRL"}"#).unwrap();
        let b: Value =
            serde_json::from_str("{\n  \"currency\" : \"BRL\",\n  \"amount\" : 100\n}").unwrap();
        let c: Value = serde_json::from_str(r#"{"amount":101,"currency":"BRL"}"#).unwrap();
        assert_eq!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a), fingerprint(&c));
        assert_ne!(
            fingerprint(&json!({"a": "1"})),
            fingerprint(&json!({"a": 1}))
        );
    }

    /// RFC 8785 Appendix B's number vectors (IEEE 754 bit patterns in,
    /// ECMAScript text out), plus the cases the `canonical` fuzz target
    /// found: f64::MAX was written as 309 digits that serde_json read back
    /// as out of range, and 333333333.33333329 was misread by serde_json's
    /// default (approximate) float parser, so its canonical text differed
    /// from the RFC's. Integers stay exact, past 2^53 too.
    #[test]
    fn canonical_numbers_follow_rfc_8785() {
        let number = |bits: u64| {
            let mut s = String::new();
            write_canonical(&json!(f64::from_bits(bits)), &mut s);
            s
        };
        #[rustfmt::skip]
        let vectors = [
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        // Integral doubles past 2^53 and below 1e21 keep their exact
        // digits (see `write_number`): the three vectors where that differs.
        let exact = [
            (0x4430000000000000, "295147905179352825856"),
            (0x444b1ae4d6e2ef4e, "999999999999999737856"),
            (0x444b1ae4d6e2ef4f, "999999999999999868928"),
        ];
        for (bits, jcs) in vectors {
            let want = exact.iter().find(|e| e.0 == bits).map_or(jcs, |e| e.1);
            assert_eq!(number(bits), want, "{bits:#x}");
        }
        let canonical_of = |text: &str| {
            let mut s = String::new();
            write_canonical(&serde_json::from_str(text).unwrap(), &mut s);
            s
        };
        assert_eq!(canonical_of("333333333.33333329"), "333333333.3333333");
        assert_eq!(
            canonical_of("1.7976931348623157e308"),
            "1.7976931348623157e+308"
        );
        assert_eq!(canonical_of("1e-7"), "1e-7");
        assert_eq!(canonical_of("-1.5e3"), "-1500");
        assert_eq!(canonical_of("9007199254740993"), "9007199254740993");
        assert_eq!(canonical_of("18446744073709551615"), "18446744073709551615");
        assert_eq!(canonical_of("-0"), "0");
    }

    const T: Timeouts = Timeouts {
        inflight: Duration::from_secs(60),
        retention: Duration::from_secs(86_400),
    };

    /// Every row of the contract's decision table, and its edges.
    #[test]
    fn decision_table() {
        use Decision::*;
        use KeyState::*;
        use Mode::*;
        let now = 1_000_000_000;
        let fresh_lock = now - 59_000;
        let stale_lock = now - 61_000;
        let recent_done = Some(now - 1_000);
        let old_done = Some(now - 86_400_001);
        let row = |state, same_fingerprint, locked_at_ms, completed_at_ms| {
            Some(RowView {
                state,
                same_fingerprint,
                locked_at_ms,
                completed_at_ms,
            })
        };
        #[rustfmt::skip]
        let cases = [
            // no row
            (None, Sync, Execute),
            (None, Async, Execute),
            // completed, same fingerprint → replay
            (row(Completed, true, fresh_lock, recent_done), Sync, Replay),
            (row(Completed, true, fresh_lock, recent_done), Async, Replay),
            // any state, other fingerprint → 422
            (row(Completed, false, fresh_lock, recent_done), Sync, Reused),
            (row(InProgress, false, fresh_lock, None), Sync, Reused),
            (row(InProgress, false, stale_lock, None), Async, Reused),
            // in progress, owner alive → 409 (sync) or 202 (async)
            (row(InProgress, true, fresh_lock, None), Sync, InUse),
            (row(InProgress, true, fresh_lock, None), Async, Accepted),
            (row(InProgress, true, now - 60_000, None), Sync, InUse),
            // in progress, silent past the in-flight timeout → takeover
            (row(InProgress, true, stale_lock, None), Sync, TakeOver),
            (row(InProgress, true, stale_lock, None), Async, TakeOver),
            (row(InProgress, true, 0, None), Sync, TakeOver),
            // completed past retention → brand new, whatever the fingerprint
            (row(Completed, true, 0, old_done), Sync, Execute),
            (row(Completed, false, 0, old_done), Sync, Execute),
            (row(Completed, true, 0, Some(now - 86_400_000)), Sync, Replay),
        ];
        for (i, (view, mode, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                decide(view, mode, now, T),
                want,
                "case {i}: {view:?} {mode:?}"
            );
        }
    }
}
