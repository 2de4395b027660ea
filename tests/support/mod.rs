//! Shared test support: a minimal HTTP/1.1 client over a raw TcpStream (so
//! tests see exactly the bytes the server sends), servers started through the
//! embedding API, and `idem serve` child processes for crash tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON, read as idem reads JSON (`idem::json`): a repeated
    /// member is an error, and no member name is read as anything else.
    pub fn json(&self) -> Value {
        idem::json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {} body is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The problem slug of an RFC 9457 body, checking its shape.
    pub fn slug(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "status {}: {}",
            self.status,
            String::from_utf8_lossy(&self.body)
        );
        let body = self.json();
        assert_eq!(body["status"], json!(self.status));
        assert!(body["title"].is_string() && body["detail"].is_string());
        body["type"]
            .as_str()
            .and_then(|t| t.strip_prefix("urn:idem:problem:"))
            .expect("problem type")
            .to_string()
    }
}

/// Sends one request on a new connection (`Connection: close`) and reads the
/// whole response.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Resp> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> std::io::Result<Resp> {
    let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers (connection closed early?)"))?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| bad("head not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("no status line"))?;
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if let Some(len) = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse::<usize>().ok())
    {
        body.truncate(len);
    }
    Ok(Resp {
        status,
        headers,
        body,
    })
}

/// A client bound to one server and one consumer key.
#[derive(Clone)]
pub struct Client {
    pub addr: SocketAddr,
    pub key: String,
}

impl Client {
    pub fn new(addr: SocketAddr, key: &str) -> Client {
        Client {
            addr,
            key: key.to_string(),
        }
    }

    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        extra: &[(&str, &str)],
        body: &str,
    ) -> std::io::Result<Resp> {
        let auth = format!("Bearer {}", self.key);
        let mut headers = vec![("Authorization", auth.as_str())];
        headers.extend_from_slice(extra);
        send(self.addr, method, path, &headers, body.as_bytes())
    }

    pub fn request(&self, method: &str, path: &str, extra: &[(&str, &str)], body: &str) -> Resp {
        self.try_request(method, path, extra, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    pub fn get(&self, path: &str) -> Resp {
        self.request("GET", path, &[], "")
    }

    pub fn post(&self, path: &str, key: Option<&str>, body: &Value) -> Resp {
        let body = body.to_string();
        match key {
            Some(k) => self.request("POST", path, &[("Idempotency-Key", k)], &body),
            None => self.request("POST", path, &[], &body),
        }
    }

    pub fn account(&self, id: &str, allow_negative: bool) -> Value {
        let r = self.post(
            "/v1/accounts",
            None,
            &json!({"id": id, "currency": "BRL", "allow_negative": allow_negative}),
        );
        assert_eq!(
            r.status,
            201,
            "create account {id}: {}",
            String::from_utf8_lossy(&r.body)
        );
        r.json()
    }

    /// A funding account `card` (may go negative) and a merchant `shop`.
    pub fn card_and_shop(&self) {
        self.account("card", true);
        self.account("shop", false);
    }

    pub fn charge(&self, key: &str, body: &Value) -> Resp {
        self.post("/v1/charges", Some(key), body)
    }

    pub fn balance(&self, account: &str) -> i64 {
        let r = self.get(&format!("/v1/accounts/{account}"));
        assert_eq!(r.status, 200);
        r.json()["balance"].as_i64().expect("balance")
    }

    /// Every charge of this consumer (all pages).
    pub fn all_charges(&self) -> Vec<Value> {
        let mut all = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let path = match &after {
                Some(id) => format!("/v1/charges?limit=100&starting_after={id}"),
                None => "/v1/charges?limit=100".to_string(),
            };
            let page = self.get(&path).json();
            let data = page["data"].as_array().expect("data").clone();
            after = data.last().map(|c| c["id"].as_str().unwrap().to_string());
            all.extend(data);
            if page["has_more"] != json!(true) {
                return all;
            }
        }
    }
}

/// An in-process server on a temporary database, with a client for its
/// `default` consumer and the accounts `card` and `shop`.
pub fn server(configure: impl FnOnce(&mut idem::Config)) -> (idem::Server, Client) {
    let server = if on_postgres() {
        // The database outlives the test (the cluster is CI's own); its
        // simulator file is in the system temp dir.
        let dir = std::mem::ManuallyDrop::new(TempDir::new("server"));
        let mut config = config(&dir);
        configure(&mut config);
        idem::Server::start(config).expect("start server")
    } else {
        idem::Server::start_temporary(configure).expect("start server")
    };
    let client = Client::new(server.addr(), server.initial_key().expect("default key"));
    client.card_and_shop();
    (server, client)
}

/// An in-process server on `dir`'s database that calls `acquirer`, with a
/// client and the accounts `card` and `shop`. The reaper is left idle.
pub fn server_with_acquirer(
    dir: &TempDir,
    acquirer: std::sync::Arc<dyn idem::acquirer::Acquirer>,
    configure: impl FnOnce(&mut idem::Config),
) -> (idem::Server, Client) {
    let mut config = config(dir);
    config.reaper_interval = Duration::from_secs(3600);
    configure(&mut config);
    let server = idem::Server::start_with_acquirer(config, acquirer).expect("start server");
    let client = Client::new(server.addr(), server.initial_key().expect("default key"));
    client.card_and_shop();
    (server, client)
}

pub fn charge_body(amount: i64) -> Value {
    json!({"amount": amount, "currency": "BRL", "source": "card", "destination": "shop"})
}

/// A configuration on `dir`'s database (SQLite or PostgreSQL, see
/// [`on_postgres`]) listening on a free port of 127.0.0.1.
pub fn config(dir: &TempDir) -> idem::Config {
    let mut config = idem::Config::new(dir.db());
    config.addr = "127.0.0.1:0".parse().unwrap();
    config.acquirer_store = acquirer_store(&dir.db());
    config
}

/// Runs `idem verify` on a database; returns (exit code, report).
pub fn verify_cli(db: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["verify", "--db"])
        .arg(db)
        .args(acquirer_store_args(db))
        .output()
        .expect("run idem verify");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

pub fn assert_verified(db: &Path) {
    let (code, report) = verify_cli(db);
    assert_eq!(code, 0, "idem verify failed:\n{report}");
}

/// The suite's backend: with `IDEM_TEST_POSTGRES` set to the URL of a
/// PostgreSQL database its user may create databases from (`.ci/run` starts
/// such a cluster), every test's database is a fresh PostgreSQL database;
/// without it, an SQLite file. One set of tests, two backends.
pub fn postgres_admin() -> Option<String> {
    std::env::var("IDEM_TEST_POSTGRES")
        .ok()
        .filter(|s| !s.is_empty())
}

/// Whether this run's databases are PostgreSQL ones.
pub fn on_postgres() -> bool {
    postgres_admin().is_some()
}

/// For a test that needs SQLite's file itself (corrupting it, its -wal,
/// its lock, a backup of it): true, after saying so, when this run is on
/// PostgreSQL, where the test has nothing to check.
pub fn skip_on_postgres(why: &str) -> bool {
    if on_postgres() {
        eprintln!("skipped on PostgreSQL: {why}");
    }
    on_postgres()
}

/// `admin` with its database replaced by `name`.
fn with_database(admin: &str, name: &str) -> String {
    let (base, _) = admin
        .rsplit_once('/')
        .expect("a postgres:// URL with a database");
    format!("{base}/{name}")
}

fn postgres_admin_client(admin: &str) -> postgres::Client {
    postgres::Client::connect(admin, postgres::NoTls).expect("connect to IDEM_TEST_POSTGRES")
}

/// The acquirer simulator file for `db` when it is a PostgreSQL URL
/// (`idem serve` needs one named there), in the system temp dir.
pub fn acquirer_store(db: &Path) -> Option<PathBuf> {
    let url = db.to_str()?;
    if !url.starts_with("postgres://") {
        return None;
    }
    // Without the query (`?sslmode=…`): one database, one file.
    let url = url.split('?').next().unwrap();
    let name = url.rsplit('/').next().unwrap();
    Some(std::env::temp_dir().join(format!("{name}.acquirer.sqlite")))
}

fn acquirer_store_args(db: &Path) -> Vec<std::ffi::OsString> {
    acquirer_store(db)
        .map(|p| vec!["--acquirer-store".into(), p.into_os_string()])
        .unwrap_or_default()
}

/// A fresh directory under the system temp dir, and on PostgreSQL a fresh
/// database; both removed on drop.
pub struct TempDir(pub PathBuf, Option<String>);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let path = std::env::temp_dir().join(format!("idem-test-{tag}-{id}"));
        std::fs::create_dir_all(&path).unwrap();
        let database = postgres_admin().map(|admin| {
            let name = format!("idem_test_{id}");
            postgres_admin_client(&admin)
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .expect("create the test database");
            with_database(&admin, &name)
        });
        TempDir(path, database)
    }
    /// The test's database: an SQLite file in the directory, or the URL of
    /// its PostgreSQL database.
    pub fn db(&self) -> PathBuf {
        match &self.1 {
            Some(url) => PathBuf::from(url),
            None => self.0.join("idem.db"),
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        if let (Some(url), Some(admin)) = (&self.1, postgres_admin()) {
            let name = url.rsplit('/').next().unwrap().to_string();
            let _ = postgres_admin_client(&admin)
                .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
            if let Some(store) = acquirer_store(Path::new(url)) {
                for suffix in ["", "-wal", "-shm"] {
                    let mut p = store.clone().into_os_string();
                    p.push(suffix);
                    let _ = std::fs::remove_file(p);
                }
            }
        }
    }
}

/// Runs `f` on the database `db` (either backend) through idem's own
/// storage interface, read-only: how tests look at rows without caring
/// which engine holds them.
pub fn inspect<T>(db: &Path, f: impl FnOnce(&dyn idem::store::Db) -> idem::Result<T>) -> T {
    idem::store::inspect(db, f).expect("read the database")
}

/// An `idem serve` child process.
pub struct ChildServer {
    pub child: Child,
    pub addr: SocketAddr,
    /// The `default` consumer's key, if this start created it.
    pub initial_key: Option<String>,
    stderr: mpsc::Receiver<String>,
}

impl ChildServer {
    /// Starts `idem serve --db DB --addr 127.0.0.1:0 ARGS` with `env` and
    /// waits for its "listening on" line.
    pub fn start(db: &Path, args: &[&str], env: &[(&str, &str)]) -> ChildServer {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.arg("serve")
            .arg("--db")
            .arg(db)
            .args(["--addr", "127.0.0.1:0"])
            .args(acquirer_store_args(db))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .env_remove("IDEM_FAULT");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn idem serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut initial_key = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("idem serve did not start: {:?}", child.try_wait()));
            if let Some(key) = line.split_whitespace().find(|w| w.starts_with("sk_")) {
                initial_key = Some(key.to_string());
            }
            if let Some(url) = line.strip_prefix("listening on http://") {
                let addr = url.trim().parse().expect("listening address");
                return ChildServer {
                    child,
                    addr,
                    initial_key,
                    stderr: rx,
                };
            }
        }
    }

    /// SIGKILL, and wait for it to be gone.
    pub fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap child");
    }

    /// Waits for the process to exit on its own (after a fault point).
    pub fn wait_exit(mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "server did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// stderr lines printed so far.
    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.try_iter().collect()
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Creates a consumer through the CLI and returns its key.
pub fn create_consumer_cli(db: &Path, name: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["consumers", "create", name, "--db"])
        .arg(db)
        .output()
        .expect("run idem consumers create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Waits until the key row of `key` exists (its request is reserved), by
/// reading the server's database directly: a test then knows the order of
/// events instead of guessing it with a sleep.
pub fn wait_for_key(db: &Path, key: &str) {
    eventually(Duration::from_secs(30), || {
        inspect(db, |c| {
            c.exists(
                "SELECT 1 FROM idempotency_keys WHERE key = ?1",
                &[&key as &dyn idem::store::Arg],
            )
        })
        .then_some(())
    });
}

/// Polls `f` until it returns Some or `within` passes.
pub fn eventually<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "condition not met within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Implements `capture`, `void` and `refund` of `idem::acquirer::Acquirer`
/// for a test acquirer by passing them to its `inner` simulator: most test
/// acquirers change only how they authorize.
#[macro_export]
macro_rules! settle_through_inner {
    () => {
        fn capture(
            &self,
            key: &str,
            authorization: &str,
            amount: i64,
            deadline: std::time::Instant,
        ) -> Result<(), idem::acquirer::Unavailable> {
            self.inner.capture(key, authorization, amount, deadline)
        }

        fn void(
            &self,
            key: &str,
            authorization: &str,
            deadline: std::time::Instant,
        ) -> Result<(), idem::acquirer::Unavailable> {
            self.inner.void(key, authorization, deadline)
        }

        fn refund(
            &self,
            key: &str,
            authorization: &str,
            amount: i64,
            deadline: std::time::Instant,
        ) -> Result<(), idem::acquirer::Unavailable> {
            self.inner.refund(key, authorization, amount, deadline)
        }
    };
}

/// The acquirer simulator, counting its calls by kind: shows that an
/// authorization is never asked for twice, and that a capture or a void
/// happens once.
pub struct CountingAcquirer {
    calls: std::sync::atomic::AtomicUsize,
    captures: std::sync::atomic::AtomicUsize,
    voids: std::sync::atomic::AtomicUsize,
    refunds: std::sync::atomic::AtomicUsize,
    inner: idem::acquirer::Simulator,
}

impl CountingAcquirer {
    pub fn new() -> std::sync::Arc<CountingAcquirer> {
        std::sync::Arc::new(CountingAcquirer {
            calls: Default::default(),
            captures: Default::default(),
            voids: Default::default(),
            refunds: Default::default(),
            inner: idem::acquirer::Simulator::new(Duration::ZERO),
        })
    }

    /// `authorize` calls.
    pub fn calls(&self) -> usize {
        self.calls.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn captures(&self) -> usize {
        self.captures.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn voids(&self) -> usize {
        self.voids.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn refunds(&self) -> usize {
        self.refunds.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl idem::acquirer::Acquirer for CountingAcquirer {
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        deadline: std::time::Instant,
    ) -> Result<idem::acquirer::AuthorizeOutcome, idem::acquirer::Unavailable> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner
            .authorize(key, amount, currency, capture, deadline)
    }

    fn capture(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: std::time::Instant,
    ) -> Result<(), idem::acquirer::Unavailable> {
        self.captures
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.capture(key, authorization, amount, deadline)
    }

    fn void(
        &self,
        key: &str,
        authorization: &str,
        deadline: std::time::Instant,
    ) -> Result<(), idem::acquirer::Unavailable> {
        self.voids.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.void(key, authorization, deadline)
    }

    fn refund(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: std::time::Instant,
    ) -> Result<(), idem::acquirer::Unavailable> {
        self.refunds
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.refund(key, authorization, amount, deadline)
    }
}

/// The acquirer simulator's file of the database `db`: beside an SQLite
/// file, or the one [`acquirer_store`] names for a PostgreSQL database.
pub fn simulator_file(db: &Path) -> PathBuf {
    acquirer_store(db).unwrap_or_else(|| idem::acquirer::Simulator::store_path(db))
}

/// The simulator's journal of calls for the database `db` (either backend).
pub fn journal(db: &Path) -> idem::Result<Vec<idem::acquirer::Call>> {
    idem::acquirer::Simulator::journal_of_file(&simulator_file(db))
}

/// The authorizations the simulator of the database `db` remembers.
pub fn authorizations(db: &Path) -> idem::Result<Vec<idem::acquirer::StoredAuthorization>> {
    idem::acquirer::Simulator::authorizations_of_file(&simulator_file(db))
}
