//! The PostgreSQL schema (`schema_postgres.sql`) is `schema.sql` in other
//! types: the same tables, the same columns with the same nullability, the
//! same named indexes, plus the three lease columns only several nodes
//! need. A step added to one schema and forgotten in the other fails here.
//! Runs in the PostgreSQL pass (`IDEM_TEST_POSTGRES`); says it is skipped
//! otherwise.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use support::TempDir;

/// Columns that exist on PostgreSQL only: the leases of several nodes.
const POSTGRES_ONLY: &[(&str, &str)] = &[
    ("charges", "expiry_leased_until"),
    ("deliveries", "leased_by"),
    ("deliveries", "leased_until"),
];

/// Runs `idem ARGS --db DB`, which must succeed.
fn idem(args: &[&str], db: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .arg("--db")
        .arg(db)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// (table, column, not null) of an SQLite file, and its named indexes.
fn sqlite_schema(file: &Path) -> (BTreeSet<(String, String, bool)>, BTreeSet<String>) {
    let conn = rusqlite::Connection::open(file).unwrap();
    let columns = conn
        .prepare(
            "SELECT m.name, p.name, p.\"notnull\" OR p.pk FROM sqlite_schema m \
             JOIN pragma_table_info(m.name) p WHERE m.type = 'table'",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    let indexes = conn
        .prepare(
            "SELECT name FROM sqlite_schema WHERE type = 'index' \
             AND name NOT LIKE 'sqlite_autoindex%'",
        )
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    (columns, indexes)
}

/// The same of a PostgreSQL database (its constraints' own indexes aside).
fn postgres_schema(db: &Path) -> (BTreeSet<(String, String, bool)>, BTreeSet<String>) {
    support::inspect(db, |c| {
        let columns = c.query_all(
            "SELECT table_name, column_name, is_nullable = 'NO' FROM information_schema.columns \
             WHERE table_schema = current_schema()",
            &[],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        let indexes = c.query_all(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() \
             AND indexname NOT LIKE '%\\_pkey' AND indexname NOT LIKE '%\\_key'",
            &[],
            |r| r.get(0),
        )?;
        Ok((columns.into_iter().collect(), indexes.into_iter().collect()))
    })
}

#[test]
fn the_postgres_schema_has_the_tables_columns_and_indexes_of_schema_sql() {
    if !support::on_postgres() {
        eprintln!("skipped: needs IDEM_TEST_POSTGRES");
        return;
    }
    let dir = TempDir::new("parity");
    let file = dir.0.join("parity.db");
    // `idem migrate` wants an existing file; `consumers create` makes one.
    idem(&["consumers", "create", "parity"], &file);
    let (sqlite_columns, sqlite_indexes) = sqlite_schema(&file);
    let db = dir.db();
    idem(&["migrate"], &db);
    let (mut pg_columns, pg_indexes) = postgres_schema(&db);
    for (table, column) in POSTGRES_ONLY {
        assert!(
            pg_columns.remove(&(table.to_string(), column.to_string(), true))
                || pg_columns.remove(&(table.to_string(), column.to_string(), false)),
            "{table}.{column} is gone from the PostgreSQL schema: update POSTGRES_ONLY"
        );
    }
    let only_sqlite: Vec<_> = sqlite_columns.difference(&pg_columns).collect();
    let only_pg: Vec<_> = pg_columns.difference(&sqlite_columns).collect();
    assert!(
        only_sqlite.is_empty() && only_pg.is_empty(),
        "columns differ (table, column, not null):\n only in schema.sql: {only_sqlite:?}\n \
         only in schema_postgres.sql: {only_pg:?}"
    );
    assert_eq!(sqlite_indexes, pg_indexes, "named indexes differ");
}
