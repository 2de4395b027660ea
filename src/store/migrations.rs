//! Schema versions and the steps between them.
//!
//! `PRAGMA user_version` names a database's schema. A new database gets
//! `schema.sql`, the whole current schema, in one transaction. An older one
//! is brought forward by the numbered files in `migrations/`, each applied in
//! its own `BEGIN IMMEDIATE` transaction together with its new
//! `user_version` and its row in `schema_migrations`: a crash between two
//! steps leaves the database at the last step that committed, and the next
//! start goes on from there. A database newer than this build is refused,
//! never touched.
//!
//! Steps run with foreign key enforcement off (SQLite ignores the pragma
//! inside a transaction, and a table rebuild needs it off), and each step
//! checks `PRAGMA foreign_key_check` before it commits, as SQLite's
//! documented procedure for schema changes does.

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use crate::config::FaultPoint;
use crate::error::{Error, Result};
use crate::time::now_ms;

/// One numbered step: the SQL that takes a database from `version - 1` to
/// `version`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Step {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every step, in order. Step 1 is the first schema as it shipped; it is never
/// applied to a database (a new one gets `schema.sql`) but is where the
/// equivalence test starts. A new step is a new file in `migrations/` and a
/// new line here; tests/migrations.rs fails if the two disagree.
pub(crate) const STEPS: &[Step] = &[
    Step {
        version: 1,
        name: "initial",
        sql: include_str!("../../migrations/0001_initial.sql"),
    },
    Step {
        version: 2,
        name: "schema_migrations",
        sql: include_str!("../../migrations/0002_schema_migrations.sql"),
    },
    Step {
        version: 3,
        name: "two_phase",
        sql: include_str!("../../migrations/0003_two_phase.sql"),
    },
    Step {
        version: 4,
        name: "events",
        sql: include_str!("../../migrations/0004_events.sql"),
    },
];

/// The schema, embedded at build time: what a new database is created with.
pub(crate) const SCHEMA_SQL: &str = include_str!("../../schema.sql");

/// The `PRAGMA user_version` this build writes and understands: the last step.
pub const SCHEMA_VERSION: i64 = STEPS[STEPS.len() - 1].version;

/// What [`migrate`] did: the version found and the version left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migrated {
    /// The database's version before (0: it was new and empty).
    pub from: i64,
    /// Its version now: always [`SCHEMA_VERSION`] on success.
    pub to: i64,
}

/// The version a database is at.
pub(crate) fn version(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row("PRAGMA user_version", [], |r| r.get(0))?)
}

/// Brings the database to [`SCHEMA_VERSION`]: `schema.sql` on a new one, the
/// pending steps on an older one; refuses a newer one. With
/// `FaultPoint::InMigration` the process aborts inside the first step it
/// applies, after its SQL ran and before its commit (for the crash test).
pub fn migrate(conn: &mut Connection, fault: Option<FaultPoint>) -> Result<Migrated> {
    let abort = fault == Some(FaultPoint::InMigration);
    migrate_with(conn, STEPS, SCHEMA_SQL, &mut |version| {
        if abort {
            eprintln!("idem: fault point InMigration reached in step {version}, aborting");
            std::process::abort();
        }
    })
}

/// [`migrate`] over any list of steps; `before_commit` runs inside each
/// step's transaction, just before its commit. The target version is the
/// last step's.
pub(crate) fn migrate_with(
    conn: &mut Connection,
    steps: &[Step],
    schema_sql: &str,
    before_commit: &mut dyn FnMut(i64),
) -> Result<Migrated> {
    let target = steps.last().map_or(0, |s| s.version);
    let from = checked_version(conn, target)?;
    if from == target {
        return Ok(Migrated { from, to: target });
    }
    conn.pragma_update(None, "foreign_keys", "OFF")?;
    let result = (|| -> Result<()> {
        if from == 0 {
            create(conn, steps, schema_sql, target)?;
        }
        for step in steps.iter().filter(|s| s.version > from.max(1)) {
            apply(conn, step, before_commit)?;
        }
        Ok(())
    })();
    conn.pragma_update(None, "foreign_keys", "ON")?;
    result?;
    Ok(Migrated { from, to: target })
}

/// The version, unless it is newer than `target`.
fn checked_version(conn: &Connection, target: i64) -> Result<i64> {
    let found = version(conn)?;
    if found > target {
        return Err(Error::SchemaTooNew {
            found,
            supported: target,
        });
    }
    Ok(found)
}

/// Refuses, without writing anything, a database this build must not touch:
/// one from a newer idem, or an SQLite file with tables but no idem schema
/// version (another program's).
pub(crate) fn refuse_foreign_or_newer(conn: &Connection) -> Result<()> {
    if checked_version(conn, SCHEMA_VERSION)? == 0 {
        refuse_foreign(conn)?;
    }
    Ok(())
}

/// Version 0 is also what any SQLite file that is not ours says.
fn refuse_foreign(conn: &Connection) -> Result<()> {
    let tables: i64 = conn.query_row(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table'",
        [],
        |r| r.get(0),
    )?;
    if tables > 0 {
        return Err(Error::Other(format!(
            "it is an SQLite database with {tables} table(s) but no idem schema version, \
             so not an idem database; refusing to add tables to it"
        )));
    }
    Ok(())
}

/// A new database: the whole schema at once, every version recorded.
fn create(conn: &mut Connection, steps: &[Step], schema_sql: &str, target: i64) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    // Re-read under the write lock: another process may have created it.
    if checked_version(&tx, target)? != 0 {
        return Ok(());
    }
    refuse_foreign(&tx)?;
    tx.execute_batch(schema_sql)?;
    for step in steps {
        record(&tx, step)?;
    }
    tx.pragma_update(None, "user_version", target)?;
    tx.commit()?;
    Ok(())
}

/// One step in its own transaction, unless another process applied it.
fn apply(conn: &mut Connection, step: &Step, before_commit: &mut dyn FnMut(i64)) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let now = version(&tx)?;
    if now >= step.version {
        return Ok(());
    }
    if now != step.version - 1 {
        return Err(Error::Other(format!(
            "schema version {now} cannot take migration step {} ({})",
            step.version, step.name
        )));
    }
    tx.execute_batch(step.sql).map_err(|e| {
        Error::Other(format!(
            "migration step {} ({}) failed: {e}",
            step.version, step.name
        ))
    })?;
    let dangling: Option<String> = tx
        .query_row("PRAGMA foreign_key_check", [], |r| r.get(0))
        .optional()?;
    if let Some(table) = dangling {
        return Err(Error::Other(format!(
            "migration step {} ({}) left a broken foreign key in table {table}",
            step.version, step.name
        )));
    }
    record(&tx, step)?;
    tx.pragma_update(None, "user_version", step.version)?;
    before_commit(step.version);
    tx.commit()?;
    log::info!(
        "schema migrated to version {} ({})",
        step.version,
        step.name
    );
    Ok(())
}

/// Writes the step's row in `schema_migrations`, from the step that creates
/// that table on.
fn record(tx: &Connection, step: &Step) -> Result<()> {
    let has_table = tx
        .prepare("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'")?
        .exists([])?;
    if has_table {
        tx.execute(
            "INSERT INTO schema_migrations (version, name, applied_at, applied_by) \
             VALUES (?1, ?2, ?3, ?4)",
            params![step.version, step.name, now_ms(), env!("CARGO_PKG_VERSION")],
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = "CREATE TABLE a (id INTEGER PRIMARY KEY, x INTEGER NOT NULL);";

    fn steps() -> Vec<Step> {
        vec![
            Step {
                version: 1,
                name: "a",
                sql: V1,
            },
            Step {
                version: 2,
                name: "b",
                sql: "CREATE TABLE b (id INTEGER PRIMARY KEY);",
            },
            Step {
                version: 3,
                name: "a.y",
                sql: "ALTER TABLE a ADD COLUMN y INTEGER NOT NULL DEFAULT 7;",
            },
            Step {
                version: 4,
                name: "broken",
                sql: "ALTER TABLE nope ADD COLUMN z INTEGER;",
            },
        ]
    }

    fn v1_database() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(V1).unwrap();
        conn.execute("INSERT INTO a (x) VALUES (41)", []).unwrap();
        conn.pragma_update(None, "user_version", 1).unwrap();
        conn
    }

    #[test]
    fn a_failing_step_leaves_the_last_completed_version() {
        let mut conn = v1_database();
        let mut committed = Vec::new();
        let err = migrate_with(&mut conn, &steps(), "", &mut |v| committed.push(v)).unwrap_err();
        assert!(err.to_string().contains("step 4 (broken)"), "{err}");
        assert_eq!(committed, [2, 3], "steps 2 and 3 committed, one each");
        assert_eq!(version(&conn).unwrap(), 3);
        let (x, y): (i64, i64) = conn
            .query_row("SELECT x, y FROM a", [], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap();
        assert_eq!((x, y), (41, 7), "rows survive and step 3's default applies");
        // The next run resumes at step 4 alone.
        let fixed = &mut steps();
        fixed[3].sql = "ALTER TABLE b ADD COLUMN z INTEGER;";
        let mut again = Vec::new();
        let done = migrate_with(&mut conn, fixed, "", &mut |v| again.push(v)).unwrap();
        assert_eq!(done, Migrated { from: 3, to: 4 });
        assert_eq!(again, [4]);
    }

    #[test]
    fn a_newer_database_is_refused_untouched() {
        let mut conn = v1_database();
        conn.pragma_update(None, "user_version", 9).unwrap();
        let err = migrate_with(&mut conn, &steps()[..3], "", &mut |_| {}).unwrap_err();
        assert!(
            matches!(
                err,
                Error::SchemaTooNew {
                    found: 9,
                    supported: 3
                }
            ),
            "{err:?}"
        );
        assert_eq!(version(&conn).unwrap(), 9);
    }

    #[test]
    fn a_foreign_sqlite_file_is_not_taken_for_a_new_database() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE theirs (x);").unwrap();
        let err = migrate(&mut conn, None).unwrap_err();
        assert!(err.to_string().contains("not an idem database"), "{err}");
        let tables: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
            .unwrap();
        assert_eq!(tables, 1, "nothing was added");
    }

    #[test]
    fn a_new_database_records_every_version() {
        let mut conn = Connection::open_in_memory().unwrap();
        let done = migrate(&mut conn, None).unwrap();
        assert_eq!(
            done,
            Migrated {
                from: 0,
                to: SCHEMA_VERSION
            }
        );
        let versions: Vec<i64> = conn
            .prepare("SELECT version FROM schema_migrations ORDER BY version")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(versions, (1..=SCHEMA_VERSION).collect::<Vec<_>>());
    }
}
