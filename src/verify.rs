//! `idem verify`: SQLite's own checks of the file and the five ledger
//! invariants of the contract, each as a query that lists what breaks it.
//! Used by the CLI and by every test that crashes the server.
//!
//! The two kinds are kept apart. The ledger invariants ([`check_invariants`])
//! are written against [`Db`] and run the same on either engine. The checks
//! of the SQLite file itself (`PRAGMA integrity_check`, `foreign_key_check`,
//! `user_version`, a file too damaged to read) are `check_sqlite_file`'s,
//! SQLite only: the SQLite entry points ([`verify`], [`verify_unless`],
//! `verify_with_acquirer`) run them first, in the same read transaction. A
//! PostgreSQL path skips them: it checks its schema version in its own
//! `idem_schema` table and calls [`check_invariants`] inside its
//! transaction.
//!
//! Sums of money are never left to the database's `sum()`: SQLite's fails
//! with "integer overflow" as soon as a running total leaves `i64`, which a
//! sound ledger reaches easily (two balances near `i64::MAX` and two near
//! its negative sum to 0, but not in every order), and PostgreSQL's returns
//! a NUMERIC that [`Db`] does not read. Those checks stream the amounts and
//! add them up as `i128`, which no table of `i64` can overflow (it would
//! need 2^64 rows).

use std::collections::{BTreeMap, HashMap};

use rusqlite::{Connection, ErrorCode};

use crate::error::{Error, Result};
use crate::store::{params, Db, Dialect, Row, Value};

/// What failed; empty when the database is sound.
#[derive(Debug, Default)]
pub struct Report {
    /// One line per violation, prefixed with the check that found it.
    pub failures: Vec<String>,
    /// The schema version, when it is older than this build's: the file's
    /// integrity and foreign keys were checked, its ledger invariants were
    /// not (they are written for the current schema). `idem backup` of a
    /// database not yet migrated reports this.
    pub invariants_skipped_at: Option<i64>,
    /// Whether the file's own integrity and foreign keys were checked
    /// (SQLite); PostgreSQL keeps its own, and only the ledger is checked.
    pub file_checked: bool,
}

impl Report {
    /// True when every check passed.
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.ok() {
            if let Some(version) = self.invariants_skipped_at {
                return writeln!(
                    f,
                    "ok: integrity and foreign keys hold; the ledger invariants were not \
                     checked: schema version {version} is older than this idem's {} \
                     (idem migrate brings it up to date)",
                    crate::store::SCHEMA_VERSION
                );
            }
            if !self.file_checked {
                return f.write_str("ok: all ledger invariants hold\n");
            }
            return f.write_str("ok: integrity, foreign keys and all ledger invariants hold\n");
        }
        writeln!(f, "FAILED: {} problem(s)", self.failures.len())?;
        for failure in &self.failures {
            writeln!(f, "- {failure}")?;
        }
        Ok(())
    }
}

/// How a check finds its violations, each rendered as one line of text.
enum Check {
    /// A query whose every row is one violation, rendered by the query.
    Query(&'static str),
    /// A query whose every row is one violation, written per engine (JSON).
    Dialects {
        sqlite: &'static str,
        postgres: &'static str,
    },
    /// Code that adds amounts up exactly (`i128`), where SQLite's `sum()`
    /// could overflow (and PostgreSQL's returns NUMERIC).
    Sums(fn(&dyn Db) -> Result<Vec<String>>),
}

/// Invariant checks, in the order of the contract: a name and how to find
/// what breaks it.
const CHECKS: &[(&str, Check)] = &[
    (
        "1. balances sum to zero per consumer and currency",
        Check::Sums(balances_sum_to_zero),
    ),
    (
        "2. each balance equals the sum of its entries",
        Check::Sums(balances_equal_their_entries),
    ),
    (
        "3/7. each captured charge has one debit of its source and one credit of its \
         destination, of amount_captured",
        // Its other entries are its refunds' and its disputes' (checked
        // below); an entry names at most one of them.
        Check::Query(
            "SELECT 'charge ' || c.public_id || ' has wrong entries' FROM charges c \
             WHERE c.status = 'succeeded' AND (\
             (SELECT count(*) FROM entries e WHERE e.charge_id = c.id AND e.refund_id IS NULL \
               AND e.dispute_id IS NULL) <> 2 \
             OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.charge_id = c.id \
               AND e.refund_id IS NULL AND e.dispute_id IS NULL AND e.account_id = c.source_id \
               AND e.amount = -c.amount_captured) \
             OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.charge_id = c.id \
               AND e.refund_id IS NULL AND e.dispute_id IS NULL \
               AND e.account_id = c.destination_id AND e.amount = c.amount_captured)) \
             UNION ALL SELECT 'entry ' || public_id || ' names both a refund and a dispute' \
             FROM entries WHERE refund_id IS NOT NULL AND dispute_id IS NOT NULL",
        ),
    ),
    (
        "7. a requires_capture or canceled charge has no entries and no refunds",
        Check::Query(
            "SELECT 'charge ' || c.public_id || ' is ' || c.status || ' but has ' || \
             ((SELECT count(*) FROM entries e WHERE e.charge_id = c.id) + \
              (SELECT count(*) FROM refunds r WHERE r.charge_id = c.id)) || \
             ' entries or refunds' FROM charges c WHERE c.status <> 'succeeded' \
             AND (EXISTS (SELECT 1 FROM entries e WHERE e.charge_id = c.id) \
               OR EXISTS (SELECT 1 FROM refunds r WHERE r.charge_id = c.id))",
        ),
    ),
    (
        "7. amount_refunded + amount_disputed <= amount_captured <= amount, \
         and only a captured charge has amount_captured",
        Check::Query(
            "SELECT 'charge ' || public_id || ' (' || status || ') amount ' || amount || \
             ', captured ' || amount_captured || ', refunded ' || amount_refunded || \
             ', disputed ' || amount_disputed FROM charges WHERE \
             amount_refunded < 0 OR amount_disputed < 0 OR amount_captured < 0 \
             OR amount_refunded + amount_disputed > amount_captured \
             OR amount_captured > amount \
             OR (status = 'succeeded') <> (amount_captured > 0)",
        ),
    ),
    (
        "3. each refund has exactly its reverse entries",
        Check::Query(
            "SELECT 'refund ' || r.public_id || ' has wrong entries' FROM refunds r \
             JOIN charges c ON c.id = r.charge_id WHERE \
             (SELECT count(*) FROM entries e WHERE e.charge_id = r.charge_id \
               AND e.refund_id = r.id) <> 2 \
             OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.refund_id = r.id \
               AND e.charge_id = c.id AND e.account_id = c.destination_id \
               AND e.amount = -r.amount) \
             OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.refund_id = r.id \
               AND e.charge_id = c.id AND e.account_id = c.source_id AND e.amount = r.amount)",
        ),
    ),
    (
        "3. each refund's entries belong to its charge",
        Check::Query(
            "SELECT 'entry ' || e.public_id || ' of refund ' || r.public_id || \
             ' names another charge' FROM entries e JOIN refunds r ON r.id = e.refund_id \
             WHERE e.charge_id IS DISTINCT FROM r.charge_id",
        ),
    ),
    (
        "3. amount_refunded is the sum of refunds and at most the amount",
        Check::Sums(refunds_add_up),
    ),
    (
        "3/7. each dispute has exactly its two entries: its charge's destination debited, \
         its source credited",
        Check::Query(
            "SELECT 'dispute ' || d.public_id || ' has wrong entries' FROM disputes d \
             JOIN charges c ON c.id = d.charge_id WHERE \
             (SELECT count(*) FROM entries e WHERE e.dispute_id = d.id) <> 2 \
             OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.dispute_id = d.id \
               AND e.charge_id = c.id AND e.account_id = c.destination_id \
               AND e.amount = -d.amount) \
             OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.dispute_id = d.id \
               AND e.charge_id = c.id AND e.account_id = c.source_id AND e.amount = d.amount) \
             UNION ALL SELECT 'dispute ' || d.public_id || ' is on a charge that is ' || c.status \
             FROM disputes d JOIN charges c ON c.id = d.charge_id WHERE c.status <> 'succeeded'",
        ),
    ),
    (
        "3/7. amount_disputed is the sum of the charge's disputes",
        Check::Sums(disputes_add_up),
    ),
    (
        "7. a notification is applied if and only if it produced a dispute, of its \
         authorization's charge",
        Check::Query(
            "SELECT 'notification ' || n.public_id || ' is ' || n.status || ' with ' || \
             (SELECT count(*) FROM disputes d WHERE d.notification_id = n.id) || ' disputes' \
             FROM notifications n WHERE (n.status = 'applied') <> \
             EXISTS (SELECT 1 FROM disputes d WHERE d.notification_id = n.id) \
             UNION ALL SELECT 'dispute ' || d.public_id || ' is not of its notification''s \
             authorization' FROM disputes d JOIN notifications n ON n.id = d.notification_id \
             JOIN charges c ON c.id = d.charge_id WHERE n.type <> 'chargeback.created' \
             OR n.authorization IS DISTINCT FROM c.authorization_id \
             OR n.consumer_id <> c.consumer_id OR d.consumer_id <> c.consumer_id",
        ),
    ),
    (
        "4. every completed key has a stored response",
        Check::Query(
            "SELECT 'key ' || op_id || ' is completed without a response' \
             FROM idempotency_keys WHERE state = 'completed' \
             AND (response_status IS NULL OR response_body IS NULL)",
        ),
    ),
    (
        "4. a stored answer names what its key produced",
        // A 201 names the charge or refund this very reservation produced
        // (same op_id); a 200 charge (a reference replay) names the charge
        // that holds the reference of the key's request.
        // SQLite's json_extract has no spelling PostgreSQL shares: there
        // the stored body (BYTEA) and request (TEXT) are cast to jsonb.
        Check::Dialects {
            sqlite: ANSWERS_SQLITE,
            postgres: ANSWERS_POSTGRES,
        },
    ),
    (
        "4. each charge and refund records the key that produced it",
        Check::Query(
            "SELECT 'charge ' || public_id || ' records no key' FROM charges \
             WHERE op_id = '' OR idempotency_key = '' UNION ALL \
             SELECT 'refund ' || public_id || ' records no key' FROM refunds \
             WHERE op_id = '' OR idempotency_key = ''",
        ),
    ),
    (
        "4. no reservation or reference produced two charges",
        Check::Query(
            "SELECT 'operation ' || op_id || ' produced ' || count(*) || ' charges' \
             FROM charges GROUP BY op_id HAVING count(*) > 1 UNION ALL \
             SELECT 'operation ' || op_id || ' produced ' || count(*) || ' refunds' \
             FROM refunds GROUP BY op_id HAVING count(*) > 1 UNION ALL \
             SELECT 'reference ' || reference || ' produced ' || count(*) || ' charges' \
             FROM charges WHERE reference IS NOT NULL GROUP BY consumer_id, reference \
             HAVING count(*) > 1",
        ),
    ),
    (
        "4. an answer decided before its last acquirer call is stored",
        Check::Query(
            "SELECT 'key ' || op_id || ' is at ' || recovery_point || ' without its answer' \
             FROM idempotency_keys WHERE recovery_point IN ('declined', 'applied') \
             AND response_status IS NULL",
        ),
    ),
    (
        "6. held and pending_credit are the sums of the holds on each account",
        Check::Sums(holds_add_up),
    ),
    (
        "6/8. no account without allow_negative has less available than 0, but for what \
         disputes took from it",
        Check::Sums(available_but_for_disputes),
    ),
    (
        "6. a claimed hold belongs to a capture or cancel of it in progress, or to the expiry",
        // A claim whose operation finished without releasing it would keep
        // the hold forever: nothing else may capture or cancel it.
        Check::Query(
            "SELECT 'charge ' || c.public_id || ' is claimed by ' || c.claimed_by || \
             ', which is not in progress' FROM charges c \
             WHERE c.claimed_by IS NOT NULL AND c.claimed_by <> 'expiry' \
             AND NOT EXISTS (SELECT 1 FROM idempotency_keys k \
               WHERE k.op_id = c.claimed_by AND k.state = 'in_progress' \
               AND k.path IN ('/v1/charges/' || c.public_id || '/capture', \
                 '/v1/charges/' || c.public_id || '/cancel'))",
        ),
    ),
    (
        "events. no state change has two events",
        Check::Query(
            "SELECT 'consumer ' || consumer_id || ': ' || object_id || ' has ' || count(*) || \
             ' ' || type || ' events' FROM events GROUP BY consumer_id, type, object_id \
             HAVING count(*) > 1",
        ),
    ),
    (
        "events. every state change since the event horizon has its event",
        // The horizon: events before it may be gone to retention (or the
        // change predates events). Set differences, not correlated
        // subqueries, so the check stays O(n log n) on a large ledger.
        Check::Query(
            "WITH h AS (SELECT pruned_before AS t FROM event_horizon), \
             missing AS ( \
               SELECT 'account.created' AS type, consumer_id, public_id FROM accounts \
                 WHERE created_at >= (SELECT t FROM h) \
               UNION ALL SELECT 'charge.succeeded', consumer_id, public_id FROM charges \
                 WHERE status = 'succeeded' AND captured_at IS NULL \
                 AND created_at >= (SELECT t FROM h) \
               UNION ALL SELECT 'charge.authorized', consumer_id, public_id FROM charges \
                 WHERE (status <> 'succeeded' OR captured_at IS NOT NULL) \
                 AND created_at >= (SELECT t FROM h) \
               UNION ALL SELECT 'charge.captured', consumer_id, public_id FROM charges \
                 WHERE captured_at >= (SELECT t FROM h) \
               UNION ALL SELECT 'charge.canceled', consumer_id, public_id FROM charges \
                 WHERE canceled_at >= (SELECT t FROM h) \
               UNION ALL SELECT 'refund.created', consumer_id, public_id FROM refunds \
                 WHERE created_at >= (SELECT t FROM h) \
               UNION ALL SELECT 'charge.dispute.created', consumer_id, public_id FROM disputes \
                 WHERE created_at >= (SELECT t FROM h) \
               EXCEPT SELECT type, consumer_id, object_id FROM events) \
             SELECT 'consumer ' || consumer_id || ': ' || public_id || ' has no ' || type || \
             ' event' FROM missing",
        ),
    ),
    (
        "events. every event names an object in the state it announces",
        Check::Query(
            "WITH stray AS ( \
               SELECT type, consumer_id, object_id FROM events \
               EXCEPT SELECT 'account.created', consumer_id, public_id FROM accounts \
               EXCEPT SELECT 'charge.succeeded', consumer_id, public_id FROM charges \
                 WHERE status = 'succeeded' AND captured_at IS NULL \
               EXCEPT SELECT 'charge.authorized', consumer_id, public_id FROM charges \
               EXCEPT SELECT 'charge.captured', consumer_id, public_id FROM charges \
                 WHERE captured_at IS NOT NULL AND status = 'succeeded' \
               EXCEPT SELECT 'charge.canceled', consumer_id, public_id FROM charges \
                 WHERE status = 'canceled' \
               EXCEPT SELECT 'refund.created', consumer_id, public_id FROM refunds \
               EXCEPT SELECT 'charge.dispute.created', consumer_id, public_id FROM disputes) \
             SELECT 'consumer ' || consumer_id || ': event ' || type || ' names ' || \
             object_id || ', which is not in that state' FROM stray",
        ),
    ),
    (
        "5/8. no account without allow_negative is negative, but for what disputes took \
         from it",
        // Implied by 6/8 (held >= 0); said on its own for the report.
        Check::Query(
            "SELECT 'account ' || a.public_id || ' is at ' || a.balance FROM accounts a \
             WHERE a.allow_negative = 0 AND a.balance < 0 AND NOT EXISTS \
             (SELECT 1 FROM entries e WHERE e.account_id = a.id AND e.dispute_id IS NOT NULL \
               AND e.amount < 0)",
        ),
    ),
];

/// The end of check "4. a stored answer names what its key produced",
/// which both engines share: which answers, and which of them name
/// something their key did not produce. Its start is per engine:
/// [`ANSWERS_SQLITE`], [`ANSWERS_POSTGRES`].
macro_rules! answers_rest {
    () => {
        "FROM idempotency_keys k WHERE k.state = 'completed' \
           AND k.response_status IN (200, 201)) \
         SELECT 'key ' || a.op_id || ' answered ' || a.status || ' with ' || a.id || \
           ', which it did not produce' FROM answers a WHERE \
         (a.status = 201 AND a.object = 'charge' AND NOT EXISTS (SELECT 1 FROM charges c \
           WHERE c.public_id = a.id AND c.consumer_id = a.consumer_id \
           AND c.op_id = a.op_id)) \
         OR (a.status = 201 AND a.object = 'refund' AND NOT EXISTS (SELECT 1 FROM refunds r \
           WHERE r.public_id = a.id AND r.consumer_id = a.consumer_id \
           AND r.op_id = a.op_id)) \
         OR (a.status = 200 AND a.object = 'charge' AND a.path = '/v1/charges' \
           AND NOT EXISTS (SELECT 1 FROM charges c \
           WHERE c.public_id = a.id AND c.consumer_id = a.consumer_id \
           AND c.reference = a.reference)) \
         OR (a.status = 200 AND a.object = 'charge' AND a.path <> '/v1/charges' \
           AND NOT EXISTS (SELECT 1 FROM charges c \
           WHERE c.public_id = a.id AND c.consumer_id = a.consumer_id \
           AND a.path = '/v1/charges/' || c.public_id || \
             CASE c.status WHEN 'succeeded' THEN '/capture' ELSE '/cancel' END))"
    };
}

/// Check "4. a stored answer names what its key produced" on SQLite
/// (`json_extract`).
const ANSWERS_SQLITE: &str = concat!(
    "WITH answers AS (SELECT k.op_id, k.consumer_id, k.response_status AS status, \
       json_extract(CAST(k.response_body AS TEXT), '$.object') AS object, \
       json_extract(CAST(k.response_body AS TEXT), '$.id') AS id, \
       json_extract(k.request, '$.reference') AS reference, k.path ",
    answers_rest!()
);

/// [`ANSWERS_SQLITE`] on PostgreSQL: `response_body` is BYTEA holding
/// UTF-8 JSON, `request` TEXT holding JSON; `->>` gives a JSON string
/// unquoted, as `json_extract` does.
const ANSWERS_POSTGRES: &str = concat!(
    "WITH answers AS (SELECT k.op_id, k.consumer_id, k.response_status AS status, \
       convert_from(k.response_body, 'UTF8')::jsonb ->> 'object' AS object, \
       convert_from(k.response_body, 'UTF8')::jsonb ->> 'id' AS id, \
       k.request::jsonb ->> 'reference' AS reference, k.path ",
    answers_rest!()
);

/// One authorization remembered by the acquirer, as the row `a` of the
/// checks below: `?1` its id, `?2` its key, `?3` captured, `?4` refunded
/// (typed, so that PostgreSQL knows the parameters' types).
#[cfg(any(feature = "cli", feature = "internals"))]
macro_rules! acquirer_row {
    () => {
        "WITH a AS (SELECT CAST(?1 AS TEXT) AS id, CAST(?2 AS TEXT) AS key, \
         CAST(?3 AS BIGINT) AS captured, CAST(?4 AS BIGINT) AS refunded) "
    };
}

/// The acquirer's books against the ledger's, one remembered authorization
/// at a time (the row `a`, [`acquirer_row`]): each statement returns one
/// line per violation. The simulator forgets past its
/// retention, so this checks the authorizations it still remembers against
/// the ledger, which keeps every charge; an operation still in progress may
/// be between its acquirer call and its ledger commit, and is not a
/// violation.
#[cfg(any(feature = "cli", feature = "internals"))]
const ACQUIRER_CHECKS: &[(&str, &str, &str)] = &[
    (
        "an authorization open at the acquirer belongs to a held charge",
        "authorized",
        concat!(
            acquirer_row!(),
            "SELECT 'authorization ' || a.id || ' (' || a.key || ') is open at the acquirer, \
             but ' || coalesce((SELECT 'its charge ' || c.public_id || ' is ' || c.status \
             FROM charges c WHERE c.authorization_id = a.id LIMIT 1), 'no charge holds it') \
             FROM a WHERE NOT EXISTS (SELECT 1 FROM charges c WHERE c.authorization_id = a.id \
               AND c.status = 'requires_capture') \
             AND NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.op_id = a.key \
               AND k.state = 'in_progress')"
        ),
    ),
    (
        "an authorization captured at the acquirer is a charge that captured as much, once",
        "captured",
        concat!(
            acquirer_row!(),
            "SELECT 'authorization ' || a.id || ' captured ' || a.captured || \
             ' at the acquirer, but ' || coalesce((SELECT 'its charge ' || c.public_id || \
             ' is ' || c.status || ' with ' || c.amount_captured || ' captured' FROM charges c \
             WHERE c.authorization_id = a.id LIMIT 1), 'no charge has it') \
             FROM a WHERE NOT EXISTS (SELECT 1 FROM charges c WHERE c.authorization_id = a.id \
               AND c.status = 'succeeded' AND c.amount_captured = a.captured) \
             AND NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.op_id = a.key \
               AND k.state = 'in_progress') \
             AND NOT EXISTS (SELECT 1 FROM charges c JOIN idempotency_keys k \
               ON k.op_id = c.claimed_by AND k.state = 'in_progress' \
               WHERE c.authorization_id = a.id)"
        ),
    ),
    (
        "an authorization voided at the acquirer moved and holds no money in the ledger",
        "voided",
        concat!(
            acquirer_row!(),
            "SELECT 'authorization ' || a.id || ' was voided at the acquirer, but its charge ' \
             || c.public_id || ' is ' || c.status FROM a JOIN charges c \
             ON c.authorization_id = a.id \
             WHERE c.status <> 'canceled' AND c.claimed_by IS NULL"
        ),
    ),
    (
        "the acquirer refunded what the ledger refunded",
        "",
        concat!(
            acquirer_row!(),
            "SELECT 'charge ' || c.public_id || ' refunded ' || c.amount_refunded || \
             ' in the ledger, ' || a.refunded || ' at the acquirer' \
             FROM a JOIN charges c ON c.authorization_id = a.id \
             WHERE a.refunded > c.amount_refunded OR (a.refunded < c.amount_refunded \
               AND NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.state = 'in_progress' \
                 AND k.recovery_point = 'applied' \
                 AND k.path = '/v1/charges/' || c.public_id || '/refunds'))"
        ),
    ),
];

/// Adds to `report` every disagreement between the ledger (`db`, inside a
/// read transaction) and the built-in simulator's file at `simulator`, if
/// there is one ([`ACQUIRER_CHECKS`]). The ledger's snapshot is taken
/// first, so the acquirer is read as it was then or later: ahead of the
/// ledger, as the protocol has it (the acquirer acts, then the ledger
/// commits), which the checks' in-progress exemptions allow for.
#[cfg(any(feature = "cli", feature = "internals"))]
fn acquirer_agreement(db: &dyn Db, simulator: &std::path::Path, report: &mut Report) -> Result<()> {
    if !simulator.exists() || report.invariants_skipped_at.is_some() {
        return Ok(());
    }
    db.query_value::<i64>("SELECT count(*) FROM charges", params![])?;
    let authorizations = match crate::acquirer::Simulator::authorizations_of_file(simulator) {
        Ok(a) => a,
        Err(e) => {
            report.failures.push(format!(
                "acquirer agreement: cannot read {}: {e}",
                simulator.display()
            ));
            return Ok(());
        }
    };
    for a in &authorizations {
        for (name, state, sql) in ACQUIRER_CHECKS {
            if !state.is_empty() && a.state != *state {
                continue;
            }
            let lines: Vec<String> = db.query_all(
                sql,
                params![a.id, a.key, a.captured, a.refunded],
                |r| r.get(0),
            )?;
            for line in lines {
                report
                    .failures
                    .push(format!("acquirer agreement, {name}: {line}"));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// SQLite: the entry points, and the checks of the file itself.
// ---------------------------------------------------------------------------

/// Runs every check inside one read transaction (one consistent snapshot).
pub fn verify(conn: &Connection) -> Result<Report> {
    verify_unless(conn, &|| false)
}

/// The ledger invariants alone, on one snapshot of either engine: what
/// `idem verify` and the startup check run on PostgreSQL, which has no file
/// of its own to check (its schema version is checked when it is opened).
pub fn verify_invariants(db: &dyn Db) -> Result<Report> {
    let mut report = Report::default();
    check_invariants(db, &mut report, &|| false)?;
    Ok(report)
}

/// [`verify`], and then the acquirer's books against the ledger's: the
/// built-in simulator's file at `simulator` (`<db>.acquirer.sqlite`), if
/// there is one. Every live authorization belongs to a held charge (or an
/// operation in progress), every capture is a succeeded charge that
/// captured as much, every void a charge that holds and moved nothing, and
/// the refunds agree.
#[cfg(any(feature = "cli", feature = "internals"))]
pub fn verify_with_acquirer(conn: &Connection, simulator: &std::path::Path) -> Result<Report> {
    let mut report = verify(conn)?;
    conn.execute_batch("BEGIN")?;
    let checked = acquirer_agreement(conn, simulator, &mut report);
    let _ = conn.execute_batch("COMMIT");
    checked.map(|()| report)
}

/// [`verify_invariants`] and the acquirer's books against the ledger's
/// (see [`verify_with_acquirer`]), on one snapshot `db` is in: `idem verify`
/// on PostgreSQL.
#[cfg(any(feature = "cli", feature = "internals"))]
pub fn verify_invariants_with_acquirer(db: &dyn Db, simulator: &std::path::Path) -> Result<Report> {
    let mut report = verify_invariants(db)?;
    acquirer_agreement(db, simulator, &mut report)?;
    Ok(report)
}

/// [`verify`], giving up with an error once `stop()` is true. It is asked
/// before each check; to cut a long check short as well, the caller also
/// interrupts `conn` (`InterruptHandle`): an interrupt that lands between two
/// statements is lost, and this is what catches it.
pub fn verify_unless(conn: &Connection, stop: &dyn Fn() -> bool) -> Result<Report> {
    let mut report = Report::default();
    conn.execute_batch("BEGIN")?;
    let result = run_checks(conn, &mut report, stop);
    let _ = conn.execute_batch("COMMIT");
    match result {
        // A damaged file can make a check itself fail: that is a finding.
        Err(Error::Db(e)) if is_damage(&e) => {
            report
                .failures
                .push(format!("the database file is damaged: {e}"));
            Ok(report)
        }
        other => other.map(|()| report),
    }
}

/// The file's checks, then, at the current schema, the ledger invariants.
fn run_checks(conn: &Connection, report: &mut Report, stop: &dyn Fn() -> bool) -> Result<()> {
    if stop() {
        return Err(stopped());
    }
    check_sqlite_file(conn, report)?;
    if report.invariants_skipped_at.is_some() {
        return Ok(());
    }
    check_invariants(conn, report, stop)
}

/// SQLite only: the file's own integrity and foreign keys, and its schema
/// version (`user_version`); below this build's, the ledger invariants do
/// not apply and `report.invariants_skipped_at` says so. PostgreSQL has
/// neither pragma; its schema version is in `idem_schema`.
fn check_sqlite_file(conn: &Connection, report: &mut Report) -> Result<()> {
    report.file_checked = true;
    let integrity: Vec<String> = sqlite_lines(conn, "PRAGMA integrity_check")?;
    if integrity != ["ok"] {
        for line in integrity {
            report.failures.push(format!("integrity_check: {line}"));
        }
    }
    let mut stmt = conn.prepare("PRAGMA foreign_key_check")?;
    let fk = stmt
        .query_map([], |r| {
            Ok(format!(
                "foreign_key_check: {} row {} references missing {}",
                r.get::<_, String>(0)?,
                r.get::<_, Option<i64>>(1)?.unwrap_or(-1),
                r.get::<_, String>(2)?
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    report.failures.extend(fk);
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version < crate::store::SCHEMA_VERSION {
        report.invariants_skipped_at = Some(version);
    }
    Ok(())
}

/// Whether an SQLite error says the file is damaged (a finding of
/// `verify`, not a failure to check).
fn is_damage(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase)
    )
}

/// The first column of every row of an SQLite-only statement (a pragma,
/// or a query over the attached simulator), as text.
fn sqlite_lines(conn: &Connection, sql: &str) -> Result<Vec<String>> {
    let mut stmt = conn.prepare(sql)?;
    let lines = stmt
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(lines)
}

// ---------------------------------------------------------------------------
// Either engine: the ledger invariants.
// ---------------------------------------------------------------------------

/// The ledger invariants ([`CHECKS`]), on either engine: each violation is
/// added to `report.failures` as one line naming its check. It runs inside
/// the transaction `db` is in (one snapshot for every check: the caller
/// opens it) and assumes the current schema, which the caller has checked.
/// `stop()` is asked before each check; once it is true this gives up with
/// an error, keeping in `report` what it found so far.
pub fn check_invariants(db: &dyn Db, report: &mut Report, stop: &dyn Fn() -> bool) -> Result<()> {
    for (name, check) in CHECKS {
        if stop() {
            return Err(stopped());
        }
        let lines = match check {
            Check::Query(sql) => query_lines(db, sql)?,
            // JSON functions: SQLite's and PostgreSQL's are spelled apart.
            Check::Dialects { sqlite, postgres } => match db.dialect() {
                Dialect::Sqlite => query_lines(db, sqlite)?,
                Dialect::Postgres => query_lines(db, postgres)?,
            },
            Check::Sums(find) => find(db)?,
        };
        for line in lines {
            report.failures.push(format!("invariant {name}: {line}"));
        }
    }
    Ok(())
}

/// The error of a check that was told to stop.
fn stopped() -> Error {
    Error::Other("the check was stopped".into())
}

/// Invariant 1: per consumer and currency, the balances add up to 0.
fn balances_sum_to_zero(db: &dyn Db) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut sums: BTreeMap<(i64, String), i128> = BTreeMap::new();
    db.query_each(
        "SELECT consumer_id, currency, public_id, balance FROM accounts",
        params![],
        &mut |row| {
            let sum = sums.entry((row.get(0)?, row.get(1)?)).or_default();
            match money(row.value(3)?) {
                Ok(balance) => *sum += balance,
                Err(shown) => lines.push(format!(
                    "account {} has a balance that is not an integer: {shown}",
                    row.get::<String>(2)?
                )),
            }
            Ok(())
        },
    )?;
    lines.extend(sums.into_iter().filter(|(_, sum)| *sum != 0).map(
        |((consumer, currency), sum)| format!("consumer {consumer} {currency} sums to {sum}"),
    ));
    Ok(lines)
}

/// The amounts of `sql`'s rows (`key, public_id, amount`) added up per key;
/// an amount that is not an integer is a line `"{what} {public_id} has an
/// amount that is not an integer: ..."` in `lines` instead.
fn sums_by(
    db: &dyn Db,
    sql: &str,
    what: &str,
    lines: &mut Vec<String>,
) -> Result<HashMap<i64, i128>> {
    let mut sums: HashMap<i64, i128> = HashMap::new();
    db.query_each(sql, params![], &mut |row| {
        match money(row.value(2)?) {
            Ok(amount) => *sums.entry(row.get(0)?).or_default() += amount,
            Err(shown) => lines.push(format!(
                "{what} {} has an amount that is not an integer: {shown}",
                row.get::<String>(1)?
            )),
        }
        Ok(())
    })?;
    Ok(sums)
}

/// Invariant 2: every balance is the sum of its account's entries. A
/// balance that is not an integer is invariant 1's finding.
fn balances_equal_their_entries(db: &dyn Db) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let sums = sums_by(
        db,
        "SELECT account_id, public_id, amount FROM entries",
        "entry",
        &mut lines,
    )?;
    db.query_each(
        "SELECT id, public_id, balance FROM accounts ORDER BY id",
        params![],
        &mut |row| {
            let entries = sums.get(&row.get(0)?).copied().unwrap_or(0);
            if let Ok(balance) = money(row.value(2)?) {
                if balance != entries {
                    lines.push(format!(
                        "account {} balance {balance} but entries sum to {entries}",
                        row.get::<String>(1)?
                    ));
                }
            }
            Ok(())
        },
    )?;
    Ok(lines)
}

/// Invariant 3: a charge's `amount_refunded` is the sum of its refunds and
/// at most its amount (invariant 7 bounds it by `amount_captured`).
fn refunds_add_up(db: &dyn Db) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let sums = sums_by(
        db,
        "SELECT charge_id, public_id, amount FROM refunds",
        "refund",
        &mut lines,
    )?;
    db.query_each(
        "SELECT id, public_id, amount, amount_refunded FROM charges ORDER BY id",
        params![],
        &mut |row| {
            let public_id: String = row.get(1)?;
            let (amount, refunded) = match (money(row.value(2)?), money(row.value(3)?)) {
                (Ok(amount), Ok(refunded)) => (amount, refunded),
                (amount, refunded) => {
                    lines.push(format!(
                        "charge {public_id} has an amount ({}) or amount_refunded ({}) that is \
                         not an integer",
                        shown(amount),
                        shown(refunded)
                    ));
                    return Ok(());
                }
            };
            let refunds = sums.get(&row.get(0)?).copied().unwrap_or(0);
            if refunded > amount || refunded != refunds {
                lines.push(format!(
                    "charge {public_id} amount_refunded {refunded} but refunds sum to {refunds}"
                ));
            }
            Ok(())
        },
    )?;
    Ok(lines)
}

/// Invariant 6: every account's `held` is the sum of the amounts of the
/// `requires_capture` charges it is the source of, and its `pending_credit`
/// the sum of those it is the destination of.
fn holds_add_up(db: &dyn Db) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut held: HashMap<i64, i128> = HashMap::new();
    let mut pending: HashMap<i64, i128> = HashMap::new();
    db.query_each(
        "SELECT source_id, destination_id, public_id, amount FROM charges \
         WHERE status = 'requires_capture'",
        params![],
        &mut |row| {
            match money(row.value(3)?) {
                Ok(amount) => {
                    *held.entry(row.get(0)?).or_default() += amount;
                    *pending.entry(row.get(1)?).or_default() += amount;
                }
                Err(shown) => lines.push(format!(
                    "charge {} has an amount that is not an integer: {shown}",
                    row.get::<String>(2)?
                )),
            }
            Ok(())
        },
    )?;
    db.query_each(
        "SELECT id, public_id, held, pending_credit FROM accounts ORDER BY id",
        params![],
        &mut |row| {
            let id: i64 = row.get(0)?;
            let public_id: String = row.get(1)?;
            let want = (
                held.get(&id).copied().unwrap_or(0),
                pending.get(&id).copied().unwrap_or(0),
            );
            match (money(row.value(2)?), money(row.value(3)?)) {
                (Ok(h), Ok(p)) if (h, p) == want => {}
                (h, p) => lines.push(format!(
                    "account {public_id} held {} and pending_credit {} but its holds sum to {} \
                     and {}",
                    shown(h),
                    shown(p),
                    want.0,
                    want.1
                )),
            }
            Ok(())
        },
    )?;
    Ok(lines)
}

/// Invariant 7 with disputes: a charge's `amount_disputed` is the sum of
/// its disputes.
fn disputes_add_up(db: &dyn Db) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let sums = sums_by(
        db,
        "SELECT charge_id, public_id, amount FROM disputes",
        "dispute",
        &mut lines,
    )?;
    db.query_each(
        "SELECT id, public_id, amount_disputed FROM charges ORDER BY id",
        params![],
        &mut |row| {
            let disputes = sums.get(&row.get(0)?).copied().unwrap_or(0);
            match money(row.value(2)?) {
                Ok(disputed) if disputed == disputes => {}
                disputed => lines.push(format!(
                    "charge {} amount_disputed {} but disputes sum to {disputes}",
                    row.get::<String>(1)?,
                    shown(disputed)
                )),
            }
            Ok(())
        },
    )?;
    Ok(lines)
}

/// Invariants 6 and 8: an account without `allow_negative` never has less
/// available than 0 through a charge, hold, capture or refund — each of
/// them checks `available` first — so its balance, less its holds, plus
/// what disputes debited from it (the network forces those) is never
/// negative.
fn available_but_for_disputes(db: &dyn Db) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut forced: HashMap<i64, i128> = HashMap::new();
    db.query_each(
        "SELECT account_id, amount FROM entries WHERE dispute_id IS NOT NULL AND amount < 0",
        params![],
        &mut |row| {
            if let Ok(amount) = money(row.value(1)?) {
                *forced.entry(row.get(0)?).or_default() -= amount;
            }
            Ok(())
        },
    )?;
    db.query_each(
        "SELECT id, public_id, balance, held FROM accounts WHERE allow_negative = 0 ORDER BY id",
        params![],
        &mut |row| {
            let taken = forced.get(&row.get(0)?).copied().unwrap_or(0);
            if let (Ok(balance), Ok(held)) = (money(row.value(2)?), money(row.value(3)?)) {
                if balance - held + taken < 0 {
                    lines.push(format!(
                        "account {} has balance {balance} and holds {held}, and disputes took \
                         only {taken}",
                        row.get::<String>(1)?
                    ));
                }
            }
            Ok(())
        },
    )?;
    Ok(lines)
}

/// An amount of money as stored: an integer, widened so that any number of
/// them add up exactly; anything else (on SQLite, a float or text written
/// by hand) is shown as found.
fn money(value: Value<'_>) -> std::result::Result<i128, String> {
    match value {
        Value::Int(n) => Ok(i128::from(n)),
        Value::Real(x) => Err(x.to_string()),
        Value::Text(t) => Err(format!("'{t}'")),
        Value::Blob(b) => Err(format!("a blob of {} bytes", b.len())),
        Value::Null => Err("NULL".into()),
    }
}

/// A [`money`] result as a report shows it.
fn shown(v: std::result::Result<i128, String>) -> String {
    v.map_or_else(|s| s, |n| n.to_string())
}

/// The first column of every row of an invariant's query, as text.
fn query_lines(db: &dyn Db, sql: &str) -> Result<Vec<String>> {
    db.query_all(sql, params![], |r: &dyn Row| r.get::<String>(0))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use rusqlite::{params, Connection};

    use super::verify;
    use crate::store::SCHEMA_SQL;

    /// A ledger written row by row, so balances can sit exactly at the
    /// edges of `i64` and entries can come in any order.
    struct Ledger {
        conn: Connection,
        accounts: BTreeMap<&'static str, i64>,
        charges: i64,
    }

    impl Ledger {
        /// A fresh database with one consumer and these accounts, created
        /// in this order (so their rowids follow it), all `allow_negative`.
        fn new(accounts: &[&'static str]) -> Ledger {
            let conn = Connection::open_in_memory().unwrap();
            conn.execute_batch(SCHEMA_SQL).unwrap();
            conn.pragma_update(None, "user_version", crate::store::SCHEMA_VERSION)
                .unwrap();
            conn.execute(
                "INSERT INTO consumers (id, public_id, name, key_hash, created_at) \
                 VALUES (1, 'cons_1', 'tenant', zeroblob(32), 0)",
                [],
            )
            .unwrap();
            // These ledgers are written by hand, without events: the
            // horizon puts every change before events began.
            conn.execute("UPDATE event_horizon SET pruned_before = ?1", [i64::MAX])
                .unwrap();
            let mut ids = BTreeMap::new();
            for name in accounts {
                conn.execute(
                    "INSERT INTO accounts (consumer_id, public_id, currency, allow_negative, \
                     metadata, created_at) VALUES (1, ?1, 'BRL', 1, '{}', 0)",
                    [name],
                )
                .unwrap();
                ids.insert(*name, conn.last_insert_rowid());
            }
            Ledger {
                conn,
                accounts: ids,
                charges: 0,
            }
        }

        /// A charge and its two entries; balances are set by `settle`.
        fn charge(&mut self, source: &str, destination: &str, amount: i64) -> i64 {
            self.charges += 1;
            let n = self.charges;
            self.conn
                .execute(
                    "INSERT INTO charges (id, consumer_id, public_id, amount, currency, \
                     source_id, destination_id, metadata, fingerprint, op_id, idempotency_key, \
                     authorization_id, created_at, status, amount_captured) VALUES (?1, 1, \
                     'ch_' || ?1, ?2, 'BRL', ?3, ?4, '{}', zeroblob(32), 'op_' || ?1, \
                     'key-' || ?1, 'auth_' || ?1, 0, 'succeeded', ?2)",
                    params![n, amount, self.accounts[source], self.accounts[destination]],
                )
                .unwrap();
            for (account, signed) in [(source, -amount), (destination, amount)] {
                self.conn
                    .execute(
                        "INSERT INTO entries (public_id, account_id, amount, charge_id, \
                         created_at) VALUES ('evt_' || ?1 || '_' || ?2, ?2, ?3, ?1, 0)",
                        params![n, self.accounts[account], signed],
                    )
                    .unwrap();
            }
            n
        }

        /// Sets every balance to the exact sum of its entries (which must
        /// fit in i64).
        fn settle(&self) {
            for id in self.accounts.values() {
                let mut stmt = self
                    .conn
                    .prepare("SELECT amount FROM entries WHERE account_id = ?1")
                    .unwrap();
                let sum: i128 = stmt
                    .query_map([id], |r| r.get::<_, i64>(0))
                    .unwrap()
                    .map(|a| i128::from(a.unwrap()))
                    .sum();
                self.conn
                    .execute(
                        "UPDATE accounts SET balance = ?2 WHERE id = ?1",
                        params![id, i64::try_from(sum).unwrap()],
                    )
                    .unwrap();
            }
        }

        fn set_balance(&self, account: &str, balance: i64) {
            self.conn
                .execute(
                    "UPDATE accounts SET balance = ?2 WHERE public_id = ?1",
                    params![account, balance],
                )
                .unwrap();
        }

        fn failures(&self) -> Vec<String> {
            verify(&self.conn)
                .expect("verify reports, it does not fail")
                .failures
        }

        /// SQLite's own `sum`, to show that a case really overflows it.
        fn sqlite_sum(&self, sql: &str) -> rusqlite::Result<i64> {
            self.conn.query_row(sql, [], |r| r.get(0))
        }
    }

    const MAX: i64 = i64::MAX;

    /// Two accounts at i64::MAX created before two at i64::MIN + 1 (the
    /// negative of MAX): the balances sum to 0, but a running sum in rowid
    /// order leaves i64 at the second account. And `hot` holds MAX whose
    /// entries, in id order, run through 2·MAX before coming back.
    fn edge_ledger() -> Ledger {
        let mut ledger = Ledger::new(&["up1", "up2", "down1", "down2", "hot", "in1", "in2", "out"]);
        ledger.charge("down1", "up1", MAX);
        ledger.charge("down2", "up2", MAX);
        ledger.charge("in1", "hot", MAX);
        ledger.charge("in2", "hot", MAX);
        ledger.charge("hot", "out", MAX);
        ledger.settle();
        ledger
    }

    #[test]
    fn balances_at_the_edges_of_i64_verify() {
        let ledger = edge_ledger();
        // The cases are real: SQLite's sum overflows on both.
        let overflow =
            |r: rusqlite::Result<i64>| r.unwrap_err().to_string().contains("integer overflow");
        assert!(overflow(
            ledger.sqlite_sum("SELECT sum(balance) FROM accounts")
        ));
        assert!(overflow(ledger.sqlite_sum(
            "SELECT sum(amount) FROM entries WHERE account_id = \
             (SELECT id FROM accounts WHERE public_id = 'hot')"
        )));
        let balance = |account: &str| -> i64 {
            ledger
                .conn
                .query_row(
                    "SELECT balance FROM accounts WHERE public_id = ?1",
                    [account],
                    |r| r.get(0),
                )
                .unwrap()
        };
        assert_eq!(balance("up1"), i64::MAX);
        assert_eq!(balance("down1"), i64::MIN + 1);
        assert_eq!(balance("hot"), i64::MAX);
        assert_eq!(ledger.failures(), Vec::<String>::new());
    }

    #[test]
    fn a_violation_among_huge_balances_is_reported_exactly() {
        let ledger = edge_ledger();
        ledger.set_balance("out", MAX - 1);
        assert_eq!(
            ledger.failures(),
            [
                "invariant 1. balances sum to zero per consumer and currency: \
                 consumer 1 BRL sums to -1",
                "invariant 2. each balance equals the sum of its entries: \
                 account out balance 9223372036854775806 but entries sum to 9223372036854775807",
            ]
        );
    }

    #[test]
    fn the_invariants_alone_run_through_the_storage_interface() {
        // What a PostgreSQL path calls after its own schema check: the same
        // findings as `verify`, with none of SQLite's file checks.
        let ledger = edge_ledger();
        ledger.set_balance("out", MAX - 1);
        let db: &dyn crate::store::Db = &ledger.conn;
        let mut report = super::Report::default();
        ledger.conn.execute_batch("BEGIN").unwrap();
        super::check_invariants(db, &mut report, &|| false).unwrap();
        ledger.conn.execute_batch("COMMIT").unwrap();
        assert_eq!(report.failures, ledger.failures());
        assert_eq!(report.failures.len(), 2, "{:#?}", report.failures);
        assert_eq!(report.invariants_skipped_at, None);
    }

    #[test]
    fn sums_beyond_i64_are_reported_not_errors() {
        // Two accounts at MAX with nothing to balance them: the consumer's
        // sum is 2·MAX, which no i64 holds.
        let ledger = Ledger::new(&["a", "b"]);
        ledger.set_balance("a", MAX);
        ledger.set_balance("b", MAX);
        let failures = ledger.failures();
        assert_eq!(
            failures[0],
            "invariant 1. balances sum to zero per consumer and currency: \
             consumer 1 BRL sums to 18446744073709551614"
        );
        assert_eq!(failures.len(), 3, "{failures:#?}");
    }

    #[test]
    fn refunds_summing_beyond_i64_are_reported_not_errors() {
        // Two refunds of MAX each on one charge: they sum past i64.
        let mut ledger = Ledger::new(&["card", "shop"]);
        let charge = ledger.charge("card", "shop", MAX);
        ledger.settle();
        for n in 0..2 {
            ledger
                .conn
                .execute(
                    "INSERT INTO refunds (consumer_id, public_id, charge_id, amount, op_id, \
                     idempotency_key, created_at) VALUES (1, 're_' || ?1, ?2, ?3, \
                     'op_re_' || ?1, 'rk-' || ?1, 0)",
                    params![n, charge, MAX],
                )
                .unwrap();
        }
        let failures = ledger.failures();
        assert!(
            failures.contains(
                &"invariant 3. amount_refunded is the sum of refunds and at most the amount: \
                  charge ch_1 amount_refunded 0 but refunds sum to 18446744073709551614"
                    .to_string()
            ),
            "{failures:#?}"
        );
    }

    #[test]
    fn a_check_told_to_stop_fails_instead_of_reporting() {
        let ledger = edge_ledger();
        let asked = std::cell::Cell::new(0);
        let stop_at_third = || {
            asked.set(asked.get() + 1);
            asked.get() == 3
        };
        let stopped = super::verify_unless(&ledger.conn, &stop_at_third);
        assert!(stopped.is_err(), "{stopped:?}");
        assert_eq!(asked.get(), 3, "asked before each check until told to stop");
        assert!(ledger.conn.is_autocommit(), "its read transaction ended");
    }

    #[test]
    fn a_balance_that_is_not_an_integer_is_a_finding() {
        let ledger = Ledger::new(&["a", "b"]);
        ledger
            .conn
            .execute(
                "UPDATE accounts SET balance = 1.5 WHERE public_id = 'a'",
                [],
            )
            .unwrap();
        let failures = ledger.failures();
        assert!(
            failures
                .iter()
                .any(|f| f.starts_with("invariant 1.") && f.contains("1.5")),
            "{failures:#?}"
        );
    }
}
