//! `idem verify`: SQLite's own checks and the five ledger invariants of the
//! contract, each as a query that lists what breaks it. Used by the CLI and
//! by every test that crashes the server.

use rusqlite::{Connection, ErrorCode};

use crate::error::{Error, Result};

/// What failed; empty when the database is sound.
#[derive(Debug, Default)]
pub struct Report {
    pub failures: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.ok() {
            return f.write_str("ok: integrity, foreign keys and all ledger invariants hold\n");
        }
        writeln!(f, "FAILED: {} problem(s)", self.failures.len())?;
        for failure in &self.failures {
            writeln!(f, "- {failure}")?;
        }
        Ok(())
    }
}

/// Invariant checks: a name and a query whose every row is one violation,
/// rendered as text by the query itself.
const CHECKS: &[(&str, &str)] = &[
    (
        "1. balances sum to zero per consumer and currency",
        "SELECT 'consumer ' || consumer_id || ' ' || currency || ' sums to ' || sum(balance) \
         FROM accounts GROUP BY consumer_id, currency HAVING sum(balance) <> 0",
    ),
    (
        "2. each balance equals the sum of its entries",
        "SELECT 'account ' || a.public_id || ' balance ' || a.balance || ' but entries sum to ' \
         || coalesce((SELECT sum(amount) FROM entries e WHERE e.account_id = a.id), 0) \
         FROM accounts a WHERE a.balance <> \
         coalesce((SELECT sum(amount) FROM entries e WHERE e.account_id = a.id), 0)",
    ),
    (
        "3. each charge has one debit of its source and one credit of its destination",
        "SELECT 'charge ' || c.public_id || ' has wrong entries' FROM charges c WHERE \
         (SELECT count(*) FROM entries e WHERE e.charge_id = c.id AND e.refund_id IS NULL) <> 2 \
         OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.charge_id = c.id AND e.refund_id IS NULL \
           AND e.account_id = c.source_id AND e.amount = -c.amount) \
         OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.charge_id = c.id AND e.refund_id IS NULL \
           AND e.account_id = c.destination_id AND e.amount = c.amount)",
    ),
    (
        "3. each refund has exactly its reverse entries",
        "SELECT 'refund ' || r.public_id || ' has wrong entries' FROM refunds r \
         JOIN charges c ON c.id = r.charge_id WHERE \
         (SELECT count(*) FROM entries e WHERE e.charge_id = r.charge_id \
           AND e.refund_id = r.id) <> 2 \
         OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.refund_id = r.id AND e.charge_id = c.id \
           AND e.account_id = c.destination_id AND e.amount = -r.amount) \
         OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.refund_id = r.id AND e.charge_id = c.id \
           AND e.account_id = c.source_id AND e.amount = r.amount)",
    ),
    (
        "3. each refund's entries belong to its charge",
        "SELECT 'entry ' || e.public_id || ' of refund ' || r.public_id || \
         ' names another charge' FROM entries e JOIN refunds r ON r.id = e.refund_id \
         WHERE e.charge_id IS NOT r.charge_id",
    ),
    (
        "3. amount_refunded is the sum of refunds and at most the amount",
        "SELECT 'charge ' || c.public_id || ' amount_refunded ' || c.amount_refunded || \
         ' but refunds sum to ' || coalesce((SELECT sum(amount) FROM refunds r \
         WHERE r.charge_id = c.id), 0) FROM charges c WHERE c.amount_refunded > c.amount OR \
         c.amount_refunded <> coalesce((SELECT sum(amount) FROM refunds r \
         WHERE r.charge_id = c.id), 0)",
    ),
    (
        "4. every completed key has a stored response",
        "SELECT 'key ' || op_id || ' is completed without a response' FROM idempotency_keys \
         WHERE state = 'completed' AND (response_status IS NULL OR response_body IS NULL)",
    ),
    (
        "4. a stored answer names what its key produced",
        // A 201 names the charge or refund this very reservation produced
        // (same op_id); a 200 charge (a reference replay) names the charge
        // that holds the reference of the key's request.
        "WITH answers AS (SELECT k.op_id, k.consumer_id, k.response_status AS status, \
           json_extract(CAST(k.response_body AS TEXT), '$.object') AS object, \
           json_extract(CAST(k.response_body AS TEXT), '$.id') AS id, \
           json_extract(k.request, '$.reference') AS reference \
         FROM idempotency_keys k WHERE k.state = 'completed' AND k.response_status IN (200, 201)) \
         SELECT 'key ' || a.op_id || ' answered ' || a.status || ' with ' || a.id || \
           ', which it did not produce' FROM answers a WHERE \
         (a.status = 201 AND a.object = 'charge' AND NOT EXISTS (SELECT 1 FROM charges c \
           WHERE c.public_id = a.id AND c.consumer_id = a.consumer_id AND c.op_id = a.op_id)) \
         OR (a.status = 201 AND a.object = 'refund' AND NOT EXISTS (SELECT 1 FROM refunds r \
           WHERE r.public_id = a.id AND r.consumer_id = a.consumer_id AND r.op_id = a.op_id)) \
         OR (a.status = 200 AND a.object = 'charge' AND NOT EXISTS (SELECT 1 FROM charges c \
           WHERE c.public_id = a.id AND c.consumer_id = a.consumer_id \
           AND c.reference = a.reference))",
    ),
    (
        "4. each charge and refund records the key that produced it",
        "SELECT 'charge ' || public_id || ' records no key' FROM charges \
         WHERE op_id = '' OR idempotency_key = '' UNION ALL \
         SELECT 'refund ' || public_id || ' records no key' FROM refunds \
         WHERE op_id = '' OR idempotency_key = ''",
    ),
    (
        "4. no reservation or reference produced two charges",
        "SELECT 'operation ' || op_id || ' produced ' || count(*) || ' charges' FROM charges \
         GROUP BY op_id HAVING count(*) > 1 UNION ALL \
         SELECT 'operation ' || op_id || ' produced ' || count(*) || ' refunds' FROM refunds \
         GROUP BY op_id HAVING count(*) > 1 UNION ALL \
         SELECT 'reference ' || reference || ' produced ' || count(*) || ' charges' FROM charges \
         WHERE reference IS NOT NULL GROUP BY consumer_id, reference HAVING count(*) > 1",
    ),
    (
        "5. no account without allow_negative is negative",
        "SELECT 'account ' || public_id || ' is at ' || balance FROM accounts \
         WHERE allow_negative = 0 AND balance < 0",
    ),
];

/// Runs every check inside one read transaction (one consistent snapshot).
pub fn verify(conn: &Connection) -> Result<Report> {
    let mut report = Report::default();
    conn.execute_batch("BEGIN")?;
    let result = run_checks(conn, &mut report);
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

fn run_checks(conn: &Connection, report: &mut Report) -> Result<()> {
    let integrity: Vec<String> = query_lines(conn, "PRAGMA integrity_check")?;
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
    for (name, sql) in CHECKS {
        for line in query_lines(conn, sql)? {
            report.failures.push(format!("invariant {name}: {line}"));
        }
    }
    Ok(())
}

fn is_damage(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase)
    )
}

fn query_lines(conn: &Connection, sql: &str) -> Result<Vec<String>> {
    let mut stmt = conn.prepare(sql)?;
    let lines = stmt
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(lines)
}
