//! The built-in acquirer: it approves everything, captures, voids and
//! refunds what the state of an authorization allows, deduplicates by key, and
//! remembers what it was asked in a small SQLite file of its own next to the
//! ledger's database (`<db>.acquirer.sqlite`).
//!
//! It stands for the world outside, so its memory is not the ledger's: it is
//! another file, written on its own connection, that neither rolls back with
//! a ledger transaction nor waits for the ledger's writer. Like a real
//! acquirer it forgets: rows older than the retention (the server's
//! `--key-retention`) are deleted in small batches every
//! [`SIMULATOR_PRUNE_EVERY_CALLS`] calls, so neither memory nor the file
//! grows with the number of charges ever made. Nothing is kept in process
//! memory per key; SQLite's page cache is capped at
//! [`SIMULATOR_CACHE_MAX_KIB`].
//!
//! Why the key retention is the bound: once a key is past it, the key row is
//! deleted and the same idempotency key is a new request with a new
//! operation id, so the old operation id never calls again. The edge is an
//! operation still in progress when its authorization is forgotten: one
//! left at its `reserved` recovery point (authorized, recovery point not
//! recorded) for longer than the retention — the server was down that long,
//! or every retry failed that long. A key in progress is never deleted
//! (retention counts from completion), but the simulator cannot tell, so
//! that operation's next call is authorized afresh: a second authorization
//! at the acquirer, though still one charge in the ledger. A real
//! acquirer's idempotency window has the same edge.
//!
//! Durability: WAL with `synchronous=NORMAL`. A committed row survives a
//! kill of the process (the crash tests SIGKILL and abort the server), not
//! necessarily a power cut — as with the v1 text journal, which was written
//! but not fsynced.
//!
//! Three tables. `authorizations`: one row per acquirer-side key (UNIQUE),
//! keyed by its authorization id (so that a capture finds it without an
//! index of its own), amount, currency, when it was made, and what
//! became of it: `state` (`authorized`, `captured`, `voided`), `captured`
//! and `refunded`. `operations`: one row per key of a capture, void or
//! refund, so a repeated call does nothing twice. `calls`: a journal of
//! every call (`authorize`, `capture`, `void`, `refund`), including repeated
//! calls that found what their key did before, so tests can count them
//! ([`Simulator::journal`]) and `idem verify` can hold the ledger against
//! it.
//!
//! A v1 text journal (`<db>.acquirer`, lines `op_id auth_id amount
//! currency`) is imported once at start, in one transaction, then renamed
//! to `<db>.acquirer.imported`: a crash before the rename imports it again,
//! and `INSERT OR IGNORE` on the key makes that harmless. Each imported line
//! is journaled as the call that made its authorization.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};
use uuid::Uuid;

use super::{Acquirer, Authorization, AuthorizeOutcome, Unavailable};
use crate::config::{
    BUSY_TIMEOUT, KEY_RETENTION_DEFAULT, SIMULATOR_CACHE_MAX_KIB, SIMULATOR_PAGE_SIZE_BYTES,
    SIMULATOR_PRUNE_BATCH_LEN, SIMULATOR_PRUNE_EVERY_CALLS,
};
use crate::error::{Error, Result};
use crate::time::now_ms;

/// The simulator's schema. `state` and the call kinds beyond `authorize`
/// are for the two-phase charges to come (capture, void, refund).
///
/// Every call commits, so every B-tree is a page written per call: three
/// (the two tables and the key's index), on pages of
/// [`SIMULATOR_PAGE_SIZE_BYTES`]. Nothing else is indexed: ids follow the
/// clock, so pruning walks the oldest ids instead of a time index.
const SCHEMA_SQL: &str = "
CREATE TABLE authorizations (
    id               INTEGER PRIMARY KEY,
    key              TEXT    NOT NULL UNIQUE,
    authorization_id TEXT    NOT NULL,
    amount           INTEGER NOT NULL,
    currency         TEXT    NOT NULL,
    state            TEXT    NOT NULL DEFAULT 'authorized'
                     CHECK (state IN ('authorized', 'captured', 'voided')),
    created_at       INTEGER NOT NULL,
    -- when the authorization is decided: a call answers no sooner
    ready_at         INTEGER NOT NULL
);
CREATE TABLE calls (
    id               INTEGER PRIMARY KEY,
    kind             TEXT    NOT NULL
                     CHECK (kind IN ('authorize', 'capture', 'void', 'refund')),
    key              TEXT    NOT NULL,
    authorization_id TEXT    NOT NULL,
    amount           INTEGER NOT NULL,
    currency         TEXT    NOT NULL,
    created          INTEGER NOT NULL CHECK (created IN (0, 1)),
    timed_out        INTEGER NOT NULL CHECK (timed_out IN (0, 1)),
    at               INTEGER NOT NULL
);
";
/// Version 2 of the simulator's file: what became of each authorization
/// (captured, refunded, voided) and the operations on it, each once per key.
/// The `operations` key index and the authorization-id index are two more
/// pages per call, only for the calls that use them.
const SCHEMA_V2_SQL: &str = "
ALTER TABLE authorizations ADD COLUMN captured INTEGER NOT NULL DEFAULT 0;
ALTER TABLE authorizations ADD COLUMN refunded INTEGER NOT NULL DEFAULT 0;
CREATE INDEX authorizations_by_id ON authorizations (authorization_id);
CREATE TABLE operations (
    id               INTEGER PRIMARY KEY,
    key              TEXT    NOT NULL UNIQUE,
    kind             TEXT    NOT NULL CHECK (kind IN ('capture', 'void', 'refund')),
    authorization_id TEXT    NOT NULL,
    amount           INTEGER NOT NULL,
    created_at       INTEGER NOT NULL
);
";
/// Version 3: `authorizations` is keyed by its authorization id (WITHOUT
/// ROWID), so a capture, void or refund finds its authorization through the
/// table itself. Version 2's `authorizations_by_id` index was one more page
/// written by every authorize call (each call commits on its own) for the
/// sake of the fewer calls that look an authorization up by id. The ids
/// follow the clock (UUIDv7), so oldest-first is still id order for pruning.
const SCHEMA_V3_SQL: &str = "
CREATE TABLE authorizations_v3 (
    authorization_id TEXT    NOT NULL PRIMARY KEY,
    key              TEXT    NOT NULL UNIQUE,
    amount           INTEGER NOT NULL,
    currency         TEXT    NOT NULL,
    state            TEXT    NOT NULL DEFAULT 'authorized'
                     CHECK (state IN ('authorized', 'captured', 'voided')),
    created_at       INTEGER NOT NULL,
    -- when the authorization is decided: a call answers no sooner
    ready_at         INTEGER NOT NULL,
    captured         INTEGER NOT NULL DEFAULT 0,
    refunded         INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
INSERT INTO authorizations_v3 (authorization_id, key, amount, currency, state, created_at,
    ready_at, captured, refunded)
SELECT authorization_id, key, amount, currency, state, created_at, ready_at, captured, refunded
FROM authorizations ORDER BY id;
DROP TABLE authorizations;
ALTER TABLE authorizations_v3 RENAME TO authorizations;
";
/// The simulator file's `PRAGMA user_version`.
const SCHEMA_VERSION: i64 = 3;

/// Wall-clock milliseconds since the Unix epoch. The simulator reads the
/// time through one, so a test can age its rows without waiting.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// What a call asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// [`Acquirer::authorize`].
    Authorize,
    /// [`Acquirer::capture`].
    Capture,
    /// [`Acquirer::void`].
    Void,
    /// [`Acquirer::refund`].
    Refund,
}

impl CallKind {
    fn as_str(self) -> &'static str {
        match self {
            CallKind::Authorize => "authorize",
            CallKind::Capture => "capture",
            CallKind::Void => "void",
            CallKind::Refund => "refund",
        }
    }

    fn parse(s: &str) -> Option<CallKind> {
        match s {
            "authorize" => Some(CallKind::Authorize),
            "capture" => Some(CallKind::Capture),
            "void" => Some(CallKind::Void),
            "refund" => Some(CallKind::Refund),
            _ => None,
        }
    }
}

/// One call the simulator received, as its journal keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// What was asked.
    pub kind: CallKind,
    /// The acquirer-side idempotency key (the operation's `op_id`).
    pub key: String,
    /// The authorization the call concerns (created by it or found).
    pub authorization: String,
    /// The amount the call asked for, in minor units.
    pub amount: i64,
    /// The currency the call asked for.
    pub currency: String,
    /// This call made a new authorization, capture, void or refund (false:
    /// it found the one its key made before). An authorization imported
    /// from a v1 text journal is journaled as the call that made it, at the
    /// time of the import.
    pub created: bool,
    /// The caller's deadline came before the authorization was ready: it
    /// was answered `Unavailable`, and the authorization stays for a retry.
    pub timed_out: bool,
    /// When the call arrived (the simulator's clock, ms since the epoch).
    pub at_ms: i64,
}

/// An authorization the simulator remembers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAuthorization {
    /// The acquirer-side idempotency key.
    pub key: String,
    /// The authorization id given for it (`auth_…`).
    pub id: String,
    /// The amount authorized, in minor units.
    pub amount: i64,
    /// The currency authorized.
    pub currency: String,
    /// When it was made (for an imported v1 line: when it was imported).
    pub created_at_ms: i64,
    /// `authorized` (a hold), `captured` or `voided`.
    pub state: String,
    /// How much was captured (a sale: all of it, at once).
    pub captured: i64,
    /// How much of the capture was refunded.
    pub refunded: i64,
}

/// The built-in acquirer (see the module documentation).
pub struct Simulator {
    latency: Duration,
    retention: Duration,
    clock: Clock,
    store: Mutex<Store>,
}

/// The simulator's connection and when it last pruned.
struct Store {
    conn: Connection,
    calls_since_prune: u32,
}

/// What one call found or made.
struct Answer {
    id: String,
    ready_at_ms: i64,
}

impl Simulator {
    /// A simulator whose memory is an in-memory database, forgotten when it
    /// is dropped, with the default retention: for tests that wrap it.
    pub fn new(latency: Duration) -> Simulator {
        let conn = Connection::open_in_memory().expect("an in-memory SQLite database");
        Simulator::with_connection(conn, latency, KEY_RETENTION_DEFAULT, Arc::new(now_ms))
            .expect("the simulator schema applies to an empty database")
    }

    /// The simulator of the database `db`: opens (or creates) its file,
    /// `<db>.acquirer.sqlite`, and imports a v1 text journal if one is
    /// there. Rows older than `retention` are forgotten.
    pub fn open(db: &Path, latency: Duration, retention: Duration) -> Result<Simulator> {
        Simulator::open_with_clock(db, latency, retention, Arc::new(now_ms))
    }

    /// [`Simulator::open`] with the time read from `clock`.
    pub fn open_with_clock(
        db: &Path,
        latency: Duration,
        retention: Duration,
        clock: Clock,
    ) -> Result<Simulator> {
        let simulator =
            Simulator::open_file(&Simulator::store_path(db), latency, retention, clock)?;
        simulator.import_v1(&Simulator::v1_journal_path(db))?;
        Ok(simulator)
    }

    /// The simulator whose memory is the file `path` (created if needed),
    /// rather than the one beside a database: what several servers sharing
    /// one PostgreSQL database name, so that they share one acquirer.
    pub fn open_file(
        path: &Path,
        latency: Duration,
        retention: Duration,
        clock: Clock,
    ) -> Result<Simulator> {
        let conn = Connection::open(path).map_err(|e| {
            Error::Other(format!(
                "cannot open the acquirer simulator's file {}: {e}",
                path.display()
            ))
        })?;
        // Before anything is written: the page size of a new file.
        conn.pragma_update(None, "page_size", SIMULATOR_PAGE_SIZE_BYTES)?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::Other(format!(
                "{} cannot use WAL (journal_mode is {mode})",
                path.display()
            )));
        }
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        Simulator::with_connection(conn, latency, retention, clock)
    }

    fn with_connection(
        mut conn: Connection,
        latency: Duration,
        retention: Duration,
        clock: Clock,
    ) -> Result<Simulator> {
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.pragma_update(None, "cache_size", -SIMULATOR_CACHE_MAX_KIB)?;
        migrate(&mut conn)?;
        Ok(Simulator {
            latency,
            retention,
            clock,
            store: Mutex::new(Store {
                conn,
                calls_since_prune: 0,
            }),
        })
    }

    /// Where the simulator of database `db` keeps its memory:
    /// `<db>.acquirer.sqlite` (with its `-wal` and `-shm`).
    pub fn store_path(db: &Path) -> PathBuf {
        with_suffix(db, ".acquirer.sqlite")
    }

    /// Where the v1 simulator kept its text journal, `<db>.acquirer`; once
    /// imported it is renamed to `<db>.acquirer.imported`.
    pub fn v1_journal_path(db: &Path) -> PathBuf {
        with_suffix(db, ".acquirer")
    }

    /// Every call the simulator of database `db` has journaled and not yet
    /// forgotten, oldest first; empty if it has none. Safe to call while
    /// the server runs.
    pub fn journal(db: &Path) -> Result<Vec<Call>> {
        Simulator::journal_of_file(&Simulator::store_path(db))
    }

    /// [`Simulator::journal`] of the simulator whose file is `store` (see
    /// [`Simulator::open_file`]).
    pub fn journal_of_file(store: &Path) -> Result<Vec<Call>> {
        let Some(conn) = open_for_reading(store)? else {
            return Ok(Vec::new());
        };
        let mut stmt = conn.prepare(
            "SELECT kind, key, authorization_id, amount, currency, created, timed_out, at \
             FROM calls ORDER BY id",
        )?;
        let rows = stmt.query_map([], |r| {
            let kind: String = r.get(0)?;
            Ok(Call {
                kind: CallKind::parse(&kind).ok_or_else(|| {
                    rusqlite::Error::InvalidColumnType(
                        0,
                        format!("kind {kind}"),
                        rusqlite::types::Type::Text,
                    )
                })?,
                key: r.get(1)?,
                authorization: r.get(2)?,
                amount: r.get(3)?,
                currency: r.get(4)?,
                created: r.get(5)?,
                timed_out: r.get(6)?,
                at_ms: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Whether the simulator whose file is `store` has heard of the operation
    /// `op_id`: a call journaled, or an authorization or an operation kept,
    /// under its key or a key derived from it (`<op_id>:void`). `false` when
    /// there is no simulator file. Safe to call while the server runs.
    pub fn knows_operation(store: &Path, op_id: &str) -> Result<bool> {
        let Some(conn) = open_for_reading(store)? else {
            return Ok(false);
        };
        // Exact comparisons (LIKE would read `_` in an id as a wildcard).
        let derived = format!("{op_id}:");
        Ok(conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM calls WHERE key = ?1 \
               OR substr(key, 1, length(?2)) = ?2) \
             OR EXISTS (SELECT 1 FROM authorizations WHERE key = ?1 \
               OR substr(key, 1, length(?2)) = ?2) \
             OR EXISTS (SELECT 1 FROM operations WHERE key = ?1 \
               OR substr(key, 1, length(?2)) = ?2)",
            rusqlite::params![op_id, derived],
            |r| r.get(0),
        )?)
    }

    /// Every authorization the simulator of database `db` remembers, oldest
    /// first; empty if it has none.
    pub fn authorizations(db: &Path) -> Result<Vec<StoredAuthorization>> {
        Simulator::authorizations_of_file(&Simulator::store_path(db))
    }

    /// [`Simulator::authorizations`] of the simulator whose file is `store`.
    pub fn authorizations_of_file(store: &Path) -> Result<Vec<StoredAuthorization>> {
        let Some(conn) = open_for_reading(store)? else {
            return Ok(Vec::new());
        };
        let mut stmt = conn.prepare(
            "SELECT key, authorization_id, amount, currency, created_at, state, captured, \
             refunded FROM authorizations ORDER BY created_at, authorization_id",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(StoredAuthorization {
                key: r.get(0)?,
                id: r.get(1)?,
                amount: r.get(2)?,
                currency: r.get(3)?,
                created_at_ms: r.get(4)?,
                state: r.get(5)?,
                captured: r.get(6)?,
                refunded: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Forgets one batch (at most [`SIMULATOR_PRUNE_BATCH_LEN`] rows of each
    /// table) of what is older than the retention; returns the rows deleted.
    /// The simulator also does this by itself every
    /// [`SIMULATOR_PRUNE_EVERY_CALLS`] calls.
    pub fn prune(&self) -> Result<usize> {
        let cutoff = (self.clock)().saturating_sub(self.retention.as_millis() as i64);
        self.store().prune(cutoff)
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        // A panic while holding the lock leaves no half-done transaction
        // behind (it rolls back on drop), so the store is still usable.
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Journals a call and returns the authorization for `key`, made now if
    /// there is none; every `SIMULATOR_PRUNE_EVERY_CALLS` calls, prunes.
    fn call(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        now: i64,
        deadline_ms: i64,
    ) -> Result<Answer> {
        let mut store = self.store();
        let latency_ms = self.latency.as_millis() as i64;
        let answer = store.record(key, amount, currency, capture, now, latency_ms, deadline_ms)?;
        self.after_call(&mut store, now);
        Ok(answer)
    }

    /// Counts a call, and every `SIMULATOR_PRUNE_EVERY_CALLS` calls prunes.
    fn after_call(&self, store: &mut Store, now: i64) {
        store.calls_since_prune += 1;
        if store.calls_since_prune >= SIMULATOR_PRUNE_EVERY_CALLS {
            store.calls_since_prune = 0;
            let cutoff = now.saturating_sub(self.retention.as_millis() as i64);
            if let Err(e) = store.prune(cutoff) {
                log::warn!("acquirer simulator: cannot prune: {e}");
            }
        }
    }

    /// A capture, void or refund of `authorization` under `key`: made once
    /// (a repeated key finds what it did), then answered after the latency,
    /// or `Unavailable` at the deadline if that comes first — it is made
    /// all the same, as a real acquirer goes on after its client gave up.
    fn operate(
        &self,
        kind: CallKind,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: Instant,
    ) -> std::result::Result<(), Unavailable> {
        let now = (self.clock)();
        {
            let mut store = self.store();
            store
                .operate(kind, key, authorization, amount, now)
                .map_err(|e| Unavailable(format!("acquirer simulator: {e}")))?;
            self.after_call(&mut store, now);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if self.latency > left {
            std::thread::sleep(left);
            return Err(Unavailable(format!(
                "acquirer timed out: no answer for {key} within {left:?}"
            )));
        }
        std::thread::sleep(self.latency);
        Ok(())
    }

    /// Imports a v1 text journal, then renames it (see the module docs).
    fn import_v1(&self, journal: &Path) -> Result<()> {
        let file = match File::open(journal) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let now = (self.clock)();
        let mut store = self.store();
        let tx = store
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let (mut imported, mut skipped) = (0, 0);
        for line in BufReader::new(file).split(b'\n') {
            let line = line?;
            let Some((key, id, amount, currency)) = parse_v1_line(&line) else {
                skipped += 1;
                continue;
            };
            // Kept a whole retention from now: the v1 file has no times.
            let new = tx
                // v1 charged at once: its authorizations were sales.
                .prepare_cached(
                    "INSERT OR IGNORE INTO authorizations (key, authorization_id, amount, \
                     currency, created_at, ready_at, state, captured) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?5, 'captured', ?3)",
                )?
                .execute(params![key, id, amount, currency, now])?;
            // The v1 line is the record of the call that made it; journaled
            // once, even if a crash before the rename imports the file again.
            if new == 1 {
                let entry = JournalEntry {
                    kind: CallKind::Authorize,
                    key,
                    authorization: id,
                    amount,
                    currency,
                    created: true,
                    timed_out: false,
                    at_ms: now,
                };
                journal_call(&tx, &entry)?;
                imported += 1;
            }
        }
        tx.commit()?;
        std::fs::rename(journal, with_suffix(journal, ".imported"))?;
        log::info!(
            "acquirer simulator: imported {imported} authorizations from {}",
            journal.display()
        );
        if skipped > 0 {
            log::warn!(
                "acquirer simulator: skipped {skipped} malformed lines of {}",
                journal.display()
            );
        }
        Ok(())
    }
}

impl Store {
    /// One transaction: find or make the authorization for `key` (captured
    /// at once for a sale), and journal the call.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        now: i64,
        latency_ms: i64,
        deadline_ms: i64,
    ) -> Result<Answer> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let found: Option<(String, i64)> = tx
            .prepare_cached("SELECT authorization_id, ready_at FROM authorizations WHERE key = ?1")?
            .query_row([key], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        let created = found.is_none();
        let answer = match found {
            Some((id, ready_at_ms)) => Answer { id, ready_at_ms },
            None => {
                let answer = Answer {
                    id: format!("auth_{}", Uuid::now_v7().simple()),
                    ready_at_ms: now.saturating_add(latency_ms),
                };
                let (state, captured) = if capture {
                    ("captured", amount)
                } else {
                    ("authorized", 0)
                };
                tx.prepare_cached(
                    "INSERT INTO authorizations (key, authorization_id, amount, currency, \
                     created_at, ready_at, state, captured) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                )?
                .execute(params![
                    key,
                    answer.id,
                    amount,
                    currency,
                    now,
                    answer.ready_at_ms,
                    state,
                    captured
                ])?;
                answer
            }
        };
        let entry = JournalEntry {
            kind: CallKind::Authorize,
            key,
            authorization: &answer.id,
            amount,
            currency,
            created,
            timed_out: answer.ready_at_ms > deadline_ms,
            at_ms: now,
        };
        journal_call(&tx, &entry)?;
        tx.commit()?;
        Ok(answer)
    }

    /// One transaction: make the capture, void or refund of `key` (or find
    /// the one it made), moving the authorization's state, and journal the
    /// call. An operation the authorization's state does not allow — a
    /// capture of a voided authorization, a second capture, a refund past
    /// what was captured — is refused: idem never asks for one.
    fn operate(
        &mut self,
        kind: CallKind,
        key: &str,
        authorization: &str,
        amount: i64,
        now: i64,
    ) -> Result<()> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let auth: Option<(String, i64, String, i64, i64)> = tx
            .prepare_cached(
                "SELECT state, amount, currency, captured, refunded FROM authorizations \
                 WHERE authorization_id = ?1",
            )?
            .query_row([authorization], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .optional()?;
        let Some((state, authorized, currency, captured, refunded)) = auth else {
            return Err(Error::Other(format!(
                "no authorization {authorization} (never made, or forgotten)"
            )));
        };
        let done: Option<(String, String, i64)> = tx
            .prepare_cached("SELECT kind, authorization_id, amount FROM operations WHERE key = ?1")?
            .query_row([key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .optional()?;
        let created = match done {
            Some((k, a, n)) if k == kind.as_str() && a == authorization && n == amount => false,
            Some((k, a, _)) => {
                return Err(Error::Other(format!(
                    "key {key} was used for a {k} of {a}, not this {} of {authorization}",
                    kind.as_str()
                )))
            }
            None => {
                let refused = |why: &str| {
                    Err(Error::Other(format!(
                        "cannot {} authorization {authorization}: {why}",
                        kind.as_str()
                    )))
                };
                let update = match kind {
                    CallKind::Capture if state != "authorized" => return refused(&state),
                    CallKind::Capture if amount > authorized => {
                        return refused("more than was authorized")
                    }
                    CallKind::Capture => {
                        "UPDATE authorizations SET state = 'captured', \
                         captured = ?2 WHERE authorization_id = ?1"
                    }
                    CallKind::Void if state == "voided" => return refused("already voided"),
                    CallKind::Void if refunded > 0 => return refused("refunds were made"),
                    // A void's amount is 0: a sale it reverses keeps nothing.
                    CallKind::Void => {
                        "UPDATE authorizations SET state = 'voided', \
                         captured = ?2 WHERE authorization_id = ?1"
                    }
                    CallKind::Refund if state != "captured" => return refused(&state),
                    CallKind::Refund if refunded.saturating_add(amount) > captured => {
                        return refused("more than was captured")
                    }
                    CallKind::Refund => {
                        "UPDATE authorizations SET refunded = refunded + ?2 \
                         WHERE authorization_id = ?1"
                    }
                    CallKind::Authorize => unreachable!("authorize is recorded by record()"),
                };
                tx.prepare_cached(update)?
                    .execute(params![authorization, amount])?;
                tx.prepare_cached(
                    "INSERT INTO operations (key, kind, authorization_id, amount, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?
                .execute(params![
                    key,
                    kind.as_str(),
                    authorization,
                    amount,
                    now
                ])?;
                true
            }
        };
        let entry = JournalEntry {
            kind,
            key,
            authorization,
            amount,
            currency: &currency,
            created,
            timed_out: false,
            at_ms: now,
        };
        journal_call(&tx, &entry)?;
        tx.commit()?;
        Ok(())
    }

    /// Deletes up to a batch of rows of each table from before `cutoff`.
    fn prune(&mut self, cutoff: i64) -> Result<usize> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let batch = SIMULATOR_PRUNE_BATCH_LEN as i64;
        // Among the oldest ids, those past the cutoff: a bounded walk, no
        // time index (authorization ids are UUIDv7: they follow the clock).
        // A row stamped out of order (the clock stepped back) waits until it
        // is old itself, and at most a batch of rows past the cutoff waits
        // behind it.
        let authorizations = tx
            .prepare_cached(
                "DELETE FROM authorizations WHERE authorization_id IN \
                 (SELECT authorization_id FROM authorizations ORDER BY authorization_id \
                 LIMIT ?2) AND created_at < ?1",
            )?
            .execute(params![cutoff, batch])?;
        let calls = tx
            .prepare_cached(
                "DELETE FROM calls WHERE id IN \
                 (SELECT id FROM calls ORDER BY id LIMIT ?2) AND at < ?1",
            )?
            .execute(params![cutoff, batch])?;
        let operations = tx
            .prepare_cached(
                "DELETE FROM operations WHERE id IN \
                 (SELECT id FROM operations ORDER BY id LIMIT ?2) AND created_at < ?1",
            )?
            .execute(params![cutoff, batch])?;
        tx.commit()?;
        Ok(authorizations + calls + operations)
    }
}

impl Acquirer for Simulator {
    /// Approves after the latency, deduplicating by key, within `deadline`;
    /// it never declines.
    /// The first call for a key makes the authorization, decided `latency`
    /// after the call arrived, whether or not that caller is still waiting
    /// (like a real acquirer, which goes on after its client timed out); a
    /// call answers as soon as its key's authorization is decided, or
    /// `Unavailable` at its deadline if that comes first.
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        deadline: Instant,
    ) -> Result<AuthorizeOutcome, Unavailable> {
        let now = (self.clock)();
        let left = deadline.saturating_duration_since(Instant::now());
        let deadline_ms = now.saturating_add(left.as_millis() as i64);
        let answer = self
            .call(key, amount, currency, capture, now, deadline_ms)
            .map_err(|e| Unavailable(format!("acquirer simulator: {e}")))?;
        if answer.ready_at_ms > deadline_ms {
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
            return Err(Unavailable(format!(
                "acquirer timed out: no answer for {key} within {left:?}"
            )));
        }
        let wait_ms = answer.ready_at_ms.saturating_sub(now);
        if wait_ms > 0 {
            std::thread::sleep(Duration::from_millis(wait_ms as u64));
        }
        Ok(AuthorizeOutcome::Approved(Authorization { id: answer.id }))
    }

    fn capture(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: Instant,
    ) -> Result<(), Unavailable> {
        self.operate(CallKind::Capture, key, authorization, amount, deadline)
    }

    fn void(&self, key: &str, authorization: &str, deadline: Instant) -> Result<(), Unavailable> {
        self.operate(CallKind::Void, key, authorization, 0, deadline)
    }

    fn refund(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: Instant,
    ) -> Result<(), Unavailable> {
        self.operate(CallKind::Refund, key, authorization, amount, deadline)
    }
}

/// A journal row about to be written (see [`Call`]).
struct JournalEntry<'a> {
    kind: CallKind,
    key: &'a str,
    authorization: &'a str,
    amount: i64,
    currency: &'a str,
    created: bool,
    timed_out: bool,
    at_ms: i64,
}

/// Appends a call to the journal.
fn journal_call(conn: &Connection, e: &JournalEntry<'_>) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO calls \
         (kind, key, authorization_id, amount, currency, created, timed_out, at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?
    .execute(params![
        e.kind.as_str(),
        e.key,
        e.authorization,
        e.amount,
        e.currency,
        e.created,
        e.timed_out,
        e.at_ms
    ])?;
    Ok(())
}

/// Creates the schema on a new file; refuses one from a newer idem.
fn migrate(conn: &mut Connection) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let version: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    match version {
        0..=2 => {
            if version == 0 {
                tx.execute_batch(SCHEMA_SQL)?;
            }
            if version <= 1 {
                tx.execute_batch(SCHEMA_V2_SQL)?;
            }
            tx.execute_batch(SCHEMA_V3_SQL)?;
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        }
        SCHEMA_VERSION => {}
        newer => {
            return Err(Error::Other(format!(
                "the acquirer simulator's file has schema version {newer}, newer than this \
                 idem supports ({SCHEMA_VERSION}); upgrade idem"
            )))
        }
    }
    tx.commit()?;
    Ok(())
}

/// A connection to read the simulator file of `db`, or `None` if it has
/// none. Read-write (WAL readers need the shared-memory file), never
/// creating anything.
fn open_for_reading(path: &Path) -> Result<Option<Connection>> {
    if !path.exists() {
        return Ok(None);
    }
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    Ok(Some(conn))
}

/// A v1 journal line's fields: key, authorization, amount, currency.
type V1Line<'a> = (&'a str, &'a str, i64, &'a str);

/// `key authorization amount currency`, the v1 journal's line.
fn parse_v1_line(line: &[u8]) -> Option<V1Line<'_>> {
    let line = std::str::from_utf8(line).ok()?;
    let mut fields = line.split(' ');
    let (key, id, amount, currency) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let well_formed = fields.next().is_none()
        && !key.is_empty()
        && id.starts_with("auth_")
        && currency.len() == 3;
    well_formed.then_some(())?;
    Some((key, id, amount.parse().ok()?, currency))
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_lines_parse_only_when_whole() {
        let cases: &[(&str, Option<V1Line<'_>>)] = &[
            ("op_1 auth_9 100 BRL", Some(("op_1", "auth_9", 100, "BRL"))),
            ("op_1 auth_9 100", None),
            ("op_1 auth_9 100 BR", None),
            ("op_1 auth_9 1x0 BRL", None),
            ("op_1 xyz 100 BRL", None),
            ("op_1 auth_9 100 BRL extra", None),
            ("", None),
        ];
        for (line, want) in cases {
            assert_eq!(parse_v1_line(line.as_bytes()), *want, "{line:?}");
        }
    }

    /// A version 2 file keeps its authorizations (oldest first) and their
    /// state through the step to version 3, and a capture then finds its
    /// authorization by id.
    #[test]
    fn a_v2_file_is_migrated_and_keeps_its_authorizations() {
        let dir = std::env::temp_dir().join(format!("idem-sim-v2-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let db = dir.join("idem.db");
        {
            let conn = Connection::open(Simulator::store_path(&db)).unwrap();
            conn.execute_batch(SCHEMA_SQL).unwrap();
            conn.execute_batch(SCHEMA_V2_SQL).unwrap();
            conn.execute_batch(
                "INSERT INTO authorizations (key, authorization_id, amount, currency, state, \
                 created_at, ready_at, captured) VALUES \
                 ('op_b', 'auth_b', 70, 'BRL', 'authorized', 2, 2, 0), \
                 ('op_a', 'auth_a', 50, 'BRL', 'captured', 1, 1, 50);
                 PRAGMA user_version = 2;",
            )
            .unwrap();
        }
        let sim = Simulator::open(&db, Duration::ZERO, Duration::from_secs(3600)).unwrap();
        let kept: Vec<(String, String, String)> = Simulator::authorizations(&db)
            .unwrap()
            .into_iter()
            .map(|a| (a.key, a.id, a.state))
            .collect();
        let want = |k: &str, a: &str, s: &str| (k.to_string(), a.to_string(), s.to_string());
        assert_eq!(
            kept,
            [
                want("op_a", "auth_a", "captured"),
                want("op_b", "auth_b", "authorized")
            ]
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        sim.capture("cap_b", "auth_b", 70, deadline).unwrap();
        let b = Simulator::authorizations(&db).unwrap().remove(1);
        assert_eq!((b.state.as_str(), b.captured), ("captured", 70));
        let version: i64 = Connection::open(Simulator::store_path(&db))
            .unwrap()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        drop(sim);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
