//! Schema versions: a new database and a migrated one have the same schema;
//! a version-1 database written by the v1 binary (tests/fixtures/v1.db, made
//! by tests/fixtures/make_v1.sh at commit c1e2973) migrates on `idem serve`
//! and on `idem migrate`, verifies, and replays its stored answers byte for
//! byte; a crash inside a step leaves the previous version; a newer
//! database is refused untouched. All of that is about SQLite files; on
//! PostgreSQL (`IDEM_TEST_POSTGRES`), `idem migrate` gives an empty database
//! the schema once, and refuses one that holds other tables untouched.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use serde_json::{json, Value};
use support::{ChildServer, Client, TempDir};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/v1.db");
const FIXTURE_KEY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/v1.key");
const MIGRATIONS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
const SCHEMA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/schema.sql");

fn idem(args: &[&str], db: &Path, env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .arg("--db")
        .arg(db)
        .env_remove("IDEM_FAULT")
        .envs(env.iter().copied())
        .output()
        .expect("run idem");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A copy of the version-1 fixture in a fresh directory.
fn v1_copy(dir: &TempDir) -> PathBuf {
    let db = dir.db();
    std::fs::copy(FIXTURE, &db).expect("copy the fixture");
    db
}

fn user_version(db: &Path) -> i64 {
    Connection::open(db)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap()
}

/// `migrations/NNNN_name.sql`, in order.
fn migration_files() -> Vec<(i64, PathBuf)> {
    let mut files: Vec<(i64, PathBuf)> = std::fs::read_dir(MIGRATIONS)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .map(|p| {
            let name = p.file_name().unwrap().to_str().unwrap().to_string();
            let (number, rest) = name.split_once('_').expect("NNNN_name.sql");
            assert!(
                number.len() == 4 && !rest.is_empty(),
                "{name}: a migration is NNNN_name.sql"
            );
            (number.parse().expect("a numbered migration"), p)
        })
        .collect();
    files.sort();
    files
}

#[test]
fn migration_files_are_numbered_without_gaps_up_to_the_schema_version() {
    let numbers: Vec<i64> = migration_files().iter().map(|(n, _)| *n).collect();
    let expected: Vec<i64> = (1..=idem::store::SCHEMA_VERSION).collect();
    assert_eq!(
        numbers, expected,
        "migrations/ must hold exactly one file per version up to SCHEMA_VERSION \
         (a new file needs its line in src/store/migrations.rs STEPS, and the reverse)"
    );
}

/// The schema as a set of facts that do not depend on how it was reached:
/// columns (name, type, not null, default, primary key), foreign keys,
/// CHECK constraints and indexes (columns, uniqueness, partial WHERE),
/// with comments and white space folded. Column order is left out: a column
/// added by ALTER TABLE comes last, wherever schema.sql lists it.
fn schema_facts(conn: &Connection) -> BTreeSet<String> {
    let mut facts = BTreeSet::new();
    let objects: Vec<(String, String, String, Option<String>)> = conn
        .prepare(
            "SELECT type, name, tbl_name, sql FROM sqlite_master \
             WHERE name NOT LIKE 'sqlite_%' ORDER BY name",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    for (kind, name, table, sql) in objects {
        let sql = normalize(sql.as_deref().unwrap_or(""));
        match kind.as_str() {
            "table" => {
                let rows = |pragma: &str| -> Vec<String> {
                    let mut stmt = conn
                        .prepare(&format!("SELECT * FROM pragma_{pragma}('{name}')"))
                        .unwrap();
                    let n = stmt.column_count();
                    stmt.query_map([], |r| {
                        (0..n)
                            .map(|i| {
                                r.get::<_, rusqlite::types::Value>(i)
                                    .map(|v| format!("{v:?}"))
                            })
                            .collect::<rusqlite::Result<Vec<_>>>()
                            .map(|v| v.join("|"))
                    })
                    .unwrap()
                    .collect::<rusqlite::Result<_>>()
                    .unwrap()
                };
                for col in rows("table_xinfo") {
                    // Drop the cid (position).
                    let col = col.split_once('|').unwrap().1;
                    facts.insert(format!("column {name}: {col}"));
                }
                for fk in rows("foreign_key_list") {
                    let fk = fk.splitn(3, '|').nth(2).unwrap();
                    facts.insert(format!("foreign key {name}: {fk}"));
                }
                for check in checks(&sql) {
                    facts.insert(format!("check {name}: {check}"));
                }
                let mut stmt = conn
                    .prepare("SELECT name, \"unique\", origin, partial FROM pragma_index_list(?1)")
                    .unwrap();
                let indexes: Vec<(String, i64, String, i64)> = stmt
                    .query_map([&name], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                    })
                    .unwrap()
                    .collect::<rusqlite::Result<_>>()
                    .unwrap();
                for (index, unique, origin, partial) in indexes {
                    let mut stmt = conn
                        .prepare("SELECT name FROM pragma_index_info(?1) ORDER BY seqno")
                        .unwrap();
                    let cols: Vec<Option<String>> = stmt
                        .query_map([&index], |r| r.get(0))
                        .unwrap()
                        .collect::<rusqlite::Result<_>>()
                        .unwrap();
                    // A UNIQUE constraint's index is named by its position.
                    let shown = if index.starts_with("sqlite_autoindex") {
                        "(constraint)"
                    } else {
                        index.as_str()
                    };
                    facts.insert(format!(
                        "index on {name}: {shown} {cols:?} unique={unique} origin={origin} \
                         partial={partial}"
                    ));
                }
            }
            "index" => {
                if let Some((_, filter)) = sql.split_once(" WHERE ") {
                    facts.insert(format!("index {name} on {table} where {filter}"));
                }
            }
            other => {
                facts.insert(format!("{other} {name} on {table}: {sql}"));
            }
        }
    }
    facts
}

/// SQL without comments, with white space folded.
fn normalize(sql: &str) -> String {
    let without_comments: Vec<&str> = sql
        .lines()
        .map(|l| l.split_once("--").map_or(l, |(code, _)| code))
        .collect();
    let folded = without_comments
        .join(" ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    folded.replace("( ", "(").replace(" )", ")")
}

/// The CHECK (...) clauses of a CREATE TABLE.
fn checks(sql: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = sql;
    while let Some(at) = rest.find("CHECK (").or_else(|| rest.find("CHECK(")) {
        let open = at + rest[at..].find('(').unwrap();
        let mut depth = 0;
        let mut end = open;
        for (i, c) in rest[open..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        found.push(rest[open..=end].to_string());
        rest = &rest[end + 1..];
    }
    found
}

#[test]
fn schema_sql_and_the_numbered_steps_give_the_same_schema() {
    let fresh = Connection::open_in_memory().unwrap();
    fresh
        .execute_batch(&std::fs::read_to_string(SCHEMA).unwrap())
        .unwrap();
    let stepped = Connection::open_in_memory().unwrap();
    for (_, file) in migration_files() {
        stepped
            .execute_batch(&std::fs::read_to_string(&file).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    }
    let (a, b) = (schema_facts(&fresh), schema_facts(&stepped));
    assert!(a.len() > 30, "the comparison sees the schema: {a:#?}");
    assert_eq!(
        a.symmetric_difference(&b).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "schema.sql and migrations/ disagree"
    );
}

#[test]
fn a_new_database_and_a_migrated_v1_database_have_the_same_schema() {
    if support::skip_on_postgres("SQLite files and SQLite's migration steps") {
        return;
    }
    let dir = TempDir::new("mig-same");
    let fresh = dir.0.join("fresh.db");
    support::create_consumer_cli(&fresh, "someone");
    let migrated = v1_copy(&dir);
    let (code, out, err) = idem(&["migrate"], &migrated, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(user_version(&fresh), idem::store::SCHEMA_VERSION);
    assert_eq!(user_version(&migrated), idem::store::SCHEMA_VERSION);
    let fresh = schema_facts(&Connection::open(&fresh).unwrap());
    let migrated = schema_facts(&Connection::open(&migrated).unwrap());
    assert_eq!(
        fresh.symmetric_difference(&migrated).collect::<Vec<_>>(),
        Vec::<&String>::new()
    );
}

/// The requests that tests/fixtures/make_v1.sh sent, by key: the same body
/// again must replay the stored answer.
fn v1_requests(db: &Path) -> Vec<(String, String, Value)> {
    let charges = [
        (
            "ch-key-1",
            json!({"amount":1500,"currency":"BRL","source":"cash","destination":"shop","reference":"order-1","description":"coffee","metadata":{"till":"3"}}),
        ),
        (
            "ch-key-2",
            json!({"amount":990,"currency":"BRL","source":"cash","destination":"shop"}),
        ),
        (
            "ch-key-3",
            json!({"amount":1500,"currency":"BRL","source":"cash","destination":"shop","reference":"order-1","description":"coffee","metadata":{"till":"3"}}),
        ),
        (
            "ch-key-4",
            json!({"amount":999999,"currency":"BRL","source":"shop","destination":"cash"}),
        ),
        (
            "ch-key-5",
            json!({"amount":10,"currency":"BRL","source":"cash","destination":"nobody"}),
        ),
        (
            "ch-key-6",
            json!({"amount":10,"currency":"BRL","source":"usd","destination":"shop"}),
        ),
        (
            "ch-key-7",
            json!({"amount":700,"currency":"BRL","source":"cash","destination":"shop"}),
        ),
    ];
    let mut requests: Vec<(String, String, Value)> = charges
        .into_iter()
        .map(|(k, b)| (k.to_string(), "/v1/charges".to_string(), b))
        .collect();
    requests.push((
        "acct-key-1".into(),
        "/v1/accounts".into(),
        json!({"currency":"BRL"}),
    ));
    let conn = Connection::open(db).unwrap();
    for (key, body) in [
        ("re-key-1", json!({"amount":500})),
        ("re-key-2", json!({})),
        ("re-key-3", json!({"amount":100})),
    ] {
        let path: String = conn
            .query_row(
                "SELECT path FROM idempotency_keys WHERE key = ?1",
                [key],
                |r| r.get(0),
            )
            .unwrap();
        requests.push((key.into(), path, body));
    }
    requests
}

/// (status, body) stored under each key.
fn stored_answers(db: &Path) -> Vec<(String, u16, Vec<u8>)> {
    let conn = Connection::open(db).unwrap();
    let mut stmt = conn
        .prepare("SELECT key, response_status, response_body FROM idempotency_keys ORDER BY key")
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
}

#[test]
fn a_v1_database_migrates_on_serve_verifies_and_replays_byte_for_byte() {
    if support::skip_on_postgres("SQLite files and SQLite's migration steps") {
        return;
    }
    let dir = TempDir::new("mig-serve");
    let db = v1_copy(&dir);
    assert_eq!(user_version(&db), 1);
    let before = stored_answers(&db);
    assert_eq!(before.len(), 11, "the fixture holds 11 completed keys");
    let requests = v1_requests(&db);
    assert_eq!(requests.len(), before.len());

    // `idem verify` refuses to check an old schema instead of misreading it.
    let (code, out, err) = idem(&["verify"], &db, &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("schema version 1") && err.contains("idem migrate"),
        "{err}"
    );

    let server = ChildServer::start(&db, &[], &[]);
    assert_eq!(
        server.initial_key, None,
        "the v1 consumer is kept, no new key"
    );
    let key = std::fs::read_to_string(FIXTURE_KEY).unwrap();
    let client = Client::new(server.addr, key.trim());
    assert_eq!(client.balance("shop"), 1500 + 990 + 700 - 1500 - 100);
    assert_eq!(client.balance("cash"), -(1500 + 990 + 700 - 1500 - 100));
    for (key, path, body) in &requests {
        let (_, status, stored) = before.iter().find(|(k, _, _)| k == key).unwrap();
        let resp = client.post(path, Some(key), body);
        assert_eq!(resp.status, *status, "{key}");
        assert!(resp.replayed(), "{key} is a replay");
        assert_eq!(
            &resp.body,
            stored,
            "{key}: the v1 answer, byte for byte\nnow: {}\nv1:  {}",
            String::from_utf8_lossy(&resp.body),
            String::from_utf8_lossy(stored)
        );
    }
    // A v1 key with another body is still a reused key.
    let reused = client.post(
        "/v1/charges",
        Some("ch-key-2"),
        &json!({"amount":991,"currency":"BRL","source":"cash","destination":"shop"}),
    );
    assert_eq!(reused.slug(), "idempotency-key-reused");
    // And the migrated ledger takes new money.
    let fresh = client.post(
        "/v1/charges",
        Some("after-migration"),
        &json!({"amount":5,"currency":"BRL","source":"cash","destination":"shop"}),
    );
    assert_eq!(
        fresh.status,
        201,
        "{}",
        String::from_utf8_lossy(&fresh.body)
    );
    drop(server);

    assert_eq!(user_version(&db), idem::store::SCHEMA_VERSION);
    support::assert_verified(&db);
    let history: Vec<i64> = Connection::open(&db)
        .unwrap()
        .prepare("SELECT version FROM schema_migrations ORDER BY version")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    assert_eq!(
        history,
        (2..=idem::store::SCHEMA_VERSION).collect::<Vec<_>>(),
        "each step records itself; version 1 predates the record"
    );
}

#[test]
fn idem_migrate_migrates_once_and_then_has_nothing_to_do() {
    if support::skip_on_postgres("SQLite files and SQLite's migration steps") {
        return;
    }
    let dir = TempDir::new("mig-cli");
    let db = v1_copy(&dir);
    let (code, out, err) = idem(&["migrate"], &db, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!(
            "from schema version 1 to {}",
            idem::store::SCHEMA_VERSION
        )),
        "{out}"
    );
    support::assert_verified(&db);
    let (code, out, _) = idem(&["migrate"], &db, &[]);
    assert_eq!(code, 0);
    assert!(out.contains("nothing to do"), "{out}");

    // Not beneath a running server, and not on a missing file.
    let server = ChildServer::start(&db, &[], &[]);
    let (code, _, err) = idem(&["migrate"], &db, &[]);
    assert_eq!(code, 1);
    assert!(err.contains("locked by another idem serve"), "{err}");
    drop(server);
    let (code, _, err) = idem(&["migrate"], &dir.0.join("missing.db"), &[]);
    assert_eq!(code, 1);
    assert!(err.contains("no database at"), "{err}");
    assert!(
        !dir.0.join("missing.db").exists(),
        "migrate creates nothing"
    );
}

#[test]
fn a_crash_inside_a_step_leaves_the_previous_version_and_the_next_run_finishes() {
    if support::skip_on_postgres("SQLite files and SQLite's migration steps") {
        return;
    }
    let dir = TempDir::new("mig-crash");
    let db = v1_copy(&dir);
    let before = stored_answers(&db);
    for args in [&["migrate"][..], &["serve", "--addr", "127.0.0.1:0"]] {
        let (code, out, err) = idem(args, &db, &[("IDEM_FAULT", "in_migration")]);
        assert_ne!(code, 0, "{args:?} aborted: {out}{err}");
        assert!(err.contains("fault point InMigration"), "{err}");
        assert_eq!(user_version(&db), 1, "{args:?}: the step did not commit");
        let tables: i64 = Connection::open(&db)
            .unwrap()
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name = 'schema_migrations'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(tables, 0, "none of the step's SQL is visible");
        assert_eq!(stored_answers(&db), before);
    }
    let (code, out, err) = idem(&["migrate"], &db, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(user_version(&db), idem::store::SCHEMA_VERSION);
    support::assert_verified(&db);
    assert_eq!(stored_answers(&db), before);
}

#[test]
fn a_newer_database_is_refused_naming_both_versions_and_left_untouched() {
    if support::skip_on_postgres("SQLite files and SQLite's migration steps") {
        return;
    }
    let dir = TempDir::new("mig-newer");
    let db = v1_copy(&dir);
    let newer = idem::store::SCHEMA_VERSION + 1;
    {
        let conn = Connection::open(&db).unwrap();
        conn.pragma_update(None, "user_version", newer).unwrap();
        conn.execute_batch("PRAGMA journal_mode = DELETE").unwrap();
    }
    let digest = |db: &Path| {
        use sha2::{Digest, Sha256};
        Sha256::digest(std::fs::read(db).unwrap())
    };
    let before = digest(&db);
    for args in [
        &["serve", "--addr", "127.0.0.1:0"][..],
        &["migrate"],
        &["verify"],
        &["consumers", "list"],
    ] {
        let (code, out, err) = idem(args, &db, &[]);
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert!(
            err.contains(&format!("schema version {newer}"))
                && err.contains(&format!("this idem's {}", idem::store::SCHEMA_VERSION))
                && err.contains(db.to_str().unwrap()),
            "{args:?}: {err}"
        );
    }
    assert!(digest(&db) == before, "not a byte changed");
}

#[test]
fn a_backup_of_a_database_not_yet_migrated_checks_what_it_can_and_says_so() {
    if support::skip_on_postgres("SQLite files and SQLite's migration steps") {
        return;
    }
    let dir = TempDir::new("mig-backup");
    let db = v1_copy(&dir);
    let out = dir.0.join("copy.db");
    let (code, stdout, stderr) = idem(&["backup", out.to_str().unwrap()], &db, &[]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("integrity and foreign keys hold")
            && stdout.contains("schema version 1 is older"),
        "{stdout}"
    );
    assert_eq!(user_version(&db), 1, "a backup migrates nothing");
    assert_eq!(user_version(&out), 1);
    // The copy migrates and verifies like the original.
    let (code, out_text, err) = idem(&["migrate"], &out, &[]);
    assert_eq!(code, 0, "{out_text}{err}");
    support::assert_verified(&out);
}

/// Runs `idem ARGS --db DB` with the `--acquirer-store` a PostgreSQL
/// database's commands need, failing if it still runs after 30 s (a server
/// that should have refused to start would otherwise hang the test):
/// (exit code, stdout, stderr).
fn idem_within(args: &[&str], db: &Path) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args)
        .arg("--db")
        .arg(db)
        .env_remove("IDEM_FAULT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(store) = support::acquirer_store(db) {
        cmd.arg("--acquirer-store").arg(store);
    }
    let mut child = cmd.spawn().expect("run idem");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "idem {args:?} still running after 30 s; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// "table.column" for every column of schema.sql's tables, as SQLite
/// creates them.
fn sqlite_columns() -> BTreeSet<String> {
    let conn = Connection::open_in_memory().unwrap();
    conn.execute_batch(&std::fs::read_to_string(SCHEMA).unwrap())
        .unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT m.name || '.' || c.name FROM sqlite_master AS m, pragma_table_info(m.name) AS c \
             WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%'",
        )
        .unwrap();
    stmt.query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
}

/// "table.column" for every column of the PostgreSQL database `db`'s own
/// schema.
fn postgres_columns(db: &Path) -> BTreeSet<String> {
    support::inspect(db, |c| {
        c.query_all(
            "SELECT CAST(table_name AS TEXT) || '.' || CAST(column_name AS TEXT) \
             FROM information_schema.columns WHERE table_schema = current_schema()",
            &[],
            |r| r.get(0),
        )
    })
    .into_iter()
    .collect()
}

/// The columns schema_postgres.sql has and schema.sql has not: the leases
/// of servers sharing one database (a hold's expiry, a delivery).
const POSTGRES_ONLY: [&str; 3] = [
    "charges.expiry_leased_until",
    "deliveries.leased_by",
    "deliveries.leased_until",
];

/// `idem migrate --db URL` on an empty PostgreSQL database creates the
/// schema in one go (every version recorded, the tables and columns of
/// schema.sql and the leases), then has nothing to do; the new database verifies and a
/// server starts on it.
#[test]
fn idem_migrate_gives_an_empty_postgres_database_the_schema_once() {
    if !support::on_postgres() {
        eprintln!("skipped on SQLite: about a PostgreSQL --db");
        return;
    }
    let dir = TempDir::new("mig-pg-empty");
    let db = dir.db();
    assert_eq!(postgres_columns(&db), BTreeSet::new(), "an empty database");
    let (code, out, err) = idem_within(&["migrate"], &db);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!(
            "created the idem schema (version {})",
            idem::store::SCHEMA_VERSION
        )),
        "{out}"
    );
    let history = |db: &Path| -> Vec<i64> {
        support::inspect(db, |c| {
            c.query_all(
                "SELECT version FROM schema_migrations ORDER BY version",
                &[],
                |r| r.get(0),
            )
        })
    };
    assert_eq!(
        history(&db),
        (1..=idem::store::SCHEMA_VERSION).collect::<Vec<_>>()
    );
    // The tables and columns of schema.sql, and the leases that only
    // servers sharing one PostgreSQL database take.
    let columns = postgres_columns(&db);
    let leases: BTreeSet<String> = POSTGRES_ONLY.iter().map(|c| c.to_string()).collect();
    assert!(columns.is_superset(&leases), "{columns:#?}");
    let shared: BTreeSet<String> = columns.difference(&leases).cloned().collect();
    assert_eq!(
        shared
            .symmetric_difference(&sqlite_columns())
            .collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "schema_postgres.sql and schema.sql name the same tables and columns"
    );

    let (code, out, err) = idem_within(&["migrate"], &db);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!(
            "at schema version {}: nothing to do",
            idem::store::SCHEMA_VERSION
        )),
        "{out}"
    );
    assert_eq!(
        history(&db),
        (1..=idem::store::SCHEMA_VERSION).collect::<Vec<_>>()
    );
    assert_eq!(postgres_columns(&db), columns);
    support::assert_verified(&db);
    let server = ChildServer::start(&db, &[], &[]);
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
}

/// What a PostgreSQL database holds in its own schema: every relation
/// (tables, indexes, sequences) by name and kind, and the rows of
/// `invoices`.
fn postgres_contents(url: &str) -> (Vec<String>, Vec<(i64, i64)>) {
    let mut pg = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    let relations = pg
        .query(
            "SELECT relname::text || ' ' || relkind::text FROM pg_class \
             WHERE relnamespace = current_schema()::regnamespace ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let rows = pg
        .query("SELECT id, total FROM invoices ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    (relations, rows)
}

/// A PostgreSQL database that holds someone else's table is not an idem
/// database: `idem migrate`, `idem serve` and `idem consumers create` refuse
/// it saying so, `idem verify` refuses it, and not a relation or a row of
/// it changes.
#[test]
fn a_postgres_database_holding_a_foreign_table_is_refused_untouched() {
    if !support::on_postgres() {
        eprintln!("skipped on SQLite: about a PostgreSQL --db");
        return;
    }
    let dir = TempDir::new("mig-pg-foreign");
    let db = dir.db();
    let url = db.to_str().unwrap();
    postgres::Client::connect(url, postgres::NoTls)
        .unwrap()
        .batch_execute(
            "CREATE TABLE invoices (id BIGINT PRIMARY KEY, total BIGINT NOT NULL);
             INSERT INTO invoices VALUES (1, 500), (2, 700);",
        )
        .unwrap();
    let before = postgres_contents(url);
    assert_eq!(before.0, ["invoices r", "invoices_pkey i"]);
    for args in [
        &["migrate"][..],
        &["serve", "--addr", "127.0.0.1:0"],
        &["consumers", "create", "someone"],
    ] {
        let (code, out, err) = idem_within(args, &db);
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert!(
            err.contains("no idem schema_migrations table") && err.contains("not an idem database"),
            "{args:?}: {err}"
        );
        assert!(!out.contains("sk_"), "{args:?}: no key made: {out}");
    }
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1, "{report}");
    assert!(report.contains("schema version 0"), "{report}");
    assert_eq!(postgres_contents(url), before, "nothing changed");
}
