//! The command line: help and usage errors, consumers, verify, the process
//! lock, signals and a clean shutdown that finishes in-flight requests.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::{charge_body, ChildServer, Client, TempDir};

fn idem(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("IDEM_DB")
        .output()
        .expect("run idem")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `--acquirer-store FILE` for a PostgreSQL `db` (what `serve`, `verify`
/// and `keys` need there, so that they fail for the reason a test means and
/// not for its absence); nothing beside an SQLite file.
fn store_args(db: &Path) -> Vec<String> {
    support::acquirer_store(db)
        .map(|p| vec!["--acquirer-store".into(), p.to_str().unwrap().into()])
        .unwrap_or_default()
}

/// `args` followed by `--db DB` and its [`store_args`].
fn on_db<'a>(db: &'a Path, args: &[&'a str], store: &'a [String]) -> Vec<&'a str> {
    let mut all = args.to_vec();
    all.extend(["--db", db.to_str().unwrap()]);
    all.extend(store.iter().map(String::as_str));
    all
}

/// The tables of a PostgreSQL database's public schema.
fn pg_tables(db: &Path) -> i64 {
    support::inspect(db, |c| {
        c.query_value(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'",
            &[],
        )
    })
}

/// Whether anything of the database `db` was created: the SQLite file, or
/// (the test's PostgreSQL database always exists, empty) a table in it or
/// its simulator's file.
fn created(db: &Path) -> bool {
    match support::acquirer_store(db) {
        None => db.exists(),
        Some(store) => store.exists() || pg_tables(db) > 0,
    }
}

/// Makes `db`'s schema version `version`, as a newer idem would have: in
/// SQLite's `user_version`, or a row of PostgreSQL's `schema_migrations`.
fn set_schema_version(db: &Path, version: i64) {
    match db.to_str().filter(|_| support::on_postgres()) {
        Some(url) => {
            postgres::Client::connect(url, postgres::NoTls)
                .unwrap()
                .execute(
                    "INSERT INTO schema_migrations (version, name, applied_at, applied_by) \
                     VALUES ($1, 'from the future', 0, 'a test')",
                    &[&version],
                )
                .unwrap();
        }
        None => rusqlite::Connection::open(db)
            .unwrap()
            .pragma_update(None, "user_version", version)
            .unwrap(),
    }
}

#[test]
fn every_command_has_help_and_bad_usage_exits_2() {
    for args in [
        &["--help"][..],
        &["serve", "--help"],
        &["consumers", "--help"],
        &["consumers", "create", "--help"],
        &["consumers", "list", "--help"],
        &["verify", "--help"],
    ] {
        let out = idem(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(text(&out.stdout).contains("Usage: idem"), "{args:?}");
    }
    let serve_help = text(&idem(&["serve", "--help"]).stdout);
    for flag in [
        "--db",
        "--addr",
        "--workers",
        "--key-retention",
        "--inflight-timeout",
        "--reaper-interval",
        "--acquirer-latency",
        "--synchronous",
        "--commit-batch-max",
        "--acquirer-timeout",
        "IDEM_KEY_RETENTION",
        "IDEM_ACQUIRER_TIMEOUT",
    ] {
        assert!(serve_help.contains(flag), "serve --help lacks {flag}");
    }
    for args in [
        &["frobnicate"][..],
        &["serve", "--key-retention", "5w"],
        &["serve", "--inflight-timeout", "10"],
        &["serve", "--workers", "0"],
        &["serve", "--synchronous", "off"],
        &["serve", "--reaper-interval", "0s"],
        &["serve", "--inflight-timeout", "0ms"],
        &["serve", "--key-retention", "0s"],
        &["serve", "--acquirer-timeout", "0ms"],
        &["serve", "--acquirer-timeout", "soon"],
        &["consumers", "create"],
    ] {
        let out = idem(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn consumers_create_prints_the_key_once_and_stores_only_its_hash() {
    let dir = TempDir::new("consumers");
    let db = dir.db();
    let db_arg = db.to_str().unwrap();
    let key = support::create_consumer_cli(&db, "pos-7");
    assert!(key.starts_with("sk_") && key.len() >= 60, "{key}");
    let list = idem(&["consumers", "list", "--db", db_arg]);
    assert_eq!(list.status.code(), Some(0));
    let listed = text(&list.stdout);
    assert!(listed.contains("pos-7"));
    assert!(!listed.contains("sk_"), "list never shows keys");
    let dup = idem(&["consumers", "create", "pos-7", "--db", db_arg]);
    assert_eq!(dup.status.code(), Some(1));
    assert!(text(&dup.stderr).contains("already exists"));
    let bad = idem(&["consumers", "create", "no spaces", "--db", db_arg]);
    assert_eq!(bad.status.code(), Some(2), "a bad name is bad usage");
    // Only the hash is on disk (database and WAL).
    let secret = &key.as_bytes()[3..];
    for file in [db.clone(), db.with_extension("db-wal")] {
        let bytes = std::fs::read(&file).unwrap_or_default();
        assert!(
            !bytes.windows(secret.len()).any(|w| w == secret),
            "key in {file:?}"
        );
    }
    // Only the hash is in the PostgreSQL database: every column of the
    // consumer's row, as text (a blob in hex).
    if let Some(url) = db.to_str().filter(|_| support::on_postgres()) {
        let rows = postgres::Client::connect(url, postgres::NoTls)
            .unwrap()
            .query("SELECT c::text FROM consumers c", &[])
            .unwrap();
        assert_eq!(rows.len(), 1);
        let secret = std::str::from_utf8(secret).unwrap();
        let hex: String = secret.bytes().map(|b| format!("{b:02x}")).collect();
        for row in rows {
            let row: String = row.get(0);
            assert!(!row.contains(secret) && !row.contains(&hex), "key in {row}");
        }
    }
    // The key works against a server on that database.
    let server = ChildServer::start(&db, &[], &[]);
    assert!(
        server.initial_key.is_none(),
        "no default consumer when one exists"
    );
    let client = Client::new(server.addr, &key);
    assert_eq!(client.get("/v1/charges").status, 200);
}

/// A read command on a database that is not there says so and creates
/// nothing. On PostgreSQL the test's database exists, empty: what is missing
/// is idem's schema; and a mistyped database name is refused by the server,
/// with its reason.
#[test]
fn read_commands_report_a_missing_database() {
    let dir = TempDir::new("verify-missing");
    let db = dir.db();
    let store = store_args(&db);
    let says = if support::on_postgres() {
        "no idem schema"
    } else {
        "no database"
    };
    let commands = [&["verify"][..], &["consumers", "list"]];
    for command in commands {
        let args = on_db(&db, command, &store);
        let out = idem(&args);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
    assert!(!created(&db), "a mistyped --db creates nothing");

    let Some(url) = db.to_str().filter(|_| support::on_postgres()) else {
        return;
    };
    let typo = format!("{url}_typo");
    for command in commands {
        let args = on_db(Path::new(&typo), command, &store);
        let started = std::time::Instant::now();
        let out = idem(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains("cannot connect to PostgreSQL") && stderr.contains("does not exist"),
            "PostgreSQL's reason is given: {stderr}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "refused at once, not after a pool's timeout: {:?}",
            started.elapsed()
        );
    }
    let name = typo.rsplit('/').next().unwrap();
    let admin = support::postgres_admin().unwrap();
    let databases: i64 = postgres::Client::connect(&admin, postgres::NoTls)
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&name],
        )
        .unwrap()
        .get(0);
    assert_eq!(databases, 0, "the mistyped database is not created");
    assert!(!created(&db));
}

#[test]
fn serve_refuses_what_it_cannot_run_on() {
    let dir = TempDir::new("refuse");
    let db = dir.db();
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--db", ":memory:", "--addr", "127.0.0.1:0"])
        .current_dir(&dir.0)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains(":memory:"));
    assert_eq!(
        std::fs::read_dir(&dir.0).unwrap().count(),
        0,
        "nothing created"
    );
    let store = store_args(&db);
    let fault = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(on_db(&db, &["serve", "--addr", "127.0.0.1:0"], &store))
        .env("IDEM_FAULT", "nowhere")
        .output()
        .unwrap();
    assert_eq!(fault.status.code(), Some(2), "{}", text(&fault.stderr));
    assert!(
        text(&fault.stderr).contains("IDEM_FAULT"),
        "{}",
        text(&fault.stderr)
    );

    let first = ChildServer::start(&db, &[], &[]);
    if support::on_postgres() {
        // PostgreSQL is shared: a second server starts beside the first,
        // and the first's consumer is known to it.
        let second = ChildServer::start(&db, &[], &[]);
        assert_eq!(second.initial_key, None, "one default consumer");
        let key = first.initial_key.as_deref().expect("the first start's key");
        assert_eq!(Client::new(second.addr, key).get("/v1/charges").status, 200);
        second.kill();
    } else {
        let second = idem(&on_db(&db, &["serve", "--addr", "127.0.0.1:0"], &store));
        assert_eq!(second.status.code(), Some(1));
        assert!(
            text(&second.stderr).contains("locked by another idem serve"),
            "{}",
            text(&second.stderr)
        );
    }
    first.kill();

    set_schema_version(&db, 99);
    let newer = idem(&on_db(&db, &["serve", "--addr", "127.0.0.1:0"], &store));
    assert_eq!(newer.status.code(), Some(1), "{}", text(&newer.stderr));
    let stderr = text(&newer.stderr);
    assert!(
        stderr.contains("newer") && stderr.lines().count() == 1,
        "{stderr}"
    );
}

/// Runs `idem serve` on a fresh database with `args` and `env`; returns its
/// exit code (`None`: still running after 10 s, then killed), its stderr,
/// and whether the directory (and the database) is still empty.
fn serve_once(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, bool) {
    let dir = TempDir::new("serve-once");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--addr", "127.0.0.1:0", "--db"])
        .arg(dir.db())
        .args(store_args(&dir.db()))
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let empty = std::fs::read_dir(&dir.0).unwrap().count() == 0 && !created(&dir.db());
    (code, stderr, empty)
}

/// Flags and environment variables of one `idem serve`.
type ServeCase<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);

/// `--acquirer-timeout` must fit in `--inflight-timeout` with half of it to
/// spare, from flags or environment: otherwise exit 2, before anything is
/// created, with one line naming both flags. The largest that fits starts.
#[test]
fn serve_refuses_an_acquirer_timeout_that_does_not_fit() {
    let cases: &[ServeCase] = &[
        (&["--acquirer-timeout", "31s"], &[]),
        (
            &["--inflight-timeout", "1s", "--acquirer-timeout", "501ms"],
            &[],
        ),
        (
            &["--inflight-timeout", "1s"],
            &[("IDEM_ACQUIRER_TIMEOUT", "600ms")],
        ),
        (
            &[],
            &[
                ("IDEM_INFLIGHT_TIMEOUT", "10s"),
                ("IDEM_ACQUIRER_TIMEOUT", "6s"),
            ],
        ),
    ];
    for (args, env) in cases {
        let (code, stderr, empty) = serve_once(args, env);
        assert_eq!(code, Some(2), "{args:?} {env:?}: {stderr}");
        assert!(
            stderr.contains("--acquirer-timeout")
                && stderr.contains("--inflight-timeout")
                && stderr.trim().lines().count() == 1,
            "{args:?} {env:?}: {stderr}"
        );
        assert!(empty, "{args:?} {env:?}: nothing created");
    }
    let dir = TempDir::new("acquirer-timeout-fits");
    let fits = ChildServer::start(
        &dir.db(),
        &["--inflight-timeout", "1s", "--acquirer-timeout", "500ms"],
        &[],
    );
    fits.kill();
}

#[test]
fn environment_variables_configure_serve() {
    let dir = TempDir::new("env");
    let db = dir.db();
    let mut serve = Command::new(env!("CARGO_BIN_EXE_idem"));
    serve
        .arg("serve")
        .env("IDEM_DB", &db)
        .env("IDEM_ADDR", "127.0.0.1:0")
        .stderr(std::process::Stdio::piped());
    if let Some(store) = support::acquirer_store(&db) {
        serve.env("IDEM_ACQUIRER_STORE", store);
    }
    let out = serve.env("IDEM_KEY_RETENTION", "bogus").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "IDEM_KEY_RETENTION is read");
    assert!(text(&out.stderr).contains("bogus"), "{}", text(&out.stderr));
    assert!(!created(&db));
    let s = ChildServer::start(&db, &[], &[("IDEM_ACQUIRER_LATENCY", "1ms")]);
    assert!(created(&db), "IDEM_DB/--db names the database");
    assert!(
        s.initial_key.is_some(),
        "first start creates the default consumer"
    );
}

/// SIGTERM (and SIGINT): stop accepting, finish the request in flight, exit 0.
#[test]
fn sigterm_finishes_in_flight_requests_and_exits_0() {
    for signal in ["TERM", "INT"] {
        let dir = TempDir::new("sigterm");
        let db = dir.db();
        let server = ChildServer::start(&db, &["--acquirer-latency", "800ms"], &[]);
        let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
        client.card_and_shop();
        let c = client.clone();
        let in_flight = std::thread::spawn(move || c.charge("bye", &charge_body(10)));
        support::wait_for_key(&db, "bye");
        let pid = server.child.id().to_string();
        assert!(Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap()
            .success());
        let answered = in_flight.join().unwrap();
        assert_eq!(
            answered.status, 201,
            "SIG{signal}: the in-flight charge was finished"
        );
        let status = server.wait_exit(Duration::from_secs(10));
        assert_eq!(status.code(), Some(0), "SIG{signal}: clean shutdown");
        support::assert_verified(&db);
        let n: i64 = support::inspect(&db, |c| c.query_value("SELECT count(*) FROM charges", &[]));
        assert_eq!(n, 1);
    }
}

/// Runs `prlimit --nofile=SOFT:HARD idem serve` until it listens; returns
/// its stderr up to "listening on" and its soft descriptor limit as the
/// kernel reports it then.
fn serve_with_nofile(soft: u32, hard: u32) -> (String, u64) {
    use std::io::{BufRead, BufReader};
    let dir = TempDir::new("nofile");
    let mut child = Command::new("prlimit")
        .arg(format!("--nofile={soft}:{hard}"))
        .arg(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--addr", "127.0.0.1:0", "--db"])
        .arg(dir.db())
        .args(store_args(&dir.db()))
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("prlimit (util-linux) runs idem serve");
    let mut seen = String::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with("listening on") {
            break;
        }
    }
    assert!(seen.contains("listening on"), "idem serve started: {seen}");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|soft| soft.parse().ok())
        .expect("Max open files in /proc/PID/limits");
    (seen, open_files)
}

/// `idem serve` raises its soft descriptor limit to the hard one, and warns
/// when even that cannot hold `--connections-max` and its own files.
#[test]
fn serve_budgets_file_descriptors() {
    let (stderr, soft) = serve_with_nofile(256, 8192);
    assert_eq!(soft, 8192, "soft limit raised to the hard one");
    assert!(!stderr.contains("descriptor limit"), "{stderr}");

    let (stderr, soft) = serve_with_nofile(256, 256);
    assert_eq!(soft, 256);
    assert!(
        stderr.contains("the descriptor limit is 256") && stderr.contains("--connections-max"),
        "{stderr}"
    );
}

/// `idem serve --db DB ARGS`, run to its exit (for starts that must fail).
fn serve_on(db: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("serve")
        .arg("--db")
        .arg(db)
        .args(store_args(db))
        .args(args)
        .env_remove("IDEM_FAULT")
        .output()
        .expect("run idem serve")
}

fn consumer_count(db: &std::path::Path) -> i64 {
    support::inspect(db, |c| c.query_value("SELECT count(*) FROM consumers", &[]))
}

#[test]
fn a_first_start_that_cannot_listen_creates_no_default_consumer() {
    let dir = TempDir::new("first-start");
    let db = dir.db();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = serve_on(&db, &["--addr", &addr]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("sk_"), "no key was shown: {stderr}");
    assert_eq!(
        consumer_count(&db),
        0,
        "a key nobody saw would make the default consumer unusable"
    );
    drop(taken);
    // The next start that can listen creates it and shows its key once.
    let server = ChildServer::start(&db, &[], &[]);
    let key = server.initial_key.clone().expect("the key is shown now");
    assert_eq!(
        Client::new(server.addr, &key).get("/v1/charges").status,
        200
    );
    server.kill();
    let again = ChildServer::start(&db, &[], &[]);
    assert_eq!(again.initial_key, None, "never shown twice");
    assert_eq!(consumer_count(&db), 1);
}

/// Runs `idem ARGS` as an unprivileged user when the tests run as root
/// (root writes anywhere), so that a read-only directory is read-only.
fn idem_unprivileged(args: &[&str]) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args).env_remove("IDEM_DB");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.uid(65534).gid(65534);
    }
    cmd.output().expect("run idem")
}

#[test]
fn database_paths_that_cannot_work_are_named_with_what_to_do() {
    let dir = TempDir::new("db-paths");
    let missing_dir = dir.0.join("no/such/dir/x.db");
    let out = serve_on(&missing_dir, &["--addr", "127.0.0.1:0"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains(missing_dir.to_str().unwrap())
            && err.contains("does not exist")
            && err.contains("mkdir -p"),
        "{err}"
    );
    assert!(!dir.0.join("no").exists(), "nothing created");

    // A directory the server's user cannot write to.
    let locked = dir.0.join("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
    let db = locked.join("x.db");
    let out = idem_unprivileged(&[
        "serve",
        "--db",
        db.to_str().unwrap(),
        "--addr",
        "127.0.0.1:0",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains(db.to_str().unwrap()) && err.contains("not writable"),
        "{err}"
    );

    // A file that is not a database, and one that is someone else's.
    let garbage = dir.0.join("notes.db");
    std::fs::write(&garbage, "these are my notes, not a database ".repeat(40)).unwrap();
    let foreign = dir.0.join("theirs.db");
    rusqlite::Connection::open(&foreign)
        .unwrap()
        .execute_batch("CREATE TABLE photos (id INTEGER PRIMARY KEY, path TEXT)")
        .unwrap();
    let foreign_before = std::fs::read(&foreign).unwrap();
    for (db, says) in [
        (&garbage, "not an SQLite database"),
        (&foreign, "not an idem database"),
    ] {
        let out = serve_on(db, &["--addr", "127.0.0.1:0"]);
        assert_eq!(out.status.code(), Some(1));
        let err = text(&out.stderr);
        assert!(
            err.contains(db.to_str().unwrap()) && err.contains(says),
            "{err}"
        );
        let out = idem(&["consumers", "create", "x", "--db", db.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1));
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
    assert!(
        std::fs::read(&foreign).unwrap() == foreign_before,
        "their file is left as it was"
    );
    for suffix in ["-wal", "-shm"] {
        let mut wal = foreign.as_os_str().to_owned();
        wal.push(suffix);
        assert!(
            !std::path::Path::new(&wal).exists(),
            "{suffix} not created beside their file"
        );
    }

    // A directory given as --db.
    let out = idem(&["verify", "--db", dir.0.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("is a directory"));
}

#[test]
fn addr_takes_host_names_and_help_says_which_commands_create_the_database() {
    let dir = TempDir::new("addr");
    let db = dir.db();
    let store = store_args(&db);
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(on_db(&db, &["serve", "--addr", "localhost:0"], &store))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let listening = std::io::BufRead::lines(stderr)
        .map(|l| l.unwrap())
        .find(|l| l.starts_with("listening on"))
        .expect("a listening line");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        listening.starts_with("listening on http://127.0.0.1:"),
        "localhost is its IPv4 address: {listening}"
    );
    for bad in [
        "no-such-host.invalid:8080",
        "localhost",
        ":8080",
        "localhost:99999",
    ] {
        let out = idem(&on_db(&db, &["serve", "--addr", bad], &store));
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("--addr"),
            "{bad}: {}",
            text(&out.stderr)
        );
    }

    for command in [
        &["verify"][..],
        &["consumers", "list"],
        &["backup", "x"],
        &["migrate"],
    ] {
        let mut args = command.to_vec();
        args.push("--help");
        let help = text(&idem(&args).stdout);
        assert!(
            help.contains("need an existing one") && !help.contains("on first use"),
            "{command:?}: --db's help must not promise to create the database:\n{help}"
        );
    }
    for command in [&["backup", "out.db"][..], &["migrate"]] {
        let mut args = command.to_vec();
        let missing = dir.0.join("missing.db");
        args.extend(["--db", missing.to_str().unwrap()]);
        let out = idem(&args);
        assert_eq!(out.status.code(), Some(1), "{command:?}");
        assert!(text(&out.stderr).contains("no database"), "{command:?}");
        assert!(!missing.exists(), "{command:?} created nothing");
    }
}
