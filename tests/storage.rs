//! Storage faults: a full disk, a damaged database at startup, an online
//! backup taken while the server writes (its WAL afterwards, and backups
//! signalled, killed or running side by side), and a ledger whose balances
//! sit near the edges of i64.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags};
use serde_json::json;
use support::{charge_body, Client, Resp, TempDir};

/// Runs `idem ARGS --db DB` to completion, failing if it still runs after
/// `within`: (exit code, stdout and stderr).
fn run_idem(args: &[&str], db: &Path, within: Duration) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .arg("--db")
        .arg(db)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem");
    let deadline = Instant::now() + within;
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "idem {args:?} still running after {within:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// A read-only connection, to look at what the server wrote.
fn read_only(db: &Path) -> Connection {
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap()
}

/// A database with a few charges and a refund, written by a server that
/// then shut down cleanly (its WAL checkpointed into the file).
fn ledger_on_disk(dir: &TempDir) -> PathBuf {
    let mut config = idem::Config::new(dir.db());
    config.addr = "127.0.0.1:0".parse().unwrap();
    let server = idem::Server::start(config).unwrap();
    let client = Client::new(server.addr(), server.initial_key().unwrap());
    client.card_and_shop();
    for i in 0..20 {
        assert_eq!(
            client.charge(&format!("c{i}"), &charge_body(100)).status,
            201
        );
    }
    server.shutdown();
    dir.db()
}

#[test]
fn serve_refuses_a_database_that_breaks_a_ledger_invariant() {
    let dir = TempDir::new("startup-invariant");
    let db = ledger_on_disk(&dir);
    Connection::open(&db)
        .unwrap()
        .execute(
            "UPDATE accounts SET balance = balance + 7 WHERE public_id = 'shop'",
            [],
        )
        .unwrap();

    let (code, out) = run_idem(
        &["serve", "--addr", "127.0.0.1:0"],
        &db,
        Duration::from_secs(30),
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("refusing to serve"), "{out}");
    assert!(out.contains("balances sum to zero"), "{out}");
    assert!(out.contains("--skip-verify"), "{out}");
    assert!(!out.contains("listening on"), "{out}");

    // The escape hatch serves it, and the damage is still there to inspect.
    let child = support::ChildServer::start(&db, &["--skip-verify"], &[]);
    drop(child);
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1, "{report}");
}

#[test]
fn serve_refuses_a_database_that_fails_integrity_check() {
    let dir = TempDir::new("startup-integrity");
    let db = ledger_on_disk(&dir);
    // Overwrite the root page of an index with garbage: the tables still
    // read, but the file is damaged.
    let (root, page_size): (i64, i64) = {
        let conn = Connection::open(&db).unwrap();
        let root = conn
            .query_row(
                "SELECT rootpage FROM sqlite_schema WHERE type = 'index' \
                 AND tbl_name = 'entries' ORDER BY name LIMIT 1",
                [],
                |r| r.get(0),
            )
            .unwrap();
        let page_size = conn
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .unwrap();
        (root, page_size)
    };
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut file = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
        file.seek(SeekFrom::Start(((root - 1) * page_size) as u64))
            .unwrap();
        file.write_all(&vec![0xA5; page_size as usize]).unwrap();
        file.sync_all().unwrap();
    }

    let (code, out) = run_idem(
        &["serve", "--addr", "127.0.0.1:0"],
        &db,
        Duration::from_secs(30),
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("refusing to serve"), "{out}");
    assert!(
        out.contains("integrity_check") || out.contains("damaged"),
        "{out}"
    );
    assert!(!out.contains("listening on"), "{out}");
}

/// Sends SIGTERM to a child `idem serve` and waits for its clean exit.
fn terminate(server: support::ChildServer) {
    signal(&server.child, libc::SIGTERM);
    let status = server.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "clean shutdown");
}

/// A ledger any tenant can build with ordinary charges: two pairs of
/// accounts, each moving thousands of maximal charges, until the two credited
/// balances are each past i64::MAX / 2. Every balance is in range and they
/// sum to 0, but SQLite's running `sum(balance)` leaves i64 on the way; the
/// checks must still pass: `idem verify`, the startup check of a restart on
/// the same file, and `idem backup`'s check of its copy.
#[test]
fn a_ledger_near_the_edges_of_i64_verifies_restarts_and_backs_up() {
    let dir = TempDir::new("i64-edges");
    let db = dir.db();
    let server = support::ChildServer::start(&db, &["--synchronous", "normal"], &[]);
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    // The credited accounts first, so a running sum in rowid (or id) order
    // adds both of them before their counterparts.
    let pairs = [("a-up", "c-down"), ("b-up", "d-down")];
    for (up, _) in pairs {
        client.account(up, false);
    }
    for (_, down) in pairs {
        client.account(down, true);
    }
    let amount = idem::config::AMOUNT_MINOR_MAX;
    let per_pair = i64::MAX / 2 / amount + 5;
    let threads = 8;
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let client = client.clone();
            std::thread::spawn(move || {
                for i in (t..2 * per_pair).step_by(threads as usize) {
                    let (up, down) = pairs[(i % 2) as usize];
                    let body = json!({"amount": amount, "currency": "BRL",
                                      "source": down, "destination": up});
                    let r = client.charge(&format!("edge-{i}"), &body);
                    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    for (up, down) in pairs {
        assert_eq!(client.balance(up), per_pair * amount);
        assert_eq!(client.balance(down), -per_pair * amount);
    }
    // The case is real: SQLite's own sum of these balances overflows.
    let overflow = read_only(&db)
        .query_row("SELECT sum(balance) FROM accounts", [], |r| {
            r.get::<_, i64>(0)
        })
        .unwrap_err();
    assert!(
        overflow.to_string().contains("integer overflow"),
        "{overflow}"
    );

    terminate(server);
    support::assert_verified(&db);
    let restarted = support::ChildServer::start(&db, &[], &[]);
    let client = Client::new(restarted.addr, &client.key);
    let one = json!({"amount": 1, "currency": "BRL", "source": "c-down", "destination": "a-up"});
    assert_eq!(client.charge("after", &one).status, 201);
    let out = dir.0.join("copy.db");
    let (code, report) = run_idem(
        &["backup", out.to_str().unwrap()],
        &db,
        Duration::from_secs(60),
    );
    assert_eq!(code, 0, "{report}");
    assert!(report.contains("ok: integrity"), "{report}");
}

/// Charges that keep coming while the backup runs; the copy holds every
/// charge acknowledged before the backup started, and passes verify.
#[test]
fn online_backup_while_serving_is_consistent() {
    let dir = TempDir::new("backup");
    let (server, client) = support::server(|c| c.db = dir.db());
    let acked = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (client, acked, stop) = (client.clone(), acked.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let r = client.charge(&format!("w{w}-{i}"), &charge_body(3));
                    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
                    acked.fetch_add(1, Ordering::SeqCst);
                    i += 1;
                }
            })
        })
        .collect();
    support::eventually(Duration::from_secs(30), || {
        (acked.load(Ordering::SeqCst) >= 200).then_some(())
    });

    let out = dir.0.join("copy.db");
    let before = acked.load(Ordering::SeqCst);
    let (code, report) = run_idem(
        &["backup", out.to_str().unwrap()],
        server.db_path(),
        Duration::from_secs(60),
    );
    let after = acked.load(Ordering::SeqCst);
    assert_eq!(code, 0, "{report}");
    assert!(report.contains("ok: integrity"), "{report}");
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    assert!(
        after > before,
        "charges kept being acknowledged while idem backup ran"
    );

    support::assert_verified(&out);
    let copy = read_only(&out);
    let charges: usize = copy
        .query_row("SELECT count(*) FROM charges", [], |r| r.get(0))
        .unwrap();
    assert!(
        charges >= before,
        "copy has {charges} charges, {before} were acknowledged before it"
    );
    let mode: String = copy
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "delete", "the copy is one self-contained file");
    let leftovers: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("copy.db."))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");

    // A second backup to the same place refuses to overwrite the first.
    let (code, report) = run_idem(
        &["backup", out.to_str().unwrap()],
        server.db_path(),
        Duration::from_secs(60),
    );
    assert_eq!(code, 1, "{report}");
    assert!(report.contains("already exists"), "{report}");

    // The copy is a database idem serves (the restore path).
    drop(server);
    let restored = support::ChildServer::start(&out, &[], &[]);
    let restored_client = Client::new(restored.addr, &client.key);
    assert_eq!(restored_client.all_charges().len(), charges);
}

/// `ledger_on_disk` grown past 20 MiB with accounts whose metadata is
/// large, so that `idem backup` copies it in several steps (4 MiB each).
fn large_ledger_on_disk(dir: &TempDir) -> PathBuf {
    let db = ledger_on_disk(dir);
    let conn = Connection::open(&db).unwrap();
    conn.execute(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 24) \
         INSERT INTO accounts (consumer_id, public_id, currency, allow_negative, metadata, \
         created_at) SELECT 1, 'pad-' || i, 'BRL', 0, \
         json_object('pad', hex(randomblob(512 * 1024))), 0 FROM n",
        [],
    )
    .unwrap();
    // Each state change has its event (idem verify checks it).
    conn.execute(
        "INSERT INTO events (consumer_id, public_id, type, object_id, body, created_at) \
         SELECT 1, 'evt_' || public_id, 'account.created', public_id, '{}', 0 FROM accounts \
         WHERE public_id LIKE 'pad-%'",
        [],
    )
    .unwrap();
    drop(conn);
    assert!(std::fs::metadata(&db).unwrap().len() > 20 << 20);
    db
}

/// `idem backup OUT --db DB` as a child, each step of its copy delayed.
fn spawn_backup(db: &Path, out: &Path, step_delay: &str) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["backup", "--db"])
        .arg(db)
        .arg(out)
        .env("IDEM_BACKUP_STEP_DELAY", step_delay)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem backup")
}

/// Files in `dir` whose name starts with `prefix`, sorted.
fn files_starting(dir: &Path, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(prefix))
        .collect();
    names.sort();
    names
}

/// Waits until the backup to `out` has written part of its copy: its
/// partial file exists and holds pages. Returns the partial file's name.
fn wait_mid_copy(dir: &Path, out: &str, backup: &mut std::process::Child) -> String {
    let prefix = format!("{out}.partial-");
    support::eventually(Duration::from_secs(30), || {
        assert!(backup.try_wait().unwrap().is_none(), "the backup ended");
        files_starting(dir, &prefix).into_iter().find(|name| {
            name.len() == prefix.len() + 32
                && std::fs::metadata(dir.join(name)).is_ok_and(|m| m.len() > 0)
        })
    })
}

fn signal(child: &std::process::Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

/// Waits for a child to exit: (exit code, stdout and stderr).
fn finish(child: std::process::Child) -> (Option<i32>, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// SIGTERM or SIGINT in the middle of the copy: the backup removes its
/// partial file (and what SQLite kept beside it), writes no OUT, and exits 1
/// saying so.
#[test]
fn a_backup_stopped_by_a_signal_removes_its_partial_copy() {
    let dir = TempDir::new("backup-signal");
    let db = large_ledger_on_disk(&dir);
    // The test hook refuses what it cannot read, before anything is written.
    let (code, out) = finish(spawn_backup(&db, &dir.0.join("copy.db"), "soon"));
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("IDEM_BACKUP_STEP_DELAY"), "{out}");
    assert_eq!(files_starting(&dir.0, "copy.db"), Vec::<String>::new());

    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let mut backup = spawn_backup(&db, &dir.0.join("copy.db"), "2s");
        wait_mid_copy(&dir.0, "copy.db", &mut backup);
        signal(&backup, sig);
        let (code, out) = finish(backup);
        assert_eq!(code, Some(1), "{name}: {out}");
        assert!(
            out.contains(&format!(
                "backup interrupted by {name}: removed its partial copy"
            )),
            "{name}: {out}"
        );
        assert_eq!(files_starting(&dir.0, "copy.db"), Vec::<String>::new());
    }
}

/// A backup killed outright (SIGKILL) cannot clean up: its partial file
/// stays, and the next backup to the same OUT removes it.
#[test]
fn a_partial_copy_left_by_a_killed_backup_is_removed_by_the_next() {
    let dir = TempDir::new("backup-kill");
    let db = large_ledger_on_disk(&dir);
    let out = dir.0.join("copy.db");
    let mut backup = spawn_backup(&db, &out, "2s");
    let partial = wait_mid_copy(&dir.0, "copy.db", &mut backup);
    backup.kill().unwrap();
    backup.wait().unwrap();
    assert!(files_starting(&dir.0, "copy.db").contains(&partial));

    let (code, report) = run_idem(
        &["backup", out.to_str().unwrap()],
        &db,
        Duration::from_secs(60),
    );
    assert_eq!(code, 0, "{report}");
    assert!(
        report.contains(&format!("removed {}", dir.0.join(&partial).display())),
        "{report}"
    );
    assert_eq!(files_starting(&dir.0, "copy.db"), ["copy.db"]);
    support::assert_verified(&out);
}

/// Two backups of one OUT at once: the second never touches the partial
/// file of the first, which is still copying; that one still cleans up.
#[test]
fn a_backup_leaves_the_partial_copy_of_a_running_backup_alone() {
    let dir = TempDir::new("backup-concurrent");
    let db = large_ledger_on_disk(&dir);
    let out = dir.0.join("copy.db");
    let mut first = spawn_backup(&db, &out, "3s");
    let partial = wait_mid_copy(&dir.0, "copy.db", &mut first);
    let before = files_starting(&dir.0, &partial);

    let (code, report) = run_idem(
        &["backup", out.to_str().unwrap()],
        &db,
        Duration::from_secs(60),
    );
    assert_eq!(code, 0, "{report}");
    assert!(!report.contains("removed"), "{report}");
    assert!(first.try_wait().unwrap().is_none(), "the first is running");
    assert_eq!(
        files_starting(&dir.0, &partial),
        before,
        "the first backup's files are untouched"
    );

    signal(&first, libc::SIGTERM);
    let (code, report) = finish(first);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(files_starting(&dir.0, "copy.db"), ["copy.db"]);
    support::assert_verified(&out);
}

/// A signal while the finished copy is being verified interrupts the
/// check: the copy stays (it is complete and durable), and the backup exits
/// 1 saying it is unverified.
#[test]
fn a_signal_while_verifying_the_copy_interrupts_the_check() {
    let dir = TempDir::new("backup-verify-signal");
    let db = ledger_on_disk(&dir);
    // Enough charges that checking them takes a while (about 2 s in a debug
    // build): 50,000 more, balanced, written with SQL.
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch(
        "BEGIN;
         CREATE TEMP TABLE n AS WITH RECURSIVE n(i) AS \
           (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 50000) SELECT i FROM n;
         INSERT INTO charges (consumer_id, public_id, amount, currency, source_id, \
           destination_id, metadata, fingerprint, op_id, idempotency_key, authorization_id, \
           created_at, status, amount_captured) SELECT 1, 'ch_bulk' || i, 1, 'BRL', \
           (SELECT id FROM accounts WHERE public_id = 'card'), \
           (SELECT id FROM accounts WHERE public_id = 'shop'), '{}', zeroblob(32), \
           'op_bulk' || i, 'bulk-' || i, 'auth_bulk' || i, 0, 'succeeded', 1 FROM n;
         INSERT INTO entries (public_id, account_id, amount, charge_id, created_at) \
           SELECT 'evt_bulk_d' || id, source_id, -amount, id, 0 FROM charges \
           WHERE public_id LIKE 'ch_bulk%' UNION ALL \
           SELECT 'evt_bulk_c' || id, destination_id, amount, id, 0 FROM charges \
           WHERE public_id LIKE 'ch_bulk%';
         UPDATE accounts SET balance = balance - 50000 WHERE public_id = 'card';
         UPDATE accounts SET balance = balance + 50000 WHERE public_id = 'shop';
         COMMIT;",
    )
    .unwrap();
    drop(conn);

    let out = dir.0.join("copy.db");
    let mut backup = spawn_backup(&db, &out, "0ms");
    support::eventually(Duration::from_secs(30), || {
        assert!(backup.try_wait().unwrap().is_none(), "the backup ended");
        out.exists().then_some(())
    });
    signal(&backup, libc::SIGTERM);
    let (code, report) = finish(backup);
    assert_eq!(code, Some(1), "{report}");
    assert!(
        report.contains("interrupted by SIGTERM; the copy is complete but unverified"),
        "{report}"
    );
    assert_eq!(files_starting(&dir.0, "copy.db"), ["copy.db"]);
    let charges: i64 = read_only(&out)
        .query_row("SELECT count(*) FROM charges", [], |r| r.get(0))
        .unwrap();
    assert_eq!(charges, 20 + 50_000, "the copy is complete");
}

/// Size of a database's `-wal` file (0 if there is none).
fn wal_size(db: &Path) -> u64 {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(PathBuf::from(wal)).map_or(0, |m| m.len())
}

/// While `idem backup` holds its snapshot, no checkpoint can reset the WAL
/// and every commit makes it longer; once the backup ends and a few more
/// commits come in, the file is cut back to `WAL_SIZE_LIMIT_BYTES` instead
/// of staying at its high-water mark until shutdown.
#[test]
fn the_wal_shrinks_back_after_a_backup_under_load() {
    let limit = u64::try_from(idem::config::WAL_SIZE_LIMIT_BYTES).unwrap();
    let dir = TempDir::new("backup-wal");
    let (server, client) = support::server(|c| c.db = dir.db());
    let db = server.db_path().to_path_buf();
    let acked = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (client, acked, stop) = (client.clone(), acked.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let r = client.charge(&format!("w{w}-{i}"), &charge_body(3));
                    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
                    acked.fetch_add(1, Ordering::SeqCst);
                    i += 1;
                }
            })
        })
        .collect();
    support::eventually(Duration::from_secs(30), || {
        (acked.load(Ordering::SeqCst) >= 100).then_some(())
    });

    // The backup holds its snapshot (before its first step) until the WAL
    // has grown well past the limit, then ends.
    let mut backup = spawn_backup(&db, &dir.0.join("copy.db"), "120s");
    support::eventually(Duration::from_secs(60), || {
        assert!(backup.try_wait().unwrap().is_none(), "the backup ended");
        (wal_size(&db) > 2 * limit).then_some(())
    });
    signal(&backup, libc::SIGTERM);
    let (code, out) = finish(backup);
    assert_eq!(code, Some(1), "{out}");

    let ended = acked.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(15);
    while wal_size(&db) > limit {
        assert!(
            Instant::now() < deadline,
            "the WAL is still {} bytes 15 s after the backup ended (limit {limit}), \
             {} charges later",
            wal_size(&db),
            acked.load(Ordering::SeqCst) - ended
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    assert!(acked.load(Ordering::SeqCst) > ended, "writes went on");
    assert!(wal_size(&db) <= limit, "WAL is {} bytes", wal_size(&db));
    server.shutdown();
    support::assert_verified(&db);
}

/// Runs this test binary again on one test, where `mount` cannot be found
/// (as on a machine where mounting is not allowed): (success, output).
fn run_without_mount(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(args)
        .env("PATH", "/nonexistent")
        .env_remove("IDEM_TEST_REQUIRE_MOUNT")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// A disk-full test on a machine that cannot mount its tmpfs is reported
/// as ignored by `cargo test`, never as passed; run on purpose there (as
/// `.ci/run` does where `IDEM_TEST_REQUIRE_MOUNT` is set), it fails and
/// says why.
#[test]
fn disk_full_tests_that_cannot_mount_are_ignored_or_fail_never_pass() {
    for name in DISK_FULL_TESTS {
        let (ok, out) = run_without_mount(&["--exact", name], &[]);
        assert!(ok, "{out}");
        assert!(
            out.contains(&format!("test {name} ... ignored, {NEEDS_MOUNT}"))
                && out.contains("0 passed; 0 failed; 1 ignored"),
            "{out}"
        );
        for env in [&[("IDEM_TEST_REQUIRE_MOUNT", "1")][..], &[]] {
            let (ok, out) = run_without_mount(&["--ignored", "--exact", name], env);
            assert!(!ok, "{env:?}: {out}");
            assert!(
                out.contains(&format!("test {name} ... FAILED"))
                    && out.contains("cannot mount a tmpfs"),
                "{env:?}: {out}"
            );
        }
    }
}

/// Why the disk-full tests are `#[ignore]`d: a plain `cargo test` lists
/// them as ignored, wherever it runs, instead of passing without running.
/// Where a tmpfs can be mounted, `.ci/run` runs them in a pass of their own.
const NEEDS_MOUNT: &str =
    "needs root to mount a tmpfs; as root: cargo test --test storage -- --ignored";

/// The disk-full tests, which mount a tmpfs.
const DISK_FULL_TESTS: [&str; 2] = [
    "a_full_disk_answers_503_changes_nothing_and_retries_succeed_once_space_returns",
    "a_disk_that_fills_mid_charge_leaves_a_resumable_key",
];

/// A size-limited tmpfs mounted for one test, unmounted on drop.
struct SmallFs(PathBuf);

impl SmallFs {
    /// Mounts it, or fails the test: a disk-full test that cannot fill a
    /// disk has not passed. (They are `#[ignore]`d for that reason, and run
    /// only when asked for, where a tmpfs can be mounted.)
    fn mount(dir: &TempDir, size: &str) -> SmallFs {
        let path = dir.0.join("fs");
        std::fs::create_dir_all(&path).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .stderr(Stdio::piped())
            .output();
        match status {
            Ok(out) if out.status.success() => SmallFs(path),
            other => panic!("cannot mount a tmpfs ({NEEDS_MOUNT}): {other:?}"),
        }
    }

    /// A server on a database in this filesystem, with the accounts `card`
    /// and `shop`: a key left locked by a failed unlock is an orphan after
    /// 300 ms, and only a retry (not the reaper) takes it over.
    fn server(&self, configure: impl FnOnce(&mut idem::Config)) -> (idem::Server, Client) {
        let mut config = idem::Config::new(self.0.join("idem.db"));
        config.addr = "127.0.0.1:0".parse().unwrap();
        config.inflight_timeout = Duration::from_millis(300);
        config.reaper_interval = Duration::from_secs(3600);
        configure(&mut config);
        let server = idem::Server::start(config).unwrap();
        let client = Client::new(server.addr(), server.initial_key().unwrap());
        client.card_and_shop();
        (server, client)
    }

    /// Writes a file until the filesystem is full.
    fn fill(&self) -> PathBuf {
        fill(&self.0)
    }
}

/// Writes `dir/filler` until the filesystem holding `dir` is full.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path).unwrap();
    let chunk = vec![0u8; 4096];
    loop {
        match file.write_all(&chunk) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
            Err(e) => panic!("filling the disk: {e}"),
        }
    }
    let _ = file.sync_all();
    path
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn assert_unavailable(r: &Resp, what: &str) {
    assert_eq!(
        r.status,
        503,
        "{what}: {}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(r.slug(), "temporarily-unavailable", "{what}");
    assert!(
        r.header("content-type")
            .is_some_and(|t| t.starts_with("application/problem+json")),
        "{what}"
    );
    assert!(r.header("retry-after").is_some(), "{what}: no Retry-After");
}

#[test]
#[ignore = "needs root to mount a tmpfs; as root: cargo test --test storage -- --ignored"]
fn a_full_disk_answers_503_changes_nothing_and_retries_succeed_once_space_returns() {
    let dir = TempDir::new("disk-full");
    let fs = SmallFs::mount(&dir, "6m");
    let (server, client) = fs.server(|_| {});
    let first = client.charge("before", &charge_body(1000));
    assert_eq!(first.status, 201);
    let first_id = first.json()["id"].as_str().unwrap().to_string();

    let filler = fs.fill();

    // Charges (several at once, as terminals would send them) until the
    // disk refuses: every one either succeeds whole or is told 503.
    let mut refused: Vec<(String, i64)> = Vec::new();
    let mut succeeded: Vec<(String, i64, Resp)> = Vec::new();
    let mut round = 0;
    while refused.len() < 8 {
        assert!(round < 200, "the full disk never refused a write");
        let barrier = Arc::new(Barrier::new(4));
        let answers: Vec<_> = (0..4)
            .map(|t| {
                let (client, barrier) = (client.clone(), barrier.clone());
                let key = format!("full-{round}-{t}");
                let amount = 10 + t;
                std::thread::spawn(move || {
                    barrier.wait();
                    let r = client.charge(&key, &charge_body(amount));
                    (key, amount, r)
                })
            })
            .collect();
        for a in answers {
            let (key, amount, r) = a.join().unwrap();
            match r.status {
                201 => succeeded.push((key, amount, r)),
                _ => {
                    assert_unavailable(&r, &key);
                    refused.push((key, amount));
                }
            }
        }
        round += 1;
    }
    // Other writes are refused the same way, with nothing half-done.
    let account = client.post(
        "/v1/accounts",
        None,
        &json!({"id": "new", "currency": "BRL", "allow_negative": false}),
    );
    assert_unavailable(&account, "create account");

    // Reads keep working on the full disk.
    assert_eq!(client.get("/healthz").status, 200);
    assert_eq!(client.get(&format!("/v1/charges/{first_id}")).status, 200);
    assert_eq!(client.get("/v1/accounts/new").status, 404);
    let shop_while_full = client.balance("shop");
    let acknowledged: i64 = 1000 + succeeded.iter().map(|(_, a, _)| a).sum::<i64>();
    assert_eq!(
        shop_while_full, acknowledged,
        "only acknowledged charges moved money"
    );
    // No refused key is completed without its charge, nor has a charge.
    {
        let conn = read_only(server.db_path());
        for (key, _) in &refused {
            let charges: i64 = conn
                .query_row(
                    "SELECT count(*) FROM charges WHERE idempotency_key = ?1",
                    [key],
                    |r| r.get(0),
                )
                .unwrap();
            assert_eq!(charges, 0, "{key} was refused but has a charge");
            let completed: i64 = conn
                .query_row(
                    "SELECT count(*) FROM idempotency_keys WHERE key = ?1 AND state = 'completed'",
                    [key],
                    |r| r.get(0),
                )
                .unwrap();
            assert_eq!(completed, 0, "{key} was refused but is completed");
        }
    }

    // Space comes back: the same retries succeed, each exactly once.
    std::fs::remove_file(filler).unwrap();
    for (key, amount) in &refused {
        let r = support::eventually(Duration::from_secs(20), || {
            let r = client.charge(key, &charge_body(*amount));
            match r.status {
                201 => Some(r),
                409 | 503 => None,
                _ => panic!("{key}: {} {}", r.status, String::from_utf8_lossy(&r.body)),
            }
        });
        let replay = client.charge(key, &charge_body(*amount));
        assert_eq!(replay.status, 201);
        assert!(replay.replayed());
        assert_eq!(replay.body, r.body, "{key}: the replay is the first answer");
    }
    for (key, amount, first) in &succeeded {
        let replay = client.charge(key, &charge_body(*amount));
        assert_eq!(replay.body, first.body, "{key}");
    }
    let total: i64 = acknowledged + refused.iter().map(|(_, a)| a).sum::<i64>();
    assert_eq!(
        client.balance("shop"),
        total,
        "every charge moved money once"
    );
    let conn = read_only(server.db_path());
    let (charges, keys): (i64, i64) = conn
        .query_row(
            "SELECT count(*), count(DISTINCT idempotency_key) FROM charges",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(charges, keys, "one charge per key");
    assert_eq!(charges as usize, 1 + succeeded.len() + refused.len());
    let db = server.db_path().to_path_buf();
    drop(conn);
    server.shutdown();
    support::assert_verified(&db);
    drop(fs);
}

/// The disk fills between the acquirer's authorisation and the ledger phase:
/// the charge is told 503, its key stays `reserved` and unlocked (a
/// charge's authorization is recorded with the ledger phase, not before),
/// and once space returns the retry asks the acquirer again under the same
/// key and finishes it with the same authorisation, once.
#[test]
#[ignore = "needs root to mount a tmpfs; as root: cargo test --test storage -- --ignored"]
fn a_disk_that_fills_mid_charge_leaves_a_resumable_key() {
    let dir = TempDir::new("disk-full-mid");
    let fs = SmallFs::mount(&dir, "6m");
    let mount = fs.0.clone();
    let filled = Arc::new(std::sync::Mutex::new(None::<PathBuf>));
    let hook_filled = filled.clone();
    let fired = AtomicBool::new(false);
    let (server, client) = fs.server(|config| {
        config.hooks.before_ledger_phase = Some(Arc::new(move |_op: &str| {
            if !fired.swap(true, Ordering::SeqCst) {
                *hook_filled.lock().unwrap() = Some(fill(&mount));
            }
        }));
    });

    let r = client.charge("mid", &charge_body(250));
    assert_unavailable(&r, "charge with the disk filling mid-way");
    assert_eq!(client.balance("shop"), 0, "no money moved");
    let conn = read_only(server.db_path());
    let (state, point, op_id): (String, String, String) = conn
        .query_row(
            "SELECT state, recovery_point, op_id FROM idempotency_keys WHERE key = 'mid'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(
        (state.as_str(), point.as_str()),
        ("in_progress", "reserved")
    );
    let authorization = idem::acquirer::support::authorizations(server.db_path())
        .unwrap()
        .into_iter()
        .find(|a| a.key == op_id)
        .expect("the acquirer authorised before the disk filled")
        .id;

    std::fs::remove_file(filled.lock().unwrap().take().unwrap()).unwrap();
    let done = support::eventually(Duration::from_secs(20), || {
        let r = client.charge("mid", &charge_body(250));
        match r.status {
            201 => Some(r),
            409 | 503 => None,
            _ => panic!("{} {}", r.status, String::from_utf8_lossy(&r.body)),
        }
    });
    assert_eq!(done.json()["amount"], json!(250));
    assert_eq!(client.balance("shop"), 250);
    let (charges, authorized_as): (i64, String) = conn
        .query_row(
            "SELECT count(*), max(authorization_id) FROM charges",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(charges, 1);
    assert_eq!(
        authorized_as, authorization,
        "the retry reused the first authorisation"
    );
    let db = server.db_path().to_path_buf();
    drop(conn);
    server.shutdown();
    support::assert_verified(&db);
}
