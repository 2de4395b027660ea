//! Torture: concurrent clients, each retrying its own intents with the same
//! key until it gets a final answer, against an `idem serve` child that is
//! SIGKILLed and restarted at random moments. After every kill (the child is
//! dead, the file quiescent) and at the end, the database is checked directly
//! in SQL, with `idem verify`, and against every answer a client was given:
//! conservation, nothing acknowledged lost, at most one effect per key and
//! per reference, every stored answer byte-identical to the one the client
//! saw, and structure (integrity, foreign keys, orphans the reaper can finish).
//!
//! Seeded: `IDEM_TORTURE_SEED=<u64>` replays the schedule of intents and of
//! kill moments. Thread timing is not deterministic, so which request a kill
//! interrupts, and hence which answers come back, differ between two runs of
//! one seed. `IDEM_TORTURE_KILLS=<n>` sets the number of kills (default
//! `KILLS_DEFAULT`, the CI profile; README.md tells how to run the long one),
//! spread over fresh databases of at most `KILLS_PER_DATABASE_MAX` kills each.
//! At the end of each database the reaper must have resolved every orphan,
//! every answered intent is re-sent once more, and the database must hold
//! exactly the charges and refunds the answers name. A second test tampers
//! with copies of a real file to show that each check fails when it should.

mod support;

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, RwLock};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags};
use serde_json::{json, Value};
use support::{ChildServer, TempDir};

/// The CI profile: at least 20 kills, about 20 s on a loaded 2-core machine.
const KILLS_DEFAULT: u32 = 30;
/// Client threads, released together; client `i` speaks for consumer
/// `i % CONSUMERS`, so two clients share each consumer's accounts.
const CLIENTS: usize = 6;
const CONSUMERS: usize = 3;
/// Short, so that orphans left by a kill are taken over (by a retry or by the
/// reaper) within about a second of the restart.
const INFLIGHT_TIMEOUT: &str = "1s";
const REAPER_INTERVAL: &str = "200ms";
/// A few milliseconds in the acquirer widen the window in which a kill finds
/// a charge between its reservation and its ledger commit.
const ACQUIRER_LATENCY: &str = "5ms";
/// An intent without a final answer after this long is a failure (a server
/// that does not converge), not a hang of the test.
const INTENT_DEADLINE: Duration = Duration::from_secs(60);
/// How long the end waits for the reaper to resolve every in-progress key.
const DRAIN_DEADLINE: Duration = Duration::from_secs(30);
/// Pause before re-sending after a 409 or 503 (the server says
/// `Retry-After: 1`; a torture client is impatient on purpose) and after a
/// connection error (the server is down or restarting).
const RETRY_PAUSE: Duration = Duration::from_millis(40);
const DOWN_PAUSE: Duration = Duration::from_millis(10);

/// Every consumer gets the same accounts: in each currency one funding
/// account that may go negative and merchants that may not.
struct AccountSpec {
    id: &'static str,
    currency: &'static str,
    allow_negative: bool,
}

const ACCOUNTS: &[AccountSpec] = &[
    AccountSpec {
        id: "fund_brl",
        currency: "BRL",
        allow_negative: true,
    },
    AccountSpec {
        id: "shop_brl_a",
        currency: "BRL",
        allow_negative: false,
    },
    AccountSpec {
        id: "shop_brl_b",
        currency: "BRL",
        allow_negative: false,
    },
    AccountSpec {
        id: "shop_brl_c",
        currency: "BRL",
        allow_negative: false,
    },
    AccountSpec {
        id: "fund_usd",
        currency: "USD",
        allow_negative: true,
    },
    AccountSpec {
        id: "shop_usd_a",
        currency: "USD",
        allow_negative: false,
    },
    AccountSpec {
        id: "shop_usd_b",
        currency: "USD",
        allow_negative: false,
    },
];

/// splitmix64: small, seedable, good enough to schedule a test.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// A UUID v4 from the seeded stream, so keys replay with the seed.
    fn uuid(&mut self) -> String {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.next().to_le_bytes());
        bytes[8..].copy_from_slice(&self.next().to_le_bytes());
        uuid::Builder::from_random_bytes(bytes)
            .into_uuid()
            .to_string()
    }
}

/// The run's knobs, from the environment.
struct Profile {
    seed: u64,
    kills: u32,
}

impl Profile {
    fn from_env() -> Profile {
        let seed = match std::env::var("IDEM_TORTURE_SEED") {
            Ok(s) => s
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("IDEM_TORTURE_SEED={s:?}: {e}")),
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock after 1970")
                .as_nanos() as u64,
        };
        let kills = match std::env::var("IDEM_TORTURE_KILLS") {
            Ok(s) => s
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("IDEM_TORTURE_KILLS={s:?}: {e}")),
            Err(_) => KILLS_DEFAULT,
        };
        Profile { seed, kills }
    }
}

#[derive(Debug, Clone)]
enum Kind {
    /// A new charge with its own `reference`. `may_decline`: the source is a
    /// merchant, so 402 is a legitimate answer.
    Charge {
        amount: i64,
        source: &'static str,
        destination: &'static str,
        reference: String,
        may_decline: bool,
    },
    /// A new key with the body (hence the `reference`) of an acknowledged
    /// charge: must answer 200 with that charge and move nothing.
    ReferenceReplay { charge: String, reference: String },
    /// A refund of an acknowledged charge; `None` refunds what is left.
    Refund { charge: String, amount: Option<i64> },
}

/// One user intent: one key, one body, sent until it gets a final answer.
#[derive(Debug)]
struct Intent {
    client: usize,
    consumer: usize,
    key: String,
    path: String,
    body: String,
    kind: Kind,
    /// Sent with `Prefer: respond-async`: a 202 is not final, the client
    /// re-sends until the stored answer comes back.
    respond_async: bool,
}

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    body: Vec<u8>,
    replayed: bool,
}

impl Answer {
    fn json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }

    fn text(&self) -> String {
        format!("{} {}", self.status, String::from_utf8_lossy(&self.body))
    }
}

/// An intent and the first final answer its client saw.
#[derive(Debug, Clone)]
struct Record {
    intent: Arc<Intent>,
    first: Answer,
}

#[derive(Default)]
struct Stats {
    /// Requests sent.
    attempts: AtomicU64,
    /// Requests that were a re-send of the same intent.
    retries: AtomicU64,
    /// Why a request had to be re-sent.
    connection_errors: AtomicU64,
    in_use_409: AtomicU64,
    accepted_202: AtomicU64,
    unavailable_503: AtomicU64,
    replays_compared: AtomicU64,
}

/// What the clients and the kill loop share.
struct Shared {
    seed: u64,
    keys: Vec<String>,
    /// Where the child listens; `None` while it is down.
    addr: RwLock<Option<SocketAddr>>,
    /// No new intents; finish the current one.
    stop: AtomicBool,
    /// The test failed: give up at once.
    abort: AtomicBool,
    /// Kills so far, for messages.
    kills: AtomicU64,
    answered: Mutex<Vec<Record>>,
    abandoned: Mutex<Vec<Arc<Intent>>>,
    failures: Mutex<Vec<String>>,
    stats: Stats,
}

impl Shared {
    fn fail(&self, what: String) {
        let kills = self.kills.load(Ordering::SeqCst);
        self.failures
            .lock()
            .unwrap()
            .push(format!("[seed {}, after kill {kills}] {what}", self.seed));
    }
}

/// Sets `abort` when the test's main thread unwinds, so clients stop.
struct AbortOnDrop(Arc<Shared>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort.store(true, Ordering::SeqCst);
        *self.0.addr.write().unwrap() = None;
    }
}

/// Where a failure happened, for every assertion message.
struct Ctx {
    /// The database's seed and kills: what replays this schedule alone.
    seed: u64,
    kills: u32,
    at: String,
}

impl Ctx {
    fn fail(&self, problems: &[String]) -> ! {
        let shown: Vec<&String> = problems.iter().take(30).collect();
        panic!(
            "torture failed (seed {seed}, {at}; replay with IDEM_TORTURE_SEED={seed} \
             IDEM_TORTURE_KILLS={kills}): {n} problem(s):\n{list}",
            seed = self.seed,
            kills = self.kills,
            at = self.at,
            n = problems.len(),
            list = shown
                .iter()
                .map(|p| format!("- {p}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    fn check(&self, problems: Vec<String>) {
        if !problems.is_empty() {
            self.fail(&problems);
        }
    }
}

enum Attempt {
    Final(Answer),
    /// Connection error, 409 or 503: send the same again.
    Retry,
    /// The server is down: nothing was sent.
    Down,
}

fn attempt(shared: &Shared, intent: &Intent) -> Attempt {
    let Some(addr) = *shared.addr.read().unwrap() else {
        std::thread::sleep(DOWN_PAUSE);
        return Attempt::Down;
    };
    shared.stats.attempts.fetch_add(1, Ordering::Relaxed);
    let auth = format!("Bearer {}", shared.keys[intent.consumer]);
    let mut headers = vec![
        ("Authorization", auth.as_str()),
        ("Idempotency-Key", intent.key.as_str()),
        ("Content-Type", "application/json"),
    ];
    if intent.respond_async {
        headers.push(("Prefer", "respond-async"));
    }
    match support::send(addr, "POST", &intent.path, &headers, intent.body.as_bytes()) {
        Err(_) => {
            shared
                .stats
                .connection_errors
                .fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(DOWN_PAUSE);
            Attempt::Retry
        }
        Ok(r) if matches!(r.status, 409 | 503) || (r.status == 202 && intent.respond_async) => {
            let counter = match r.status {
                202 => &shared.stats.accepted_202,
                409 => &shared.stats.in_use_409,
                _ => &shared.stats.unavailable_503,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(RETRY_PAUSE);
            Attempt::Retry
        }
        Ok(r) => {
            let replayed = r.replayed();
            Attempt::Final(Answer {
                status: r.status,
                body: r.body,
                replayed,
            })
        }
    }
}

/// Sends `intent` until it gets a final answer; `None` if the test aborted
/// or the deadline passed (recorded as a failure).
fn until_final(shared: &Shared, intent: &Intent) -> Option<Answer> {
    let deadline = Instant::now() + INTENT_DEADLINE;
    let mut sent = false;
    loop {
        if shared.abort.load(Ordering::SeqCst) {
            return None;
        }
        let outcome = attempt(shared, intent);
        if sent && !matches!(outcome, Attempt::Down) {
            shared.stats.retries.fetch_add(1, Ordering::Relaxed);
        }
        match outcome {
            Attempt::Final(answer) => return Some(answer),
            Attempt::Retry => sent = true,
            Attempt::Down => {}
        }
        if Instant::now() > deadline {
            shared.fail(format!(
                "no final answer within {INTENT_DEADLINE:?} for {} key {}",
                intent.path, intent.key
            ));
            return None;
        }
    }
}

fn is_slug(answer: &Answer, slug: &str) -> bool {
    answer
        .json()
        .and_then(|b| b["type"].as_str().map(str::to_string))
        == Some(format!("urn:idem:problem:{slug}"))
}

/// Is `answer` a legitimate final answer to `intent`? Returns what is wrong.
fn judge(intent: &Intent, answer: &Answer) -> Result<(), String> {
    let body = answer.json().unwrap_or(Value::Null);
    let ok = match (&intent.kind, answer.status) {
        (
            Kind::Charge {
                amount,
                source,
                destination,
                reference,
                ..
            },
            201,
        ) => {
            body["object"] == "charge"
                && body["id"].as_str().is_some_and(|id| id.starts_with("ch_"))
                && body["amount"] == json!(amount)
                && body["source"] == json!(source)
                && body["destination"] == json!(destination)
                && body["reference"] == json!(reference)
                && body["status"] == "succeeded"
                && body["amount_refunded"] == 0
        }
        (Kind::Charge { may_decline, .. }, 402) => {
            *may_decline && is_slug(answer, "insufficient-funds")
        }
        (Kind::ReferenceReplay { charge, .. }, 200) => {
            body["object"] == "charge" && body["id"] == json!(charge) && answer.replayed
        }
        (Kind::Refund { charge, amount }, 201) => {
            body["object"] == "refund"
                && body["id"].as_str().is_some_and(|id| id.starts_with("re_"))
                && body["charge"] == json!(charge)
                && amount.is_none_or(|a| body["amount"] == json!(a))
        }
        (Kind::Refund { .. }, 402) => is_slug(answer, "insufficient-funds"),
        (Kind::Refund { .. }, 422) => is_slug(answer, "refund-exceeds-charge"),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "client {} {} key {} body {}: unexpected final answer {}",
            intent.client,
            intent.path,
            intent.key,
            intent.body,
            answer.text()
        ))
    }
}

/// A client's own view: what it was answered, and its acknowledged charges
/// (id, the intent) that refunds and reference replays pick from.
struct Client {
    shared: Arc<Shared>,
    index: usize,
    consumer: usize,
    rng: Rng,
    mine: Vec<Record>,
    charges: Vec<(String, Arc<Intent>)>,
}

impl Client {
    fn new(shared: Arc<Shared>, index: usize) -> Client {
        let seed = shared.seed ^ (index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407);
        Client {
            shared,
            index,
            consumer: index % CONSUMERS,
            rng: Rng::new(seed),
            mine: Vec::new(),
            charges: Vec::new(),
        }
    }

    fn run(mut self, barrier: &Barrier) {
        barrier.wait();
        while !self.shared.stop.load(Ordering::SeqCst) && !self.shared.abort.load(Ordering::SeqCst)
        {
            let roll = self.rng.below(100);
            if roll < 10 && !self.mine.is_empty() {
                self.replay_one();
            } else if roll < 18 {
                let intent = self.new_charge();
                self.abandon_after_one_attempt(intent);
            } else if roll < 33 && !self.charges.is_empty() {
                let intent = self.new_refund();
                self.carry_out(intent);
            } else if roll < 37 && !self.charges.is_empty() {
                let intent = self.new_reference_replay();
                self.carry_out(intent);
            } else {
                let intent = self.new_charge();
                self.carry_out(intent);
            }
        }
    }

    /// A new intent with its own key; one in five asks for async mode.
    fn intent(&mut self, path: String, body: String, kind: Kind) -> Arc<Intent> {
        Arc::new(Intent {
            client: self.index,
            consumer: self.consumer,
            key: self.rng.uuid(),
            path,
            body,
            kind,
            respond_async: self.rng.percent(20),
        })
    }

    fn new_charge(&mut self) -> Arc<Intent> {
        let from_funding = self.rng.percent(50);
        let currency = *self.rng.pick(&["BRL", "USD"]);
        let accounts: Vec<&AccountSpec> =
            ACCOUNTS.iter().filter(|a| a.currency == currency).collect();
        let shops: Vec<&'static str> = accounts
            .iter()
            .filter(|a| !a.allow_negative)
            .map(|a| a.id)
            .collect();
        let funding = accounts.iter().find(|a| a.allow_negative).unwrap().id;
        let (source, destination, amount) = if from_funding {
            (funding, *self.rng.pick(&shops), self.rng.between(1, 5000))
        } else {
            let source = *self.rng.pick(&shops);
            let others: Vec<&'static str> =
                shops.iter().copied().filter(|s| *s != source).collect();
            (source, *self.rng.pick(&others), self.rng.between(1, 4000))
        };
        let amount = amount as i64;
        let reference = format!("ref-{}", self.rng.uuid());
        let body = json!({
            "amount": amount,
            "currency": currency,
            "source": source,
            "destination": destination,
            "reference": reference,
        })
        .to_string();
        let kind = Kind::Charge {
            amount,
            source,
            destination,
            reference,
            may_decline: !from_funding,
        };
        self.intent("/v1/charges".to_string(), body, kind)
    }

    fn new_refund(&mut self) -> Arc<Intent> {
        let (charge, of) = self.rng.pick(&self.charges).clone();
        let Kind::Charge { amount, .. } = of.kind else {
            unreachable!("only charges are kept")
        };
        let amount = if self.rng.percent(30) {
            None
        } else {
            Some(self.rng.between(1, amount as u64) as i64)
        };
        let body = match amount {
            Some(a) => json!({ "amount": a }),
            None => json!({}),
        }
        .to_string();
        let path = format!("/v1/charges/{charge}/refunds");
        self.intent(path, body, Kind::Refund { charge, amount })
    }

    fn new_reference_replay(&mut self) -> Arc<Intent> {
        let (charge, of) = self.rng.pick(&self.charges).clone();
        let Kind::Charge { reference, .. } = &of.kind else {
            unreachable!("only charges are kept")
        };
        let kind = Kind::ReferenceReplay {
            charge,
            reference: reference.clone(),
        };
        self.intent(of.path.clone(), of.body.clone(), kind)
    }

    /// Sends until final, judges and records the first final answer.
    fn carry_out(&mut self, intent: Arc<Intent>) {
        if let Some(answer) = until_final(&self.shared, &intent) {
            self.record(intent, answer);
        }
    }

    /// A client that gives up after one attempt (a terminal that lost power,
    /// or an async client that never polls its 202): its key may be left in
    /// progress, for a retry that never comes; the operation pool or the
    /// reaper must finish it.
    fn abandon_after_one_attempt(&mut self, intent: Arc<Intent>) {
        loop {
            match attempt(&self.shared, &intent) {
                Attempt::Final(answer) => return self.record(intent, answer),
                Attempt::Retry => return self.shared.abandoned.lock().unwrap().push(intent),
                Attempt::Down if self.shared.abort.load(Ordering::SeqCst) => return,
                Attempt::Down => {}
            }
        }
    }

    fn record(&mut self, intent: Arc<Intent>, answer: Answer) {
        match judge(&intent, &answer) {
            Err(what) => self.shared.fail(what),
            Ok(()) if matches!(intent.kind, Kind::Charge { .. }) && answer.status == 201 => {
                let id = answer.json().unwrap()["id"].as_str().unwrap().to_string();
                self.charges.push((id, Arc::clone(&intent)));
            }
            Ok(()) => {}
        }
        let record = Record {
            intent,
            first: answer,
        };
        self.shared.answered.lock().unwrap().push(record.clone());
        self.mine.push(record);
    }

    /// Re-sends an intent that already has its answer: the same status and
    /// the same bytes, marked as a replay.
    fn replay_one(&mut self) {
        let record = self.rng.pick(&self.mine).clone();
        if let Some(again) = until_final(&self.shared, &record.intent) {
            if let Err(what) = compare_replay(&record, &again) {
                self.shared.fail(what);
            }
            self.shared
                .stats
                .replays_compared
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn compare_replay(record: &Record, again: &Answer) -> Result<(), String> {
    if again.status == record.first.status && again.body == record.first.body && again.replayed {
        return Ok(());
    }
    Err(format!(
        "replay of {} key {} differs: first {} / replay {} (Idempotent-Replayed: {})",
        record.intent.path,
        record.intent.key,
        record.first.text(),
        again.text(),
        again.replayed
    ))
}

fn server_args() -> Vec<&'static str> {
    vec![
        "--inflight-timeout",
        INFLIGHT_TIMEOUT,
        "--reaper-interval",
        REAPER_INTERVAL,
        "--synchronous",
        "full",
        "--acquirer-latency",
        ACQUIRER_LATENCY,
    ]
}

fn start_server(ctx: &Ctx, db: &Path) -> ChildServer {
    let started = std::panic::catch_unwind(|| ChildServer::start(db, &server_args(), &[]));
    match started {
        Ok(server) if server.initial_key.is_none() => server,
        Ok(_) => ctx.fail(&["a restart printed a new default key".to_string()]),
        Err(e) => {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            ctx.fail(&[format!("idem serve did not restart: {why}")])
        }
    }
}

fn create_accounts(ctx: &Ctx, addr: SocketAddr, keys: &[String]) {
    for key in keys {
        let auth = format!("Bearer {key}");
        for spec in ACCOUNTS {
            let body = json!({
                "id": spec.id,
                "currency": spec.currency,
                "allow_negative": spec.allow_negative,
            })
            .to_string();
            let r = support::send(
                addr,
                "POST",
                "/v1/accounts",
                &[("Authorization", &auth)],
                body.as_bytes(),
            )
            .unwrap_or_else(|e| ctx.fail(&[format!("create account {}: {e}", spec.id)]));
            if r.status != 201 {
                ctx.fail(&[format!(
                    "create account {}: {} {}",
                    spec.id,
                    r.status,
                    String::from_utf8_lossy(&r.body)
                )]);
            }
        }
    }
}

/// SIGKILL, and wait until the process is gone (the file is then quiescent).
/// Returns the server's stderr lines that report a panic.
fn kill(shared: &Shared, mut server: ChildServer) -> Vec<String> {
    *shared.addr.write().unwrap() = None;
    server.child.kill().expect("SIGKILL");
    server.child.wait().expect("reap child");
    shared.kills.fetch_add(1, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(5));
    server
        .stderr_lines()
        .into_iter()
        .filter(|l| l.contains("panicked"))
        .collect()
}

/// What the checks read from the database, keyed for the lookups they make.
struct Snapshot {
    consumer_ids: Vec<i64>,
    /// public id → charge
    charges: HashMap<String, ChargeRow>,
    /// (consumer id, idempotency key) → charge public ids
    charges_by_key: HashMap<(i64, String), Vec<String>>,
    /// (consumer id, reference) → charge public ids
    charges_by_reference: HashMap<(i64, String), Vec<String>>,
    refunds: HashMap<String, RefundRow>,
    refunds_by_key: HashMap<(i64, String), Vec<String>>,
    /// (consumer id, key) → key row
    keys: HashMap<(i64, String), KeyRow>,
    /// (consumer id, account public id) → balance
    balances: HashMap<(i64, String), i64>,
}

struct ChargeRow {
    consumer_id: i64,
    amount: i64,
    currency: String,
    source: String,
    destination: String,
    reference: Option<String>,
    key: String,
    op_id: String,
    authorization_id: String,
}

struct RefundRow {
    consumer_id: i64,
    charge: String,
    amount: i64,
    key: String,
}

struct KeyRow {
    state: String,
    status: Option<u16>,
    body: Option<Vec<u8>>,
}

fn open_read_only(db: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    Ok(conn)
}

/// The database ids of the consumers `torture-0`, `torture-1`, …
fn consumer_ids(conn: &Connection) -> rusqlite::Result<Vec<i64>> {
    (0..CONSUMERS)
        .map(|i| {
            conn.query_row(
                "SELECT id FROM consumers WHERE name = ?1",
                [format!("torture-{i}")],
                |r| r.get(0),
            )
        })
        .collect()
}

fn read_snapshot(conn: &Connection) -> rusqlite::Result<Snapshot> {
    let mut s = Snapshot {
        consumer_ids: Vec::new(),
        charges: HashMap::new(),
        charges_by_key: HashMap::new(),
        charges_by_reference: HashMap::new(),
        refunds: HashMap::new(),
        refunds_by_key: HashMap::new(),
        keys: HashMap::new(),
        balances: HashMap::new(),
    };
    s.consumer_ids = consumer_ids(conn)?;
    let mut stmt = conn.prepare(
        "SELECT c.public_id, c.consumer_id, c.amount, c.currency, s.public_id, d.public_id, \
         c.reference, c.idempotency_key, c.op_id, c.authorization_id FROM charges c \
         JOIN accounts s ON s.id = c.source_id JOIN accounts d ON d.id = c.destination_id",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let id: String = r.get(0)?;
        let row = ChargeRow {
            consumer_id: r.get(1)?,
            amount: r.get(2)?,
            currency: r.get(3)?,
            source: r.get(4)?,
            destination: r.get(5)?,
            reference: r.get(6)?,
            key: r.get(7)?,
            op_id: r.get(8)?,
            authorization_id: r.get(9)?,
        };
        let by_key = (row.consumer_id, row.key.clone());
        s.charges_by_key.entry(by_key).or_default().push(id.clone());
        if let Some(reference) = &row.reference {
            let by_ref = (row.consumer_id, reference.clone());
            s.charges_by_reference
                .entry(by_ref)
                .or_default()
                .push(id.clone());
        }
        s.charges.insert(id, row);
    }
    let mut stmt = conn.prepare(
        "SELECT r.public_id, r.consumer_id, c.public_id, r.amount, r.idempotency_key \
         FROM refunds r JOIN charges c ON c.id = r.charge_id",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let id: String = r.get(0)?;
        let row = RefundRow {
            consumer_id: r.get(1)?,
            charge: r.get(2)?,
            amount: r.get(3)?,
            key: r.get(4)?,
        };
        let by_key = (row.consumer_id, row.key.clone());
        s.refunds_by_key.entry(by_key).or_default().push(id.clone());
        s.refunds.insert(id, row);
    }
    let mut stmt = conn.prepare(
        "SELECT consumer_id, key, state, response_status, response_body FROM idempotency_keys",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let row = KeyRow {
            state: r.get(2)?,
            status: r.get(3)?,
            body: r.get(4)?,
        };
        s.keys.insert((r.get(0)?, r.get(1)?), row);
    }
    let mut stmt = conn.prepare("SELECT consumer_id, public_id, balance FROM accounts")?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        s.balances.insert((r.get(0)?, r.get(1)?), r.get(2)?);
    }
    Ok(s)
}

/// Queries whose every row (one text column) is a violation.
const SQL_CHECKS: &[(&str, &str)] = &[
    (
        "conservation: balances sum to zero per consumer and currency",
        "SELECT 'consumer ' || consumer_id || ' ' || currency || ' sums to ' || sum(balance) \
         FROM accounts GROUP BY consumer_id, currency HAVING sum(balance) <> 0",
    ),
    (
        "conservation: each balance equals the sum of its entries",
        "SELECT 'account ' || a.public_id || ' balance ' || a.balance || ' entries ' \
         || coalesce(sum(e.amount), 0) FROM accounts a LEFT JOIN entries e ON e.account_id = a.id \
         GROUP BY a.id HAVING a.balance <> coalesce(sum(e.amount), 0)",
    ),
    (
        "conservation: no account without allow_negative is negative",
        "SELECT 'account ' || public_id || ' is at ' || balance FROM accounts \
         WHERE allow_negative = 0 AND balance < 0",
    ),
    // Per key, not only per op_id as `idem verify` checks: a key may come
    // back as a new request once its row is past retention, but the test's
    // retention (24 h) outlasts any run.
    (
        "at most once: one charge per (consumer, key)",
        "SELECT 'key ' || idempotency_key || ' produced ' || count(*) || ' charges' \
         FROM charges GROUP BY consumer_id, idempotency_key HAVING count(*) > 1",
    ),
    (
        "at most once: one refund per (consumer, key)",
        "SELECT 'key ' || idempotency_key || ' produced ' || count(*) || ' refunds' \
         FROM refunds GROUP BY consumer_id, idempotency_key HAVING count(*) > 1",
    ),
    (
        "at most once: one charge per (consumer, reference)",
        "SELECT 'reference ' || reference || ' produced ' || count(*) || ' charges' \
         FROM charges WHERE reference IS NOT NULL GROUP BY consumer_id, reference \
         HAVING count(*) > 1",
    ),
    (
        // A refund moves the ledger first: its key completes once the
        // acquirer has refunded too (recovery point 'applied' meanwhile).
        "at most once: an effect belongs to a completed key row of its own key",
        "SELECT 'charge ' || c.public_id || ' key ' || c.idempotency_key || ': key row ' \
         || coalesce(k.state || ' ' || k.key, 'missing') FROM charges c \
         LEFT JOIN idempotency_keys k ON k.op_id = c.op_id \
         WHERE k.id IS NULL OR k.state <> 'completed' OR k.key <> c.idempotency_key \
         OR k.consumer_id <> c.consumer_id \
         UNION ALL \
         SELECT 'refund ' || r.public_id || ' key ' || r.idempotency_key || ': key row ' \
         || coalesce(k.state || ' ' || k.key, 'missing') FROM refunds r \
         LEFT JOIN idempotency_keys k ON k.op_id = r.op_id \
         WHERE k.id IS NULL OR k.key <> r.idempotency_key OR k.consumer_id <> r.consumer_id \
         OR NOT (k.state = 'completed' \
           OR (k.state = 'in_progress' AND k.recovery_point = 'applied'))",
    ),
    (
        "structure: an in-progress key is one the reaper can finish",
        "SELECT 'key ' || key || ' (' || op_id || ') in progress at ' || recovery_point \
         || ' with request ' || request || ' authorization ' || coalesce(authorization, 'none') \
         FROM idempotency_keys WHERE state = 'in_progress' AND (NOT json_valid(request) \
         OR (recovery_point IN ('authorized', 'declined')) <> (authorization IS NOT NULL) \
         OR (recovery_point IN ('declined', 'applied')) <> (response_status IS NOT NULL) \
         OR method <> 'POST' \
         OR NOT (path = '/v1/charges' OR path LIKE '/v1/charges/%/refunds'))",
    ),
    (
        "structure: a completed key has its answer",
        "SELECT 'key ' || key || ' completed without an answer' FROM idempotency_keys \
         WHERE state = 'completed' AND (response_status IS NULL OR response_body IS NULL)",
    ),
];

fn sql_problems(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    let mut problems = Vec::new();
    let integrity: Vec<String> = conn
        .prepare("PRAGMA integrity_check")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    if integrity != ["ok"] {
        problems.push(format!("structure: integrity_check: {integrity:?}"));
    }
    let fk: Vec<String> = conn
        .prepare("PRAGMA foreign_key_check")?
        .query_map([], |r| {
            Ok(format!(
                "{} row {:?} -> {}",
                r.get::<_, String>(0)?,
                r.get::<_, Option<i64>>(1)?,
                r.get::<_, String>(2)?
            ))
        })?
        .collect::<rusqlite::Result<_>>()?;
    if !fk.is_empty() {
        problems.push(format!("structure: foreign_key_check: {fk:?}"));
    }
    for (name, sql) in SQL_CHECKS {
        let lines: Vec<String> = conn
            .prepare(sql)?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        problems.extend(lines.into_iter().map(|l| format!("{name}: {l}")));
    }
    Ok(problems)
}

/// Nothing acknowledged is lost, and the stored answer is the one the client
/// saw: every answered intent has a completed key row with its exact status
/// and bytes, and the effect its answer names (or none, for a decline).
fn record_problems(s: &Snapshot, records: &[Record]) -> Vec<String> {
    let mut problems = Vec::new();
    for record in records {
        let intent = &record.intent;
        let consumer_id = s.consumer_ids[intent.consumer];
        let at = (consumer_id, intent.key.clone());
        let what = format!(
            "client {} {} key {}",
            intent.client, intent.path, intent.key
        );
        match s.keys.get(&at) {
            None => problems.push(format!(
                "lost: {what} answered {} has no key row",
                record.first.text()
            )),
            Some(k)
                if k.state != "completed"
                    || k.status != Some(record.first.status)
                    || k.body.as_deref() != Some(&record.first.body[..]) =>
            {
                problems.push(format!(
                    "{what}: client saw {} but the key row is {} {:?} {}",
                    record.first.text(),
                    k.state,
                    k.status,
                    String::from_utf8_lossy(k.body.as_deref().unwrap_or_default())
                ))
            }
            Some(_) => {}
        }
        if let Err(p) = effect_problem(s, consumer_id, record) {
            problems.push(format!("{what}: {p}"));
        }
    }
    problems
}

fn effect_problem(s: &Snapshot, consumer_id: i64, record: &Record) -> Result<(), String> {
    let intent = &record.intent;
    let answer = &record.first;
    let id = answer
        .json()
        .and_then(|b| b["id"].as_str().map(str::to_string))
        .unwrap_or_default();
    let by_key = (consumer_id, intent.key.clone());
    let charges_of_key = s.charges_by_key.get(&by_key).map_or(0, Vec::len);
    let refunds_of_key = s.refunds_by_key.get(&by_key).map_or(0, Vec::len);
    match (&intent.kind, answer.status) {
        (
            Kind::Charge {
                amount,
                source,
                destination,
                reference,
                ..
            },
            201,
        ) => {
            let c = s
                .charges
                .get(&id)
                .ok_or(format!("lost: acknowledged charge {id} does not exist"))?;
            let same = c.consumer_id == consumer_id
                && c.amount == *amount
                && c.source == *source
                && c.destination == *destination
                && c.reference.as_deref() == Some(reference.as_str())
                && c.key == intent.key;
            if !same || charges_of_key != 1 {
                return Err(format!(
                    "charge {id} in the database: consumer {} {} {} {}->{} ref {:?} key {} \
                     ({charges_of_key} charges for this key)",
                    c.consumer_id,
                    c.amount,
                    c.currency,
                    c.source,
                    c.destination,
                    c.reference,
                    c.key
                ));
            }
        }
        (Kind::Charge { reference, .. }, _) => {
            let by_ref = (consumer_id, reference.clone());
            if charges_of_key != 0 || s.charges_by_reference.contains_key(&by_ref) {
                return Err(format!(
                    "declined with {} yet a charge exists for its key or reference",
                    answer.status
                ));
            }
        }
        (Kind::ReferenceReplay { charge, reference }, _) => {
            let c = s
                .charges
                .get(charge)
                .ok_or(format!("lost: charge {charge} of the reference replay"))?;
            if c.reference.as_deref() != Some(reference) || charges_of_key != 0 {
                return Err(format!(
                    "reference replay of {charge}: {charges_of_key} charges for its own key"
                ));
            }
        }
        (Kind::Refund { charge, .. }, 201) => {
            let r = s
                .refunds
                .get(&id)
                .ok_or(format!("lost: acknowledged refund {id} does not exist"))?;
            let amount = answer.json().unwrap()["amount"].as_i64();
            if r.consumer_id != consumer_id
                || r.charge != *charge
                || Some(r.amount) != amount
                || r.key != intent.key
                || refunds_of_key != 1
            {
                return Err(format!(
                    "refund {id} in the database: {} of {} key {} ({refunds_of_key} for this key)",
                    r.amount, r.charge, r.key
                ));
            }
        }
        (Kind::Refund { .. }, _) => {
            if refunds_of_key != 0 {
                return Err(format!(
                    "declined with {} yet a refund exists",
                    answer.status
                ));
            }
        }
    }
    Ok(())
}

/// The acquirer simulator's journal of calls: at most one call made a new
/// authorization per operation, and every charge carries the authorization
/// its operation got, for its amount and currency.
fn journal_problems(db: &Path, s: &Snapshot) -> Vec<String> {
    let calls = match idem::acquirer::Simulator::journal(db) {
        Ok(calls) => calls,
        Err(e) => return vec![format!("acquirer journal: {e}")],
    };
    let mut problems = Vec::new();
    let mut by_op: HashMap<&str, (&str, i64, &str)> = HashMap::new();
    for call in calls.iter().filter(|c| c.created) {
        let made = (
            call.authorization.as_str(),
            call.amount,
            call.currency.as_str(),
        );
        match by_op.entry(&call.key) {
            Entry::Vacant(first) => {
                first.insert(made);
            }
            Entry::Occupied(_) => {
                problems.push(format!("acquirer authorized operation {} twice", call.key))
            }
        }
    }
    for call in &calls {
        if by_op.get(call.key.as_str()).map(|m| m.0) != Some(call.authorization.as_str()) {
            problems.push(format!(
                "acquirer answered {} with {}, not the authorization it made",
                call.key, call.authorization
            ));
        }
    }
    for (id, c) in &s.charges {
        let expected = (c.authorization_id.as_str(), c.amount, c.currency.as_str());
        match by_op.get(c.op_id.as_str()) {
            Some(made) if *made == expected => {}
            other => problems.push(format!(
                "charge {id} ({}) carries authorization {:?}, the journal has {other:?}",
                c.op_id, expected
            )),
        }
    }
    problems
}

/// Every check on a quiescent file (the child is dead): SQL, the answers
/// clients saw, the acquirer journal, then `idem verify`.
fn check_quiescent(ctx: &Ctx, db: &Path, records: &[Record]) -> Snapshot {
    let conn = open_read_only(db).unwrap_or_else(|e| ctx.fail(&[format!("open db: {e}")]));
    let mut problems = sql_problems(&conn).unwrap_or_else(|e| vec![format!("sql checks: {e}")]);
    let snapshot = read_snapshot(&conn).unwrap_or_else(|e| ctx.fail(&[format!("read db: {e}")]));
    drop(conn);
    problems.extend(record_problems(&snapshot, records));
    problems.extend(journal_problems(db, &snapshot));
    let (code, report) = support::verify_cli(db);
    if code != 0 {
        problems.push(format!("idem verify exited {code}:\n{report}"));
    }
    ctx.check(problems);
    snapshot
}

/// At the end, with every intent answered: the database holds exactly the
/// effects the answers name — no charge or refund nobody was told of — and
/// every balance is what those answers add up to.
fn model_problems(s: &Snapshot, records: &[Record]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut charges: HashSet<&str> = HashSet::new();
    let mut refunds: HashSet<&str> = HashSet::new();
    let mut expected: HashMap<(i64, String), i64> = HashMap::new();
    let mut charge_accounts: HashMap<String, (i64, &str, &str)> = HashMap::new();
    for r in records {
        if let (
            Kind::Charge {
                source,
                destination,
                amount,
                ..
            },
            201,
        ) = (&r.intent.kind, r.first.status)
        {
            let consumer_id = s.consumer_ids[r.intent.consumer];
            let id = r.first.json().unwrap()["id"].as_str().unwrap().to_string();
            *expected
                .entry((consumer_id, source.to_string()))
                .or_default() -= amount;
            *expected
                .entry((consumer_id, destination.to_string()))
                .or_default() += amount;
            charge_accounts.insert(id, (consumer_id, source, destination));
        }
    }
    for r in records {
        let id = r
            .first
            .json()
            .and_then(|b| b["id"].as_str().map(str::to_string));
        match (&r.intent.kind, r.first.status, id) {
            (Kind::Charge { .. }, 201, Some(id)) => {
                charges.insert(s.charges.get_key_value(&id).map_or("", |(k, _)| k.as_str()));
            }
            (Kind::Refund { charge, .. }, 201, Some(id)) => {
                let amount = r.first.json().unwrap()["amount"].as_i64().unwrap_or(0);
                let (consumer_id, source, destination) = charge_accounts[charge];
                *expected
                    .entry((consumer_id, source.to_string()))
                    .or_default() += amount;
                *expected
                    .entry((consumer_id, destination.to_string()))
                    .or_default() -= amount;
                refunds.insert(s.refunds.get_key_value(&id).map_or("", |(k, _)| k.as_str()));
            }
            _ => {}
        }
    }
    for (id, c) in &s.charges {
        if !charges.contains(id.as_str()) {
            problems.push(format!(
                "charge {id} (key {}, {} {}) answered to nobody",
                c.key, c.amount, c.currency
            ));
        }
    }
    for (id, r) in &s.refunds {
        if !refunds.contains(id.as_str()) {
            problems.push(format!("refund {id} (key {}) answered to nobody", r.key));
        }
    }
    for (account, balance) in &s.balances {
        let want = expected.get(account).copied().unwrap_or(0);
        if *balance != want {
            problems.push(format!(
                "account {account:?} balance {balance}, the answers add up to {want}"
            ));
        }
    }
    problems
}

fn in_progress_keys(db: &Path) -> rusqlite::Result<Vec<String>> {
    let conn = open_read_only(db)?;
    let keys = conn
        .prepare(
            "SELECT key || ' at ' || recovery_point || ' locked_at ' || locked_at \
             FROM idempotency_keys WHERE state = 'in_progress'",
        )?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    Ok(keys)
}

/// Waits (bounded) until the reaper has resolved every in-progress key.
fn drain(ctx: &Ctx, db: &Path) {
    let deadline = Instant::now() + DRAIN_DEADLINE;
    loop {
        let left = in_progress_keys(db).unwrap_or_else(|e| vec![format!("read db: {e}")]);
        if left.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            let mut problems = vec![format!(
                "{} key(s) still in progress {DRAIN_DEADLINE:?} after the clients stopped",
                left.len()
            )];
            problems.extend(left);
            ctx.fail(&problems);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Abandoned intents that reached the database were finished by the server
/// alone (the operation pool or the reaper): re-sent now, they replay its
/// answer, which becomes their first answer.
/// Those that never got a key row moved nothing and are dropped.
fn resolve_abandoned(ctx: &Ctx, shared: &Shared, db: &Path) -> usize {
    let abandoned = std::mem::take(&mut *shared.abandoned.lock().unwrap());
    let conn = open_read_only(db).unwrap_or_else(|e| ctx.fail(&[format!("open db: {e}")]));
    let consumer_ids = consumer_ids(&conn).unwrap_or_else(|e| ctx.fail(&[format!("read db: {e}")]));
    let mut problems = Vec::new();
    let mut finished = 0;
    for intent in abandoned {
        let reserved = conn
            .query_row(
                "SELECT 1 FROM idempotency_keys WHERE consumer_id = ?1 AND key = ?2",
                rusqlite::params![consumer_ids[intent.consumer], intent.key],
                |_| Ok(()),
            )
            .is_ok();
        if !reserved {
            continue;
        }
        finished += 1;
        let Some(answer) = until_final(shared, &intent) else {
            continue;
        };
        if !answer.replayed {
            problems.push(format!(
                "abandoned key {} was not finished by the server alone: {}",
                intent.key,
                answer.text()
            ));
        }
        if let Err(what) = judge(&intent, &answer) {
            problems.push(what);
        }
        shared.answered.lock().unwrap().push(Record {
            intent,
            first: answer,
        });
    }
    ctx.check(problems);
    finished
}

/// Re-sends every answered intent once more, from `CLIENTS` threads: the
/// same status and bytes as the first answer, marked as a replay.
fn replay_all(ctx: &Ctx, shared: &Shared, records: &[Record]) {
    let chunk = records.len().div_ceil(CLIENTS).max(1);
    let problems: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = records
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    let mut problems = Vec::new();
                    for record in part {
                        match until_final(shared, &record.intent) {
                            Some(again) => {
                                shared
                                    .stats
                                    .replays_compared
                                    .fetch_add(1, Ordering::Relaxed);
                                if let Err(what) = compare_replay(record, &again) {
                                    problems.push(what);
                                }
                            }
                            None => {
                                problems.push(format!("no replay for key {}", record.intent.key))
                            }
                        }
                    }
                    problems
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("replay thread"))
            .collect()
    });
    ctx.check(problems);
}

/// When to kill, counted from "listening": a quarter of the kills land
/// during startup (the reaper's first pass, takeovers of the last crash's
/// orphans), the rest under steady load.
fn kill_delay(rng: &mut Rng) -> Duration {
    let ms = if rng.percent(25) {
        rng.between(0, 40)
    } else {
        rng.between(50, 600)
    };
    Duration::from_millis(ms)
}

fn take_failures(shared: &Shared) -> Vec<String> {
    std::mem::take(&mut *shared.failures.lock().unwrap())
}

/// What one database's run saw; summed over a long run.
#[derive(Default)]
struct Figures {
    databases: u64,
    kills: u64,
    orphans_at_kills: u64,
    answered: u64,
    charges_acked: u64,
    charges_declined: u64,
    refunds_acked: u64,
    refunds_refused: u64,
    reference_replays: u64,
    abandoned: u64,
    abandoned_finished: u64,
    requests: u64,
    retries: u64,
    connection_errors: u64,
    in_use_409: u64,
    unavailable_503: u64,
    accepted_202: u64,
    replays_mid_run: u64,
    replays_at_end: u64,
    charges_in_db: u64,
    refunds_in_db: u64,
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        let pairs = [
            (&mut self.databases, o.databases),
            (&mut self.kills, o.kills),
            (&mut self.orphans_at_kills, o.orphans_at_kills),
            (&mut self.answered, o.answered),
            (&mut self.charges_acked, o.charges_acked),
            (&mut self.charges_declined, o.charges_declined),
            (&mut self.refunds_acked, o.refunds_acked),
            (&mut self.refunds_refused, o.refunds_refused),
            (&mut self.reference_replays, o.reference_replays),
            (&mut self.abandoned, o.abandoned),
            (&mut self.abandoned_finished, o.abandoned_finished),
            (&mut self.requests, o.requests),
            (&mut self.retries, o.retries),
            (&mut self.connection_errors, o.connection_errors),
            (&mut self.in_use_409, o.in_use_409),
            (&mut self.unavailable_503, o.unavailable_503),
            (&mut self.accepted_202, o.accepted_202),
            (&mut self.replays_mid_run, o.replays_mid_run),
            (&mut self.replays_at_end, o.replays_at_end),
            (&mut self.charges_in_db, o.charges_in_db),
            (&mut self.refunds_in_db, o.refunds_in_db),
        ];
        for (mine, theirs) in pairs {
            *mine += theirs;
        }
    }
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} kills on {} database(s), {} in-progress keys found in the file after them; \
             {} intents answered ({} charges acked 201, {} declined 402; {} refunds acked 201, \
             {} refused 402/422; {} reference replays); {} abandoned after one attempt ({} \
             reserved and finished without their client, the rest never reserved); {} requests, \
             {} of them retries (after {} connection errors, {} 409, {} 503, {} async 202); {} \
             replays compared byte for byte ({} during the run, {} at the end); {} charges and \
             {} refunds in the databases",
            self.kills,
            self.databases,
            self.orphans_at_kills,
            self.answered,
            self.charges_acked,
            self.charges_declined,
            self.refunds_acked,
            self.refunds_refused,
            self.reference_replays,
            self.abandoned,
            self.abandoned_finished,
            self.requests,
            self.retries,
            self.connection_errors,
            self.in_use_409,
            self.unavailable_503,
            self.accepted_202,
            self.replays_mid_run + self.replays_at_end,
            self.replays_mid_run,
            self.replays_at_end,
            self.charges_in_db,
            self.refunds_in_db,
        )
    }
}

/// Kills on one database. Every check after a kill reads the whole file,
/// and `idem verify`'s refund check is quadratic (it scans `entries` once
/// per refund: no index on `refund_id`), so a long run is a sequence of
/// fresh databases, each with its own seed, keeping the cost of a kill
/// bounded; the CI profile fits in one.
const KILLS_PER_DATABASE_MAX: u32 = 100;

/// The seed of database `index` of a run: the run's own seed for the first,
/// so that a failure in any database replays alone with the seed it prints.
fn database_seed(run_seed: u64, index: u64) -> u64 {
    match index {
        0 => run_seed,
        i => Rng::new(run_seed ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03)).next(),
    }
}

#[test]
fn sigkill_at_random_moments_loses_nothing_and_moves_money_once() {
    let profile = Profile::from_env();
    println!(
        "torture: seed {seed}, {kills} kills (replay: IDEM_TORTURE_SEED={seed} \
         IDEM_TORTURE_KILLS={kills} cargo test --test torture)",
        seed = profile.seed,
        kills = profile.kills
    );
    let began = Instant::now();
    let mut total = Figures::default();
    let mut left = profile.kills;
    for index in 0.. {
        let kills = left.min(KILLS_PER_DATABASE_MAX);
        let seed = database_seed(profile.seed, index);
        total.add(&run_database(seed, kills));
        left -= kills;
        if left == 0 {
            break;
        }
        println!(
            "torture: seed {}: {:.0} s so far: {total}",
            profile.seed,
            began.elapsed().as_secs_f64()
        );
    }
    println!(
        "torture: seed {}: ok in {:.1} s: {total}",
        profile.seed,
        began.elapsed().as_secs_f64()
    );
}

/// One database: clients run while the child is killed `kills` times, each
/// kill followed by every check; then the end checks.
fn run_database(seed: u64, kills: u32) -> Figures {
    let dir = TempDir::new("torture");
    let db = dir.db();
    let keys: Vec<String> = (0..CONSUMERS)
        .map(|i| support::create_consumer_cli(&db, &format!("torture-{i}")))
        .collect();
    let shared = Arc::new(Shared {
        seed,
        keys,
        addr: RwLock::new(None),
        stop: AtomicBool::new(false),
        abort: AtomicBool::new(false),
        kills: AtomicU64::new(0),
        answered: Mutex::new(Vec::new()),
        abandoned: Mutex::new(Vec::new()),
        failures: Mutex::new(Vec::new()),
        stats: Stats::default(),
    });
    let _abort = AbortOnDrop(Arc::clone(&shared));
    let ctx = |at: String| Ctx { seed, kills, at };

    let mut server = start_server(&ctx("first start".into()), &db);
    create_accounts(&ctx("setup".into()), server.addr, &shared.keys);
    *shared.addr.write().unwrap() = Some(server.addr);
    let barrier = Arc::new(Barrier::new(CLIENTS + 1));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (shared, barrier) = (Arc::clone(&shared), Arc::clone(&barrier));
            std::thread::spawn(move || Client::new(shared, i).run(&barrier))
        })
        .collect();
    barrier.wait();

    let mut rng = Rng::new(seed);
    let mut panics = Vec::new();
    let mut orphans_at_kills = 0;
    for n in 1..=kills {
        std::thread::sleep(kill_delay(&mut rng));
        panics.extend(kill(&shared, server));
        let at = ctx(format!("after kill {n}/{kills}"));
        let mut problems = take_failures(&shared);
        problems.extend(panics.iter().map(|p| format!("server stderr: {p}")));
        at.check(problems);
        let records = shared.answered.lock().unwrap().clone();
        let snapshot = check_quiescent(&at, &db, &records);
        let orphans = snapshot.keys.values().filter(|k| k.state == "in_progress");
        orphans_at_kills += orphans.count() as u64;
        server = start_server(&at, &db);
        *shared.addr.write().unwrap() = Some(server.addr);
    }

    let end = ctx("at the end".into());
    shared.stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.join().expect("client thread");
    }
    end.check(take_failures(&shared));
    drain(&end, &db);
    let abandoned = shared.abandoned.lock().unwrap().len() as u64;
    let finished = resolve_abandoned(&end, &shared, &db);
    let records = shared.answered.lock().unwrap().clone();
    let replays_mid_run = shared.stats.replays_compared.load(Ordering::Relaxed);
    replay_all(&end, &shared, &records);
    drain(&end, &db);
    panics.extend(kill(&shared, server));
    let mut problems = take_failures(&shared);
    problems.extend(panics.iter().map(|p| format!("server stderr: {p}")));
    end.check(problems);
    let snapshot = check_quiescent(&end, &db, &records);
    end.check(model_problems(&snapshot, &records));

    let count = |f: &dyn Fn(&Record) -> bool| records.iter().filter(|r| f(r)).count() as u64;
    let charge = |r: &Record| matches!(r.intent.kind, Kind::Charge { .. });
    let refund = |r: &Record| matches!(r.intent.kind, Kind::Refund { .. });
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let stats = &shared.stats;
    Figures {
        databases: 1,
        kills: u64::from(kills),
        orphans_at_kills,
        answered: records.len() as u64,
        charges_acked: count(&|r| charge(r) && r.first.status == 201),
        charges_declined: count(&|r| charge(r) && r.first.status == 402),
        refunds_acked: count(&|r| refund(r) && r.first.status == 201),
        refunds_refused: count(&|r| refund(r) && r.first.status != 201),
        reference_replays: count(&|r| matches!(r.intent.kind, Kind::ReferenceReplay { .. })),
        abandoned,
        abandoned_finished: finished as u64,
        requests: get(&stats.attempts),
        retries: get(&stats.retries),
        connection_errors: get(&stats.connection_errors),
        in_use_409: get(&stats.in_use_409),
        unavailable_503: get(&stats.unavailable_503),
        accepted_202: get(&stats.accepted_202),
        replays_mid_run,
        replays_at_end: get(&stats.replays_compared) - replays_mid_run,
        charges_in_db: snapshot.charges.len() as u64,
        refunds_in_db: snapshot.refunds.len() as u64,
    }
}

/// A way a bug could leave the file, and the words the checks must say.
struct Tampering {
    name: &'static str,
    sql: &'static str,
    /// Run on the copy of the acquirer simulator's file.
    acquirer_sql: &'static str,
    expect: &'static str,
}

/// The file holds one acknowledged charge of 700 from `fund_brl` to
/// `shop_brl_a` (for each of the three consumers' accounts, the statements
/// touch only that one charge's rows).
const TAMPERINGS: &[Tampering] = &[
    Tampering {
        name: "an acknowledged charge is lost (balances fixed up to hide it)",
        sql: "DELETE FROM entries; DELETE FROM charges; UPDATE accounts SET balance = 0;",
        acquirer_sql: "",
        expect: "lost: acknowledged charge",
    },
    Tampering {
        name: "the stored answer differs from the one the client saw",
        sql:
            "UPDATE idempotency_keys SET response_body = CAST(replace(CAST(response_body AS TEXT), \
              '\"amount\":700', '\"amount\":701') AS BLOB);",
        acquirer_sql: "",
        expect: "client saw 201",
    },
    Tampering {
        name: "one key moved money twice (consistently, so the sums still hold)",
        sql: "INSERT INTO charges (consumer_id, public_id, amount, currency, source_id, \
              destination_id, reference, metadata, fingerprint, op_id, idempotency_key, \
              authorization_id, created_at, status, amount_captured) SELECT consumer_id, \
              public_id || 'x', amount, currency, source_id, destination_id, NULL, metadata, \
              fingerprint, op_id || 'x', idempotency_key, authorization_id, created_at, status, \
              amount_captured FROM charges; \
              INSERT INTO entries (public_id, account_id, amount, charge_id, created_at) \
              SELECT public_id || 'x', account_id, amount, (SELECT max(id) FROM charges), \
              created_at FROM entries; UPDATE accounts SET balance = 2 * balance;",
        acquirer_sql: "",
        expect: "at most once: one charge per (consumer, key)",
    },
    Tampering {
        name: "money created out of nothing",
        sql: "UPDATE accounts SET balance = balance + 1 WHERE public_id = 'shop_brl_a';",
        acquirer_sql: "",
        expect: "conservation: balances sum to zero",
    },
    Tampering {
        name: "a merchant below zero",
        sql: "UPDATE entries SET amount = -amount; UPDATE accounts SET balance = -balance;",
        acquirer_sql: "",
        expect: "shop_brl_a is at -700",
    },
    Tampering {
        name: "an effect committed while its key is still in progress",
        sql: "UPDATE idempotency_keys SET state = 'in_progress', response_status = NULL, \
              response_body = NULL, completed_at = NULL;",
        acquirer_sql: "",
        expect: "an effect belongs to a completed key row",
    },
    Tampering {
        name: "an entry pointing at no account",
        sql: "PRAGMA foreign_keys = OFF; UPDATE entries SET account_id = 9999 \
              WHERE id = (SELECT min(id) FROM entries);",
        acquirer_sql: "",
        expect: "foreign_key_check",
    },
    Tampering {
        name: "the acquirer authorized one operation twice",
        sql: "",
        // As if the simulator had forgotten the key (a lost file, a prune
        // too early) and the takeover had been authorized afresh.
        acquirer_sql: "INSERT INTO calls (kind, key, authorization_id, amount, currency, created, \
                       timed_out, at) SELECT kind, key, authorization_id || 'x', amount, \
                       currency, 1, 0, at FROM calls;",
        expect: "authorized operation",
    },
];

/// The kills are only worth something if the checks fail when they should:
/// on a real file with one acknowledged charge, each tampering is caught and
/// named; the untouched copy passes.
#[test]
fn the_checks_catch_what_they_claim_to() {
    let dir = TempDir::new("torture-checks");
    let db = dir.db();
    let ctx = Ctx {
        seed: 0,
        kills: 0,
        at: "checks self-test".into(),
    };
    let keys: Vec<String> = (0..CONSUMERS)
        .map(|i| support::create_consumer_cli(&db, &format!("torture-{i}")))
        .collect();
    let server = start_server(&ctx, &db);
    create_accounts(&ctx, server.addr, &keys);
    let intent = Arc::new(Intent {
        client: 0,
        consumer: 0,
        key: "checks-key".into(),
        path: "/v1/charges".into(),
        body: json!({"amount": 700, "currency": "BRL", "source": "fund_brl",
                     "destination": "shop_brl_a", "reference": "checks-ref"})
        .to_string(),
        kind: Kind::Charge {
            amount: 700,
            source: "fund_brl",
            destination: "shop_brl_a",
            reference: "checks-ref".into(),
            may_decline: false,
        },
        respond_async: false,
    });
    let auth = format!("Bearer {}", keys[0]);
    let headers = [
        ("Authorization", auth.as_str()),
        ("Idempotency-Key", intent.key.as_str()),
    ];
    let r = support::send(
        server.addr,
        "POST",
        &intent.path,
        &headers,
        intent.body.as_bytes(),
    )
    .expect("charge");
    let first = Answer {
        status: r.status,
        body: r.body,
        replayed: false,
    };
    judge(&intent, &first).unwrap();
    let records = [Record { intent, first }];
    server.kill();
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
        .unwrap();
    drop(conn);
    let acquirer = idem::acquirer::Simulator::store_path(&db);
    let conn = Connection::open(&acquirer).unwrap();
    conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
        .unwrap();
    drop(conn);

    let copy = |name: &str| {
        let path = dir.0.join(name);
        std::fs::copy(&db, &path).unwrap();
        std::fs::copy(&acquirer, idem::acquirer::Simulator::store_path(&path)).unwrap();
        path
    };
    check_quiescent(&ctx, &copy("untouched.db"), &records);
    for (i, t) in TAMPERINGS.iter().enumerate() {
        let path = copy(&format!("tampered-{i}.db"));
        Connection::open(&path)
            .unwrap()
            .execute_batch(t.sql)
            .unwrap();
        Connection::open(idem::acquirer::Simulator::store_path(&path))
            .unwrap()
            .execute_batch(t.acquirer_sql)
            .unwrap();
        let caught = std::panic::catch_unwind(|| check_quiescent(&ctx, &path, &records));
        let message = match caught {
            Ok(_) => panic!("not caught: {}", t.name),
            Err(e) => e.downcast_ref::<String>().cloned().unwrap_or_default(),
        };
        assert!(
            message.contains(t.expect) && message.contains("seed 0, checks self-test"),
            "{}: expected {:?} in:\n{message}",
            t.name,
            t.expect
        );
    }
}
