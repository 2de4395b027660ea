//! Torture: concurrent clients, each retrying its own intents with the same
//! key until it gets a final answer, against an `idem serve` child that is
//! SIGKILLed and restarted at random moments. After every kill (the child is
//! dead, the file quiescent) and at the end, the database is checked directly
//! in SQL, with `idem verify` (which also holds the ledger against the
//! acquirer simulator's file), against the simulator's journal of calls, and
//! against every answer a client was given: conservation and holds, nothing
//! acknowledged lost, at most one effect per key and per reference, at most
//! one capture and one void per authorization and none for a refused
//! capture or cancel, every stored answer byte-identical to the one the
//! client saw, and structure (integrity, foreign keys, orphans the reaper can
//! finish, claims on holds that someone will release).
//!
//! The intents: sales, and holds (`"capture": false`) from a funding account
//! or from a merchant (which may be declined with 402); full and partial
//! captures and cancels of acknowledged holds, captures over the
//! authorization (422), captures and cancels of holds already settled or
//! past their expiry (409), and races — a capture against a cancel or
//! against another capture of one hold, sent from two threads a few
//! milliseconds apart, whose loser's final answer is 409
//! `invalid-charge-state`; refunds of sales and of captured holds (the client
//! knows exactly what is left: 422 past it, else 201 or 402) and of holds
//! that are not captured (409 only); reference replays. Some holds are left
//! alone: the child runs with an `--authorization-ttl` of
//! `AUTHORIZATION_TTL_MS`, so they expire during the run and the reaper voids
//! and releases them; a fifth of the kills aim at the reaper's first pass
//! after a restart, which expires the holds that lapsed while the child was
//! down, so some kills land in the middle of an expiry (claimed, voided at
//! the acquirer, not yet released), which the next pass must finish. The
//! `judge` accepts exactly the final answers the contract allows an intent,
//! given what its client knows: a 200 of a capture or cancel names that
//! charge with the right status and amounts, and a capture created after its
//! hold's `expires_at` cannot succeed.
//!
//! Chargebacks: a client also sends signed `chargeback.created`
//! notifications (Standard Webhooks, its consumer's notification source's
//! secret, no bearer key) for charges of its own with captured money, each
//! with a fresh `webhook-id` and retried with that id and body across kills
//! until answered: 200 `applied` within what its client knows is left
//! (captured, less its refunds and disputes: only it refunds or disputes
//! the charge, so the refund judge stays exact too), else 422
//! `dispute-exceeds-charge`; some are sent as 2–4 concurrent copies of one
//! id (one answer, at most one not a replay), and answered ones are re-sent
//! like any intent (a byte-identical replay).
//!
//! Events: each consumer has one webhook endpoint (`enabled_events: ["*"]`,
//! created before any other write) at a receiver in this process, which
//! checks every attempt's signature with the reference `standardwebhooks`
//! crate, keys arrivals by `webhook-id`, fails the run if an id ever comes
//! back with other bytes, and refuses a seeded fifth of the attempts (500,
//! or the connection closed unanswered), so that deliveries are retried,
//! also across kills. After every kill `idem verify` pairs each state change
//! with its one event; at the end every delivery must have succeeded and
//! the ids the receiver accepted must be exactly the events in the file,
//! each byte-identical to `events.body`: none lost, none invented.
//!
//! Seeded: `IDEM_TORTURE_SEED=<u64>` replays the schedule of intents and of
//! kill moments. Thread timing is not deterministic, so which request a kill
//! interrupts, and hence which answers come back, differ between two runs of
//! one seed. `IDEM_TORTURE_KILLS=<n>` sets the number of kills (default
//! `KILLS_DEFAULT`, the CI profile; README.md tells how to run the long one),
//! spread over fresh databases of at most `KILLS_PER_DATABASE_MAX` kills each.
//! At the end of each database the reaper must have resolved every orphan
//! and every hold, every answered intent is re-sent once more, and the
//! database must hold exactly the charges and refunds the answers name, with
//! every hold settled as its answers say: captured by the one capture
//! answered 200, canceled by the one cancel answered 200, or — when none
//! was — canceled with `cancellation_reason: expired`; and a 409 of a capture
//! or cancel that came back before its hold expired must have lost to another
//! capture or cancel of that hold answered 200 (before the expiry nothing
//! else claims a hold). Each chargeback answered 200 has its one
//! notification row and one dispute of its amount, whose money moved once
//! (the model's balances and each charge's `amount_disputed` include it);
//! one answered 422 moved nothing; no notification or dispute is there that
//! nobody was answered. A second test tampers with copies of a real file
//! (and with the answers and the receiver's log) to show that each check
//! fails when it should, and a third that the judge accepts exactly what the
//! contract allows.
//!
//! Both backends, one set of checks: every read of the ledger goes through
//! idem's storage interface (`idem::store::inspect`, a snapshot on
//! PostgreSQL), in SQL both engines run; SQLite's own `integrity_check` and
//! `foreign_key_check` run on a file only. With `IDEM_TEST_POSTGRES` set,
//! each database is a fresh PostgreSQL one, and the acquirer simulator's
//! file (SQLite on either backend) is the `--acquirer-store` its servers
//! share. The tamper self-test then works on copies of the database
//! (`CREATE DATABASE ... TEMPLATE`), with the tamperings that do not edit
//! the simulator's file or SQLite's own structure.
//!
//! Three nodes (PostgreSQL only, `three_nodes_sigkilled_at_random_moves_money_once`):
//! three `idem serve` on one database and one acquirer store. Each attempt
//! of an intent goes to the next live node after the one its previous
//! attempt went to, so a re-send after a kill, a transport error, a 409 or a
//! 503 lands on another node: an owner killed on one node is taken over by
//! a retry on another once `--inflight-timeout` has passed, or finished by
//! any node's reaper. A random node is SIGKILLed at random moments and
//! restarted; every `CLUSTER_KILL_EVERY`th kill takes all of them down at
//! once. After a kill of one node the others write on, so what is checked
//! then is what holds in any one snapshot: the SQL checks and every answer
//! given before it. After a kill of all nodes and at the end, everything
//! the one-node test checks.

mod support;

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, RwLock};
use std::time::{Duration, Instant};

use idem::acquirer::{Call, CallKind, Simulator};
use idem::store::{Arg, Db, Dialect};
use idem::time::now_ms;
use rusqlite::Connection;
use serde_json::{json, Value};
use support::{ChildServer, TempDir};

/// The parameters of a statement through idem's storage interface:
/// `args![a, b]` binds `?1` and `?2`.
macro_rules! args {
    ($($x:expr),* $(,)?) => {
        &[$(&$x as &dyn Arg),*] as &[&dyn Arg]
    };
}

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
/// a charge between its reservation and its ledger commit, and an expiry
/// between its void and its release.
const ACQUIRER_LATENCY: &str = "5ms";
/// `--authorization-ttl`: short, so that holds left alone expire during the
/// run (and the end waits at most this long for the last ones), long enough
/// that a client captures or cancels most holds in time.
const AUTHORIZATION_TTL_MS: i64 = 2_000;
/// A capture or cancel is aimed at a hold "past its expiry" only this long
/// after it, by the test's clock (the server's is the same clock).
const LATE_MARGIN_MS: i64 = 10;
/// An intent without a final answer after this long is a failure (a server
/// that does not converge), not a hang of the test.
const INTENT_DEADLINE: Duration = Duration::from_secs(60);
/// How long the end waits for the reaper to resolve every in-progress key
/// (and, after the authorization TTL, every hold).
const DRAIN_DEADLINE: Duration = Duration::from_secs(30);
/// Pause before re-sending after a 409 or 503 (the server says
/// `Retry-After: 1`; a torture client is impatient on purpose) and after a
/// connection error (the server is down or restarting).
const RETRY_PAUSE: Duration = Duration::from_millis(40);
const DOWN_PAUSE: Duration = Duration::from_millis(10);
/// Webhook delivery: a short backoff base, so that the retries of attempts
/// the receiver refuses happen during the run and across its kills; a
/// timeout well above what the receiver takes to answer; and attempts enough
/// that a delivery refused over and over (`RECEIVER_FAULT_PERCENT` each
/// time) is not given up on (0.2^30) but shows as pending, then lost.
const WEBHOOK_RETRY_BASE: &str = "20ms";
const WEBHOOK_TIMEOUT: &str = "2s";
const WEBHOOK_ATTEMPTS_MAX: &str = "30";
/// The share of webhook attempts the receiver refuses, half with a 500 and
/// half by closing the connection without an answer.
const RECEIVER_FAULT_PERCENT: u64 = 20;
/// How long the end waits for every delivery to succeed after the last
/// state change (the backoff after 10 refusals in a row is at most ~10 s).
const DELIVERY_DRAIN_DEADLINE: Duration = Duration::from_secs(45);

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
    /// `default_kills` unless `IDEM_TORTURE_KILLS` says.
    fn from_env(default_kills: u32) -> Profile {
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
            Err(_) => default_kills,
        };
        Profile { seed, kills }
    }
}

#[derive(Debug, Clone)]
enum Kind {
    /// A new charge with its own `reference`: a sale, or with `capture:
    /// false` a hold. `may_decline`: the source is a merchant, so 402 is a
    /// legitimate answer.
    Charge {
        amount: i64,
        source: &'static str,
        destination: &'static str,
        reference: String,
        may_decline: bool,
        capture: bool,
    },
    /// A new key with the body (hence the `reference`) of an acknowledged
    /// charge or hold: must answer 200 with that charge and move nothing.
    ReferenceReplay { charge: String, reference: String },
    /// A refund of an acknowledged charge; `amount: None` refunds what is
    /// left. `left`: what its client knows is left to refund of the captured
    /// money (nobody else refunds this charge); `None` when the charge is a
    /// hold that is not captured (open, canceled or lapsed): only 409.
    Refund {
        charge: String,
        amount: Option<i64>,
        left: Option<i64>,
    },
    /// A capture of an acknowledged hold of `authorized`, which expires at
    /// `expires_at_ms`; `amount: None` captures all of it. `settled`: its
    /// client knows the hold can no longer be captured (captured, canceled,
    /// or refused a capture or cancel already): only 409.
    Capture {
        charge: String,
        amount: Option<i64>,
        authorized: i64,
        expires_at_ms: i64,
        settled: bool,
    },
    /// A cancel of an acknowledged hold; `settled`: its client knows it was
    /// captured or canceled already: only 409.
    Cancel {
        charge: String,
        authorized: i64,
        settled: bool,
    },
    /// A signed `chargeback.created` notification from the consumer's
    /// source `source` (its key is the `webhook-id`) for `amount` of
    /// `charge` (a sale or a captured hold of the client's, whose
    /// authorization it names). `left`: what its client knows is left of the
    /// captured money, less refunds and disputes (nobody else refunds or
    /// disputes this charge): 200 `applied` within it, else 422.
    Chargeback {
        charge: String,
        source: String,
        amount: i64,
        left: i64,
    },
}

impl Kind {
    /// The hold a capture or cancel is aimed at.
    fn settles(&self) -> Option<&str> {
        match self {
            Kind::Capture { charge, .. } | Kind::Cancel { charge, .. } => Some(charge),
            _ => None,
        }
    }
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
    /// When the intent was made (ms since the epoch), before its first send.
    created_ms: i64,
    /// What the client meant, for the figures: "sale", "late capture", …
    tag: &'static str,
}

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    body: Vec<u8>,
    replayed: bool,
    /// When it came back (ms since the epoch).
    received_ms: i64,
}

impl Answer {
    fn json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }

    fn text(&self) -> String {
        format!("{} {}", self.status, String::from_utf8_lossy(&self.body))
    }

    /// The `id` its body names, if any.
    fn id(&self) -> Option<String> {
        self.json()
            .and_then(|b| b["id"].as_str().map(str::to_string))
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
    /// Re-sends that went to another node than the attempt before.
    retries_elsewhere: AtomicU64,
    /// Why a request had to be re-sent.
    connection_errors: AtomicU64,
    in_use_409: AtomicU64,
    accepted_202: AtomicU64,
    unavailable_503: AtomicU64,
    replays_compared: AtomicU64,
    /// Races of two captures or a capture and a cancel of one hold, and who
    /// won them.
    races: AtomicU64,
    races_won_by_capture: AtomicU64,
    races_won_by_cancel: AtomicU64,
    races_won_by_nobody: AtomicU64,
    /// Notifications sent as several concurrent copies of one id, and the
    /// copies.
    copied_notifications: AtomicU64,
    copies: AtomicU64,
}

/// A consumer's notification source: where its chargebacks are posted and
/// the secret they are signed with.
#[derive(Debug, Clone)]
struct Source {
    id: String,
    secret: String,
}

/// What the clients and the kill loop share.
struct Shared {
    seed: u64,
    keys: Vec<String>,
    /// Consumer `i`'s notification source.
    sources: Vec<Source>,
    /// Where each node (an `idem serve` child on the one database)
    /// listens; `None` while it is down.
    nodes: RwLock<Vec<Option<SocketAddr>>>,
    /// Turns of the first attempts, which spread them over the nodes.
    first_turn: AtomicUsize,
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
        for node in self.0.nodes.write().unwrap().iter_mut() {
            *node = None;
        }
    }
}

/// Where a failure happened, for every assertion message.
struct Ctx {
    /// The test that runs it, and the database's seed and kills: what
    /// replays this schedule alone.
    test: &'static str,
    seed: u64,
    kills: u32,
    at: String,
}

impl Ctx {
    fn fail(&self, problems: &[String]) -> ! {
        let shown: Vec<&String> = problems.iter().take(30).collect();
        panic!(
            "torture failed (seed {seed}, {at}; replay with IDEM_TORTURE_SEED={seed} \
             IDEM_TORTURE_KILLS={kills} cargo test --test torture {test}): {n} problem(s):\n{list}",
            test = self.test,
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
    /// Connection error, 409 (key or reference in use) or 503: send the same
    /// again.
    Retry,
    /// The server is down: nothing was sent.
    Down,
}

/// The live node an attempt goes to: the first live one after `last`, the
/// node of the intent's attempt before (in node order, wrapping), so that a
/// re-send after a kill, a transport error, a 409 or a 503 goes to another
/// node when there is one; a first attempt starts at the next node in turn.
fn pick_node(shared: &Shared, last: Option<usize>) -> Option<(usize, SocketAddr)> {
    let nodes = shared.nodes.read().unwrap();
    let n = nodes.len();
    let start = match last {
        Some(last) => last + 1,
        None => shared.first_turn.fetch_add(1, Ordering::Relaxed),
    };
    (start..start + n)
        .map(|i| i % n)
        .find_map(|i| nodes[i].map(|addr| (i, addr)))
}

/// One attempt of `intent`, at the node after `last` (see [`pick_node`]),
/// which it then names.
fn attempt(shared: &Shared, intent: &Intent, last: &mut Option<usize>) -> Attempt {
    let Some((node, addr)) = pick_node(shared, *last) else {
        std::thread::sleep(DOWN_PAUSE);
        return Attempt::Down;
    };
    if last.is_some_and(|l| l != node) {
        shared
            .stats
            .retries_elsewhere
            .fetch_add(1, Ordering::Relaxed);
    }
    *last = Some(node);
    shared.stats.attempts.fetch_add(1, Ordering::Relaxed);
    let secret = match &intent.kind {
        Kind::Chargeback { .. } => &shared.sources[intent.consumer].secret,
        _ => &shared.keys[intent.consumer],
    };
    match send_intent(addr, secret, intent) {
        Err(_) => {
            shared
                .stats
                .connection_errors
                .fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(DOWN_PAUSE);
            Attempt::Retry
        }
        Ok(r) => {
            let answer = Answer {
                status: r.status,
                replayed: r.replayed(),
                body: r.body,
                received_ms: now_ms(),
            };
            // A 409 about the charge is a final answer; about the key or
            // the reference, a "come back later".
            let busy = answer.status == 409 && !is_slug(&answer, "invalid-charge-state");
            let counter = match answer.status {
                503 => &shared.stats.unavailable_503,
                202 if intent.respond_async => &shared.stats.accepted_202,
                409 if busy => &shared.stats.in_use_409,
                _ => return Attempt::Final(answer),
            };
            counter.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(RETRY_PAUSE);
            Attempt::Retry
        }
    }
}

/// One attempt of `intent`: with the consumer's bearer key `secret` and the
/// intent's `Idempotency-Key`; a notification with no bearer key, signed
/// per Standard Webhooks with its source's `secret` (a fresh timestamp on
/// every attempt, as a sender that retries signs anew) and its key as the
/// `webhook-id`.
fn send_intent(addr: SocketAddr, secret: &str, intent: &Intent) -> std::io::Result<support::Resp> {
    let body = intent.body.as_bytes();
    if let Kind::Chargeback { .. } = intent.kind {
        let timestamp = now_ms().div_euclid(1000);
        let signature = standardwebhooks::Webhook::new(secret)
            .and_then(|w| w.sign(&intent.key, timestamp, body))
            .expect("a whsec_ secret and a UTF-8 body");
        let timestamp = timestamp.to_string();
        let headers = [
            ("webhook-id", intent.key.as_str()),
            ("webhook-timestamp", timestamp.as_str()),
            ("webhook-signature", signature.as_str()),
            ("Content-Type", "application/json"),
        ];
        return support::send(addr, "POST", &intent.path, &headers, body);
    }
    let auth = format!("Bearer {secret}");
    let mut headers = vec![
        ("Authorization", auth.as_str()),
        ("Idempotency-Key", intent.key.as_str()),
        ("Content-Type", "application/json"),
    ];
    if intent.respond_async {
        headers.push(("Prefer", "respond-async"));
    }
    support::send(addr, "POST", &intent.path, &headers, body)
}

/// Sends `intent` until it gets a final answer; `None` if the test aborted
/// or the deadline passed (recorded as a failure).
fn until_final(shared: &Shared, intent: &Intent) -> Option<Answer> {
    let deadline = Instant::now() + INTENT_DEADLINE;
    let mut sent = false;
    let mut node = None;
    loop {
        if shared.abort.load(Ordering::SeqCst) {
            return None;
        }
        let outcome = attempt(shared, intent, &mut node);
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

/// `2026-11-30T10:01:12.123Z` (idem's one rendering) as ms since the epoch;
/// `None` for anything that `idem::time::rfc3339` would not render so.
fn parse_rfc3339_ms(text: &str) -> Option<i64> {
    let field = |from: usize, to: usize| -> Option<i64> {
        let digits = text.get(from..to)?;
        if !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    };
    let (y, m, d) = (field(0, 4)?, field(5, 7)?, field(8, 10)?);
    let (hh, mm, ss, ms) = (
        field(11, 13)?,
        field(14, 16)?,
        field(17, 19)?,
        field(20, 23)?,
    );
    // Howard Hinnant's days-from-civil, the inverse of idem's rendering.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let at = ((days * 24 + hh) * 60 + mm) * 60_000 + ss * 1000 + ms;
    // Whatever the fields held, only a faithful round trip is a time.
    (idem::time::rfc3339(at) == text).then_some(at)
}

/// A charge body's time field `name` in ms, if it has one.
fn time_of(body: &Value, name: &str) -> Option<i64> {
    body[name].as_str().and_then(parse_rfc3339_ms)
}

/// Is `answer` a legitimate final answer to `intent`? Returns what is wrong.
fn judge(intent: &Intent, answer: &Answer) -> Result<(), String> {
    let body = answer.json().unwrap_or(Value::Null);
    let charge_state = || is_slug(answer, "invalid-charge-state");
    // A capture or cancel's 200: the charge it settled, the hold released.
    let settled_charge = |charge: &str, authorized: i64| {
        body["object"] == "charge"
            && body["id"] == json!(charge)
            && body["amount"] == json!(authorized)
            && body["amount_capturable"] == 0
            && body["amount_refunded"] == 0
            && body["expires_at"].is_null()
    };
    let ok = match (&intent.kind, answer.status) {
        (
            Kind::Charge {
                amount,
                source,
                destination,
                reference,
                capture,
                ..
            },
            201,
        ) => {
            let common = body["object"] == "charge"
                && body["id"].as_str().is_some_and(|id| id.starts_with("ch_"))
                && body["amount"] == json!(amount)
                && body["source"] == json!(source)
                && body["destination"] == json!(destination)
                && body["reference"] == json!(reference)
                && body["authorization"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("auth_"))
                && body["amount_refunded"] == 0
                && body["canceled_at"].is_null()
                && body["cancellation_reason"].is_null();
            let lifetime = time_of(&body, "expires_at")
                .zip(time_of(&body, "created_at"))
                .map(|(expires, created)| expires - created);
            common
                && if *capture {
                    body["status"] == "succeeded"
                        && body["amount_captured"] == json!(amount)
                        && body["amount_capturable"] == 0
                        && body["expires_at"].is_null()
                } else {
                    body["status"] == "requires_capture"
                        && body["amount_captured"] == 0
                        && body["amount_capturable"] == json!(amount)
                        && lifetime == Some(AUTHORIZATION_TTL_MS)
                }
        }
        (Kind::Charge { may_decline, .. }, 402) => {
            *may_decline && is_slug(answer, "insufficient-funds")
        }
        (Kind::ReferenceReplay { charge, .. }, 200) => {
            body["object"] == "charge" && body["id"] == json!(charge) && answer.replayed
        }
        (
            Kind::Refund {
                charge,
                amount,
                left: Some(left),
            },
            201,
        ) => {
            let refunded = amount.unwrap_or(*left);
            body["object"] == "refund"
                && body["id"].as_str().is_some_and(|id| id.starts_with("re_"))
                && body["charge"] == json!(charge)
                && body["amount"] == json!(refunded)
                && 0 < refunded
                && refunded <= *left
        }
        (
            Kind::Refund {
                amount,
                left: Some(left),
                ..
            },
            402 | 422,
        ) => {
            // What is left is checked first: only a refund that fits may
            // then be declined for the destination's funds.
            let fits = amount.map_or(*left > 0, |a| a <= *left);
            if answer.status == 402 {
                fits && is_slug(answer, "insufficient-funds")
            } else {
                !fits && is_slug(answer, "refund-exceeds-charge")
            }
        }
        (Kind::Refund { left: None, .. }, 409) => charge_state(),
        (
            Kind::Capture {
                charge,
                amount,
                authorized,
                expires_at_ms,
                settled,
            },
            200,
        ) => {
            // The claim is made when the key is reserved, after the intent
            // was made: one made after the expiry cannot win it.
            !settled
                && intent.created_ms < *expires_at_ms
                && amount.is_none_or(|a| a <= *authorized)
                && settled_charge(charge, *authorized)
                && body["status"] == "succeeded"
                && body["amount_captured"] == json!(amount.unwrap_or(*authorized))
                && body["canceled_at"].is_null()
                && body["cancellation_reason"].is_null()
        }
        (Kind::Capture { .. }, 409) => charge_state(),
        (
            Kind::Capture {
                amount, authorized, ..
            },
            422,
        ) => {
            amount.is_some_and(|a| a > *authorized)
                && is_slug(answer, "capture-exceeds-authorization")
        }
        (
            Kind::Cancel {
                charge,
                authorized,
                settled,
            },
            200,
        ) => {
            !settled
                && settled_charge(charge, *authorized)
                && body["status"] == "canceled"
                && body["amount_captured"] == 0
                && body["cancellation_reason"] == "requested"
                && time_of(&body, "canceled_at").is_some()
        }
        (Kind::Cancel { .. }, 409) => charge_state(),
        (
            Kind::Chargeback {
                source,
                amount,
                left,
                ..
            },
            200,
        ) => {
            body["object"] == "notification"
                && body["id"].as_str().is_some_and(|id| id.starts_with("ntf_"))
                && body["source"] == json!(source)
                && body["type"] == "chargeback.created"
                && body["status"] == "applied"
                && time_of(&body, "received_at").is_some()
                && 0 < *amount
                && amount <= left
        }
        (Kind::Chargeback { amount, left, .. }, 422) => {
            amount > left && is_slug(answer, "dispute-exceeds-charge")
        }
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "client {} {} key {} body {} ({}): unexpected final answer {}",
            intent.client,
            intent.path,
            intent.key,
            intent.body,
            intent.tag,
            answer.text()
        ))
    }
}

/// What a client knows of a charge it created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Captured this much: a sale, or a hold whose capture answered 200.
    Captured(i64),
    /// A hold nobody has captured or canceled yet.
    Open,
    /// A hold whose cancel answered 200.
    Canceled,
    /// A hold whose capture or cancel answered 409 with nothing else
    /// trying: it lapsed (the expiry has it); it can no longer be captured.
    Lapsed,
    /// A capture or cancel of this hold was abandoned: what became of it
    /// shows at the end; the client leaves it alone.
    Unknown,
}

/// A charge its client created and was told of.
struct Owned {
    id: String,
    /// The intent that created it (for reference replays).
    intent: Arc<Intent>,
    amount: i64,
    /// A hold's `expires_at`.
    expires_at_ms: Option<i64>,
    /// A hold its client will not capture or cancel before it expires.
    left_alone: bool,
    fate: Fate,
    /// What its refunds answered 201 add up to.
    refunded: i64,
    /// Its acquirer authorization, which chargebacks name.
    authorization: String,
    /// What its chargebacks answered 200 add up to.
    disputed: i64,
}

/// A client's own view: what it was answered, and the charges it created
/// that captures, cancels, refunds and reference replays pick from.
struct Client {
    shared: Arc<Shared>,
    index: usize,
    consumer: usize,
    rng: Rng,
    mine: Vec<Record>,
    owned: Vec<Owned>,
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
            owned: Vec::new(),
        }
    }

    fn run(mut self, barrier: &Barrier) {
        barrier.wait();
        while !self.shared.stop.load(Ordering::SeqCst) && !self.shared.abort.load(Ordering::SeqCst)
        {
            let roll = self.rng.below(100);
            if roll < 8 && !self.mine.is_empty() {
                self.replay_one();
                continue;
            }
            if roll < 14 {
                let hold = self.rng.percent(40);
                let intent = self.new_charge(!hold);
                self.abandon_after_one_attempt(intent);
                continue;
            }
            if roll < 26 && self.refund_one() {
                continue;
            }
            if roll < 29 && !self.owned.is_empty() {
                let intent = self.new_reference_replay();
                self.carry_out(intent);
                continue;
            }
            if roll < 52 && self.settle_one() {
                continue;
            }
            if roll >= 94 && self.chargeback_one() {
                continue;
            }
            // A hold or a sale; also when there was nothing to refund or
            // settle.
            let intent = self.new_charge(roll >= 70);
            self.carry_out(intent);
        }
    }

    /// A new intent with its own key; one in five asks for async mode.
    fn intent(&mut self, path: String, body: String, kind: Kind, tag: &'static str) -> Arc<Intent> {
        Arc::new(Intent {
            client: self.index,
            consumer: self.consumer,
            key: self.rng.uuid(),
            path,
            body,
            kind,
            respond_async: self.rng.percent(20),
            created_ms: now_ms(),
            tag,
        })
    }

    /// A sale (`capture`) or a hold, from the funding account or between
    /// merchants.
    fn new_charge(&mut self, capture: bool) -> Arc<Intent> {
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
        let mut body = json!({
            "amount": amount,
            "currency": currency,
            "source": source,
            "destination": destination,
            "reference": reference,
        });
        if !capture {
            body["capture"] = json!(false);
        }
        let kind = Kind::Charge {
            amount,
            source,
            destination,
            reference,
            may_decline: !from_funding,
            capture,
        };
        let tag = if capture { "sale" } else { "hold" };
        self.intent("/v1/charges".to_string(), body.to_string(), kind, tag)
    }

    /// A refund: mostly of captured money (a sale or a captured hold),
    /// sometimes of a hold that is not captured (409 only). False if there
    /// is nothing to refund.
    fn refund_one(&mut self) -> bool {
        let captured: Vec<usize> = self.indices(|o| matches!(o.fate, Fate::Captured(_)));
        let uncaptured: Vec<usize> =
            self.indices(|o| matches!(o.fate, Fate::Open | Fate::Canceled | Fate::Lapsed));
        let (i, left, tag) =
            if !uncaptured.is_empty() && (captured.is_empty() || self.rng.percent(15)) {
                (
                    *self.rng.pick(&uncaptured),
                    None,
                    "refund of a hold not captured",
                )
            } else if !captured.is_empty() {
                let i = *self.rng.pick(&captured);
                let Fate::Captured(c) = self.owned[i].fate else {
                    unreachable!("picked among the captured")
                };
                let o = &self.owned[i];
                (i, Some(c - o.refunded - o.disputed), "refund")
            } else {
                return false;
            };
        let (charge, of) = (self.owned[i].id.clone(), self.owned[i].amount);
        let amount = if self.rng.percent(30) {
            None
        } else {
            Some(self.rng.between(1, of as u64) as i64)
        };
        let body = match amount {
            Some(a) => json!({ "amount": a }),
            None => json!({}),
        }
        .to_string();
        let path = format!("/v1/charges/{charge}/refunds");
        let kind = Kind::Refund {
            charge,
            amount,
            left,
        };
        let intent = self.intent(path, body, kind, tag);
        self.carry_out(intent);
        true
    }

    /// A chargeback of a charge with captured money (a sale or a captured
    /// hold): mostly a small part of what is left, sometimes all of it,
    /// sometimes more (422); one in six sent as several concurrent copies
    /// of one `webhook-id`. False if there is no captured charge.
    fn chargeback_one(&mut self) -> bool {
        let captured: Vec<usize> = self.indices(|o| matches!(o.fate, Fate::Captured(_)));
        if captured.is_empty() {
            return false;
        }
        let i = *self.rng.pick(&captured);
        let Fate::Captured(c) = self.owned[i].fate else {
            unreachable!("picked among the captured")
        };
        let left = c - self.owned[i].refunded - self.owned[i].disputed;
        let (amount, tag) = if left <= 0 || self.rng.percent(10) {
            let over = left.max(0) + self.rng.between(1, 100) as i64;
            (over, "chargeback over what is left")
        } else if self.rng.percent(10) {
            (left, "chargeback of all that is left")
        } else {
            let small = self.rng.between(1, (left as u64).div_ceil(4)) as i64;
            (small, "chargeback")
        };
        let mut data = json!({"authorization": self.owned[i].authorization, "amount": amount});
        if self.rng.percent(50) {
            let reason = *self
                .rng
                .pick(&["fraudulent", "product_not_received", "duplicate"]);
            data["reason"] = json!(reason);
        }
        let source = self.shared.sources[self.consumer].clone();
        let webhook_id = format!("msg_{}", self.rng.uuid().replace('-', ""));
        let intent = Arc::new(Intent {
            client: self.index,
            consumer: self.consumer,
            key: webhook_id,
            path: format!("/v1/notifications/{}", source.id),
            body: json!({"type": "chargeback.created", "data": data}).to_string(),
            kind: Kind::Chargeback {
                charge: self.owned[i].id.clone(),
                source: source.id,
                amount,
                left,
            },
            respond_async: false,
            created_ms: now_ms(),
            tag,
        });
        if self.rng.percent(16) {
            self.send_copies(intent);
        } else {
            self.carry_out(intent);
        }
        true
    }

    /// Sends 2 to 4 copies of one notification at once, from as many
    /// threads, each until its final answer: every copy gets the same status
    /// and bytes, and at most one of them is not a replay (one effect, which
    /// the end checks find once in the database).
    fn send_copies(&mut self, intent: Arc<Intent>) {
        let copies = self.rng.between(2, 4) as usize;
        let shared = Arc::clone(&self.shared);
        let answers: Vec<Option<Answer>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..copies)
                .map(|_| s.spawn(|| until_final(&shared, &intent)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("copy thread"))
                .collect()
        });
        let Some(answers) = answers.into_iter().collect::<Option<Vec<Answer>>>() else {
            return;
        };
        let stats = &self.shared.stats;
        stats.copied_notifications.fetch_add(1, Ordering::Relaxed);
        stats.copies.fetch_add(copies as u64, Ordering::Relaxed);
        let fresh = answers.iter().filter(|a| !a.replayed).count();
        let first = answers
            .iter()
            .find(|a| !a.replayed)
            .unwrap_or(&answers[0])
            .clone();
        let shown: Vec<String> = answers
            .iter()
            .map(|a| format!("{} (replayed: {})", a.text(), a.replayed))
            .collect();
        if fresh > 1
            || answers
                .iter()
                .any(|a| (a.status, &a.body) != (first.status, &first.body))
        {
            self.shared.fail(format!(
                "{copies} concurrent copies of notification {} got {fresh} answers not marked \
                 as replays, or different answers: {shown:?}",
                intent.key
            ));
        }
        self.record(intent, first);
    }

    fn new_reference_replay(&mut self) -> Arc<Intent> {
        let i = self.rng.below(self.owned.len() as u64) as usize;
        let (charge, of) = (self.owned[i].id.clone(), Arc::clone(&self.owned[i].intent));
        let Kind::Charge { reference, .. } = &of.kind else {
            unreachable!("only charges are owned")
        };
        let kind = Kind::ReferenceReplay {
            charge,
            reference: reference.clone(),
        };
        self.intent(of.path.clone(), of.body.clone(), kind, "reference replay")
    }

    fn indices(&self, f: impl Fn(&Owned) -> bool) -> Vec<usize> {
        (0..self.owned.len())
            .filter(|&i| f(&self.owned[i]))
            .collect()
    }

    /// Captures or cancels one of this client's holds, one way or another;
    /// false if it has none to aim at.
    fn settle_one(&mut self) -> bool {
        let now = now_ms();
        let late = |o: &Owned| o.expires_at_ms.is_some_and(|at| now > at + LATE_MARGIN_MS);
        let open = self.indices(|o| o.fate == Fate::Open && !o.left_alone);
        let lapsed_alone = self.indices(|o| o.fate == Fate::Open && o.left_alone && late(o));
        let settled = self.indices(|o| {
            o.expires_at_ms.is_some() && matches!(o.fate, Fate::Captured(_) | Fate::Canceled)
        });
        let roll = self.rng.below(100);
        if roll < 15 && !lapsed_alone.is_empty() {
            // Past its expiry: a capture is refused, a cancel may still
            // beat the reaper to it.
            let i = *self.rng.pick(&lapsed_alone);
            let intent = if self.rng.percent(70) {
                self.capture_intent(i, None, "late capture")
            } else {
                self.cancel_intent(i, "late cancel")
            };
            self.carry_out(intent);
        } else if roll < 22 && !settled.is_empty() {
            let i = *self.rng.pick(&settled);
            let intent = if self.rng.percent(50) {
                let amount = self.capture_amount(i);
                self.capture_intent(i, amount, "capture of a settled hold")
            } else {
                self.cancel_intent(i, "cancel of a settled hold")
            };
            self.carry_out(intent);
        } else if !open.is_empty() {
            let i = *self.rng.pick(&open);
            let authorized = self.owned[i].amount;
            let how = self.rng.below(100);
            if how < 28 {
                let intent = self.capture_intent(i, None, "capture");
                self.carry_out(intent);
            } else if how < 46 {
                let amount = Some(self.rng.between(1, authorized as u64) as i64);
                let intent = self.capture_intent(i, amount, "partial capture");
                self.carry_out(intent);
            } else if how < 64 {
                let intent = self.cancel_intent(i, "cancel");
                self.carry_out(intent);
            } else if how < 86 {
                self.race(i);
            } else if how < 92 {
                let over = Some(authorized + self.rng.between(1, 500) as i64);
                let intent = self.capture_intent(i, over, "capture over the authorization");
                self.carry_out(intent);
            } else {
                let intent = if self.rng.percent(50) {
                    let amount = self.capture_amount(i);
                    self.capture_intent(i, amount, "capture")
                } else {
                    self.cancel_intent(i, "cancel")
                };
                if !self.abandon_after_one_attempt(intent) {
                    self.owned[i].fate = Fate::Unknown;
                }
            }
        } else {
            return false;
        }
        true
    }

    /// All (`None`) or part of hold `i`.
    fn capture_amount(&mut self, i: usize) -> Option<i64> {
        let authorized = self.owned[i].amount as u64;
        self.rng
            .percent(40)
            .then(|| self.rng.between(1, authorized) as i64)
    }

    fn capture_intent(&mut self, i: usize, amount: Option<i64>, tag: &'static str) -> Arc<Intent> {
        let o = &self.owned[i];
        let kind = Kind::Capture {
            charge: o.id.clone(),
            amount,
            authorized: o.amount,
            expires_at_ms: o.expires_at_ms.expect("a hold"),
            settled: o.fate != Fate::Open,
        };
        let path = format!("/v1/charges/{}/capture", o.id);
        let body = match amount {
            Some(a) => json!({ "amount": a }),
            None => json!({}),
        };
        self.intent(path, body.to_string(), kind, tag)
    }

    fn cancel_intent(&mut self, i: usize, tag: &'static str) -> Arc<Intent> {
        let o = &self.owned[i];
        let kind = Kind::Cancel {
            charge: o.id.clone(),
            authorized: o.amount,
            settled: matches!(o.fate, Fate::Captured(_) | Fate::Canceled),
        };
        let path = format!("/v1/charges/{}/cancel", o.id);
        self.intent(path, "{}".to_string(), kind, tag)
    }

    /// A capture against a cancel (or, one time in three, against another
    /// capture) of hold `i`, in either order, the second sent from another
    /// thread 0–5 ms after the first: at most one may win, and the other's
    /// final answer is 409.
    fn race(&mut self, i: usize) {
        let amount = self.capture_amount(i);
        let capture = self.capture_intent(i, amount, "racing capture");
        let other = if self.rng.percent(33) {
            let amount = self.capture_amount(i);
            self.capture_intent(i, amount, "racing capture")
        } else {
            self.cancel_intent(i, "racing cancel")
        };
        let (first, second) = if self.rng.percent(50) {
            (capture, other)
        } else {
            (other, capture)
        };
        let stagger = Duration::from_millis(self.rng.between(0, 5));
        let shared = Arc::clone(&self.shared);
        let (a, b) = std::thread::scope(|s| {
            let other = s.spawn(|| {
                std::thread::sleep(stagger);
                until_final(&shared, &second)
            });
            let a = until_final(&shared, &first);
            (a, other.join().expect("racing client thread"))
        });
        let (Some(a), Some(b)) = (a, b) else {
            return;
        };
        let stats = &self.shared.stats;
        stats.races.fetch_add(1, Ordering::Relaxed);
        let winners: Vec<&Arc<Intent>> = [(&first, &a), (&second, &b)]
            .into_iter()
            .filter(|(_, answer)| answer.status == 200)
            .map(|(intent, _)| intent)
            .collect();
        let counter = match winners.as_slice() {
            [] => &stats.races_won_by_nobody,
            [w] if matches!(w.kind, Kind::Cancel { .. }) => &stats.races_won_by_cancel,
            [_] => &stats.races_won_by_capture,
            _ => {
                self.shared.fail(format!(
                    "a race on hold {} was won twice: {} key {} and {} key {} both answered 200",
                    self.owned[i].id, first.path, first.key, second.path, second.key
                ));
                &stats.races_won_by_nobody
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.record(first, a);
        self.record(second, b);
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
    /// reaper must finish it. True if that one attempt got a final answer.
    fn abandon_after_one_attempt(&mut self, intent: Arc<Intent>) -> bool {
        let mut node = None;
        loop {
            match attempt(&self.shared, &intent, &mut node) {
                Attempt::Final(answer) => {
                    self.record(intent, answer);
                    return true;
                }
                Attempt::Retry => {
                    self.shared.abandoned.lock().unwrap().push(intent);
                    return false;
                }
                Attempt::Down if self.shared.abort.load(Ordering::SeqCst) => return false,
                Attempt::Down => {}
            }
        }
    }

    fn record(&mut self, intent: Arc<Intent>, answer: Answer) {
        match judge(&intent, &answer) {
            Err(what) => self.shared.fail(what),
            Ok(()) => self.learn(&intent, &answer),
        }
        let record = Record {
            intent,
            first: answer,
        };
        self.shared.answered.lock().unwrap().push(record.clone());
        self.mine.push(record);
    }

    /// What a judged answer tells the client about its charges.
    fn learn(&mut self, intent: &Arc<Intent>, answer: &Answer) {
        let body = answer.json().unwrap_or(Value::Null);
        let position = |owned: &[Owned], id: &str| owned.iter().position(|o| o.id == id);
        match (&intent.kind, answer.status) {
            (
                Kind::Charge {
                    amount, capture, ..
                },
                201,
            ) => {
                let left_alone = !capture && self.rng.percent(30);
                self.owned.push(Owned {
                    id: answer.id().expect("a judged charge has an id"),
                    intent: Arc::clone(intent),
                    amount: *amount,
                    expires_at_ms: time_of(&body, "expires_at"),
                    left_alone,
                    fate: if *capture {
                        Fate::Captured(*amount)
                    } else {
                        Fate::Open
                    },
                    refunded: 0,
                    authorization: body["authorization"].as_str().unwrap_or_default().into(),
                    disputed: 0,
                });
            }
            (Kind::Capture { charge, .. }, 200) => {
                if let Some(i) = position(&self.owned, charge) {
                    let captured = body["amount_captured"].as_i64().unwrap_or(0);
                    self.owned[i].fate = Fate::Captured(captured);
                }
            }
            (Kind::Cancel { charge, .. }, 200) => {
                if let Some(i) = position(&self.owned, charge) {
                    self.owned[i].fate = Fate::Canceled;
                }
            }
            (Kind::Capture { charge, .. } | Kind::Cancel { charge, .. }, 409) => {
                if let Some(i) = position(&self.owned, charge) {
                    if self.owned[i].fate == Fate::Open {
                        self.owned[i].fate = Fate::Lapsed;
                    }
                }
            }
            (Kind::Refund { charge, .. }, 201) => {
                if let Some(i) = position(&self.owned, charge) {
                    self.owned[i].refunded += body["amount"].as_i64().unwrap_or(0);
                }
            }
            (Kind::Chargeback { charge, amount, .. }, 200) => {
                if let Some(i) = position(&self.owned, charge) {
                    self.owned[i].disputed += amount;
                }
            }
            _ => {}
        }
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

fn server_args() -> Vec<String> {
    [
        "--inflight-timeout",
        INFLIGHT_TIMEOUT,
        "--reaper-interval",
        REAPER_INTERVAL,
        "--synchronous",
        "full",
        "--acquirer-latency",
        ACQUIRER_LATENCY,
        "--authorization-ttl",
        &format!("{AUTHORIZATION_TTL_MS}ms"),
        "--webhook-retry-base",
        WEBHOOK_RETRY_BASE,
        "--webhook-timeout",
        WEBHOOK_TIMEOUT,
        "--webhook-attempts-max",
        WEBHOOK_ATTEMPTS_MAX,
    ]
    .map(str::to_string)
    .to_vec()
}

fn start_server(ctx: &Ctx, db: &Path) -> ChildServer {
    let args = server_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = std::panic::catch_unwind(|| ChildServer::start(db, &args, &[]));
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

/// A POST at setup that must answer 201; its body.
fn create(ctx: &Ctx, addr: SocketAddr, key: &str, path: &str, body: Value) -> Value {
    let auth = format!("Bearer {key}");
    let r = support::send(
        addr,
        "POST",
        path,
        &[("Authorization", &auth)],
        body.to_string().as_bytes(),
    )
    .unwrap_or_else(|e| ctx.fail(&[format!("POST {path}: {e}")]));
    if r.status != 201 {
        ctx.fail(&[format!(
            "POST {path} {body}: {} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        )]);
    }
    r.json()
}

/// Before any other write, so that every event is subscribed: one webhook
/// endpoint per consumer (`enabled_events: ["*"]`) at the receiver's
/// `/hooks/{consumer}`, whose secret the receiver checks every delivery
/// against; then one notification source per consumer.
fn create_endpoints_and_sources(
    ctx: &Ctx,
    addr: SocketAddr,
    keys: &[String],
    receiver: &Receiver,
) -> Vec<Source> {
    keys.iter()
        .enumerate()
        .map(|(i, key)| {
            let path = format!("/hooks/{i}");
            let url = format!("http://{}{path}", receiver.addr);
            let endpoint = create(
                ctx,
                addr,
                key,
                "/v1/webhook_endpoints",
                json!({"url": url, "enabled_events": ["*"]}),
            );
            let secret = endpoint["secret"].as_str().unwrap_or_default();
            let verifier = standardwebhooks::Webhook::new(secret).unwrap_or_else(|e| {
                ctx.fail(&[format!("endpoint secret {secret:?}: {e}: {endpoint}")])
            });
            receiver.listen(path, verifier);
            let source = create(
                ctx,
                addr,
                key,
                "/v1/notification_sources",
                json!({"name": format!("torture-{i}")}),
            );
            match (source["id"].as_str(), source["secret"].as_str()) {
                (Some(id), Some(secret)) if secret.starts_with("whsec_") => Source {
                    id: id.to_string(),
                    secret: secret.to_string(),
                },
                _ => ctx.fail(&[format!("notification source: {source}")]),
            }
        })
        .collect()
}

/// The receiver's view of one `webhook-id` (an event id).
#[derive(Debug, Clone)]
struct Arrival {
    /// Where it was posted (one endpoint per consumer: `/hooks/{consumer}`).
    path: String,
    /// The body of its first attempt; every later attempt must carry the
    /// same bytes.
    body: Vec<u8>,
    attempts: u64,
    /// Answered 200 at least once.
    accepted: bool,
}

#[derive(Default)]
struct ReceiverStats {
    attempts: AtomicU64,
    refused_500: AtomicU64,
    cut: AtomicU64,
    /// Attempts of an id the receiver had answered 200 already (the server
    /// was killed before it recorded the success).
    redelivered: AtomicU64,
}

/// A webhook receiver in the test process: HTTP/1.1 with keep-alive on a
/// std `TcpListener`, a thread per connection. It checks every attempt's
/// signature with the Standard Webhooks reference crate and its endpoint's
/// secret, keys arrivals by `webhook-id` (which must be the body's event
/// id), fails the run if an id comes back with other bytes or at another
/// endpoint, and refuses a seeded `RECEIVER_FAULT_PERCENT` of attempts
/// (with a 500, or by closing the connection unanswered) so that
/// deliveries are retried, also across kills.
struct Receiver {
    addr: SocketAddr,
    /// Endpoint path → its verifier.
    endpoints: RwLock<HashMap<String, Arc<standardwebhooks::Webhook>>>,
    arrivals: Mutex<HashMap<String, Arrival>>,
    rng: Mutex<Rng>,
    problems: Mutex<Vec<String>>,
    stats: ReceiverStats,
    stop: AtomicBool,
}

/// One request as the receiver read it.
struct Incoming {
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    close: bool,
}

impl Incoming {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// What the receiver does with an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Answer(u16),
    /// Close the connection without an answer.
    Cut,
}

impl Receiver {
    fn start(seed: u64) -> Arc<Receiver> {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the webhook receiver");
        let receiver = Arc::new(Receiver {
            addr: listener.local_addr().expect("receiver address"),
            endpoints: RwLock::new(HashMap::new()),
            arrivals: Mutex::new(HashMap::new()),
            rng: Mutex::new(Rng::new(seed ^ 0x5EED_0F4E_C31B_E5A7)),
            problems: Mutex::new(Vec::new()),
            stats: ReceiverStats::default(),
            stop: AtomicBool::new(false),
        });
        let r = Arc::clone(&receiver);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if r.stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Ok(stream) = stream {
                    let r = Arc::clone(&r);
                    std::thread::spawn(move || r.serve(stream));
                }
            }
        });
        receiver
    }

    fn listen(&self, path: String, verifier: standardwebhooks::Webhook) {
        self.endpoints
            .write()
            .unwrap()
            .insert(path, Arc::new(verifier));
    }

    /// Stops accepting (the accept loop wakes on one last connection).
    fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }

    fn problem(&self, what: String) {
        self.problems
            .lock()
            .unwrap()
            .push(format!("webhook receiver: {what}"));
    }

    fn take_problems(&self) -> Vec<String> {
        std::mem::take(&mut *self.problems.lock().unwrap())
    }

    fn arrivals(&self) -> HashMap<String, Arrival> {
        self.arrivals.lock().unwrap().clone()
    }

    /// One connection: requests until the peer closes, asks to, or is cut.
    fn serve(&self, mut stream: TcpStream) {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
        let mut buffered = Vec::new();
        while !self.stop.load(Ordering::SeqCst) {
            let Some(request) = read_request(&mut stream, &mut buffered) else {
                return;
            };
            let status = match self.receive(&request) {
                Verdict::Cut => return,
                Verdict::Answer(status) => status,
            };
            let connection = if request.close { "close" } else { "keep-alive" };
            let reply = format!(
                "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: {connection}\r\n\r\n"
            );
            if stream.write_all(reply.as_bytes()).is_err() || request.close {
                return;
            }
        }
    }

    fn receive(&self, request: &Incoming) -> Verdict {
        self.stats.attempts.fetch_add(1, Ordering::Relaxed);
        let id = request.header("webhook-id").unwrap_or_default().to_string();
        let at = format!("delivery of {id:?} to {}", request.path);
        let verifier = self.endpoints.read().unwrap().get(&request.path).cloned();
        let Some(verifier) = verifier else {
            self.problem(format!("{at}, which is no endpoint's"));
            return Verdict::Answer(404);
        };
        let mut headers = hyper::HeaderMap::new();
        for (name, value) in &request.headers {
            if let (Ok(n), Ok(v)) = (
                hyper::header::HeaderName::from_bytes(name.as_bytes()),
                hyper::header::HeaderValue::from_str(value),
            ) {
                headers.append(n, v);
            }
        }
        if let Err(e) = verifier.verify(&request.body, &headers) {
            self.problem(format!("{at}: signature refused: {e}"));
            return Verdict::Answer(400);
        }
        let event: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        if event["id"] != json!(id) || request.header("content-type") != Some("application/json") {
            self.problem(format!(
                "{at}: content-type {:?}, body {}",
                request.header("content-type"),
                String::from_utf8_lossy(&request.body)
            ));
        }
        let roll = self.rng.lock().unwrap().below(100);
        let verdict = if roll < RECEIVER_FAULT_PERCENT / 2 {
            self.stats.refused_500.fetch_add(1, Ordering::Relaxed);
            Verdict::Answer(500)
        } else if roll < RECEIVER_FAULT_PERCENT {
            self.stats.cut.fetch_add(1, Ordering::Relaxed);
            Verdict::Cut
        } else {
            Verdict::Answer(200)
        };
        let accepted = verdict == Verdict::Answer(200);
        match self.arrivals.lock().unwrap().entry(id.clone()) {
            Entry::Vacant(new) => {
                new.insert(Arrival {
                    path: request.path.clone(),
                    body: request.body.clone(),
                    attempts: 1,
                    accepted,
                });
            }
            Entry::Occupied(mut seen) => {
                let seen = seen.get_mut();
                if seen.body != request.body || seen.path != request.path {
                    self.problem(format!(
                        "{at} differs from its first attempt, to {}: {} then {}",
                        seen.path,
                        String::from_utf8_lossy(&seen.body),
                        String::from_utf8_lossy(&request.body)
                    ));
                }
                if seen.accepted {
                    self.stats.redelivered.fetch_add(1, Ordering::Relaxed);
                }
                seen.attempts += 1;
                seen.accepted |= accepted;
            }
        }
        verdict
    }
}

/// Stops the receiver when its database's run ends, however it ends.
struct StopReceiver(Arc<Receiver>);

impl Drop for StopReceiver {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Reads once more into `buffered`; `None` at the end of the stream.
fn read_more(stream: &mut TcpStream, buffered: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 16 * 1024];
    match stream.read(&mut chunk) {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buffered.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

/// The end of the next line (`\r\n`) in `buffered`, reading as needed.
fn line_end(stream: &mut TcpStream, buffered: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(i) = buffered.windows(2).position(|w| w == b"\r\n") {
            return Some(i);
        }
        read_more(stream, buffered)?;
    }
}

/// The next request on a connection (`Content-Length` or chunked body);
/// what follows it stays in `buffered`. `None` if the peer closed, timed
/// out or sent something else.
fn read_request(stream: &mut TcpStream, buffered: &mut Vec<u8>) -> Option<Incoming> {
    let head_end = loop {
        if let Some(i) = buffered.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        read_more(stream, buffered)?;
    };
    let head = String::from_utf8_lossy(&buffered[..head_end]).into_owned();
    buffered.drain(..head_end + 4);
    let mut lines = head.split("\r\n");
    let path = lines.next()?.split(' ').nth(1)?.to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut request = Incoming {
        path,
        headers,
        body: Vec::new(),
        close: false,
    };
    request.close = request
        .header("connection")
        .is_some_and(|v| v.eq_ignore_ascii_case("close"));
    if request
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        loop {
            let end = line_end(stream, buffered)?;
            let size_line = String::from_utf8_lossy(&buffered[..end]).into_owned();
            let size = usize::from_str_radix(size_line.split(';').next()?.trim(), 16).ok()?;
            buffered.drain(..end + 2);
            if size == 0 {
                // Trailers, up to an empty line.
                loop {
                    let end = line_end(stream, buffered)?;
                    buffered.drain(..end + 2);
                    if end == 0 {
                        return Some(request);
                    }
                }
            }
            while buffered.len() < size + 2 {
                read_more(stream, buffered)?;
            }
            request.body.extend_from_slice(&buffered[..size]);
            buffered.drain(..size + 2);
        }
    }
    let len: usize = match request.header("content-length") {
        Some(v) => v.parse().ok()?,
        None => 0,
    };
    while buffered.len() < len {
        read_more(stream, buffered)?;
    }
    request.body = buffered.drain(..len).collect();
    Some(request)
}

/// SIGKILL node `node`, and wait until the process is gone (with one node,
/// the database is then quiescent). Returns the server's stderr lines that
/// report a panic.
fn kill(shared: &Shared, node: usize, mut server: ChildServer) -> Vec<String> {
    shared.nodes.write().unwrap()[node] = None;
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
    /// op_id → charge public id; authorization → charge public id
    charges_by_op: HashMap<String, String>,
    charges_by_authorization: HashMap<String, String>,
    refunds: HashMap<String, RefundRow>,
    refunds_by_key: HashMap<(i64, String), Vec<String>>,
    /// op_id → refund public id
    refunds_by_op: HashMap<String, String>,
    /// (consumer id, key) → key row
    keys: HashMap<(i64, String), KeyRow>,
    /// op_id → (consumer id, key)
    keys_by_op: HashMap<String, (i64, String)>,
    /// (consumer id, account public id) → balance
    balances: HashMap<(i64, String), i64>,
    /// (source public id, webhook-id) → notification
    notifications: HashMap<(String, String), NotificationRow>,
    /// public id → dispute
    disputes: HashMap<String, DisputeRow>,
}

impl Snapshot {
    fn key_of_op(&self, op_id: &str) -> Option<&KeyRow> {
        self.keys_by_op.get(op_id).and_then(|at| self.keys.get(at))
    }

    fn in_progress(&self, op_id: &str) -> bool {
        self.key_of_op(op_id)
            .is_some_and(|k| k.state == "in_progress")
    }
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
    status: String,
    amount_captured: i64,
    amount_disputed: i64,
    cancellation_reason: Option<String>,
    claimed_by: Option<String>,
}

impl ChargeRow {
    fn state(&self) -> String {
        match (&self.cancellation_reason, &self.claimed_by) {
            (Some(reason), _) => format!("{} ({reason})", self.status),
            (None, Some(claimer)) => format!("{} (claimed by {claimer})", self.status),
            (None, None) => format!("{} ({} captured)", self.status, self.amount_captured),
        }
    }
}

struct RefundRow {
    consumer_id: i64,
    charge: String,
    amount: i64,
    key: String,
}

struct NotificationRow {
    consumer_id: i64,
    status: String,
    response_status: u16,
    response_body: Vec<u8>,
    /// The public ids of the disputes it produced.
    disputes: Vec<String>,
}

struct DisputeRow {
    charge: String,
    amount: i64,
    notification: String,
    /// Its entries: (account public id, amount), by entry id.
    entries: Vec<(String, i64)>,
}

struct KeyRow {
    op_id: String,
    path: String,
    state: String,
    status: Option<u16>,
    body: Option<Vec<u8>>,
}

/// Runs `f` on the ledger database `db` through idem's storage interface,
/// read-only (one snapshot on PostgreSQL): every check reads it so, on
/// either backend. An error is returned as text, for a problem line.
fn read_db<T>(db: &Path, f: impl FnOnce(&dyn Db) -> idem::Result<T>) -> Result<T, String> {
    idem::store::inspect(db, f).map_err(|e| e.to_string())
}

/// An HTTP status as the database stores it (an integer column); one out
/// of range reads as 65535, which no answer has.
fn http_status(stored: i64) -> u16 {
    u16::try_from(stored).unwrap_or(u16::MAX)
}

/// The database ids of the consumers `torture-0`, `torture-1`, …
fn consumer_ids(c: &dyn Db) -> idem::Result<Vec<i64>> {
    (0..CONSUMERS)
        .map(|i| {
            c.query_value(
                "SELECT id FROM consumers WHERE name = ?1",
                args![format!("torture-{i}")],
            )
        })
        .collect()
}

fn read_snapshot(c: &dyn Db) -> idem::Result<Snapshot> {
    let mut s = Snapshot {
        consumer_ids: consumer_ids(c)?,
        charges: HashMap::new(),
        charges_by_key: HashMap::new(),
        charges_by_reference: HashMap::new(),
        charges_by_op: HashMap::new(),
        charges_by_authorization: HashMap::new(),
        refunds: HashMap::new(),
        refunds_by_key: HashMap::new(),
        refunds_by_op: HashMap::new(),
        keys: HashMap::new(),
        keys_by_op: HashMap::new(),
        balances: HashMap::new(),
        notifications: HashMap::new(),
        disputes: HashMap::new(),
    };
    c.query_each(
        "SELECT c.public_id, c.consumer_id, c.amount, c.currency, s.public_id, d.public_id, \
         c.reference, c.idempotency_key, c.op_id, c.authorization_id, c.status, \
         c.amount_captured, c.cancellation_reason, c.claimed_by, c.amount_disputed FROM charges c \
         JOIN accounts s ON s.id = c.source_id JOIN accounts d ON d.id = c.destination_id",
        args![],
        &mut |r| {
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
                status: r.get(10)?,
                amount_captured: r.get(11)?,
                cancellation_reason: r.get(12)?,
                claimed_by: r.get(13)?,
                amount_disputed: r.get(14)?,
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
            s.charges_by_op.insert(row.op_id.clone(), id.clone());
            s.charges_by_authorization
                .insert(row.authorization_id.clone(), id.clone());
            s.charges.insert(id, row);
            Ok(())
        },
    )?;
    c.query_each(
        "SELECT r.public_id, r.consumer_id, c.public_id, r.amount, r.idempotency_key, r.op_id \
         FROM refunds r JOIN charges c ON c.id = r.charge_id",
        args![],
        &mut |r| {
            let id: String = r.get(0)?;
            let row = RefundRow {
                consumer_id: r.get(1)?,
                charge: r.get(2)?,
                amount: r.get(3)?,
                key: r.get(4)?,
            };
            let by_key = (row.consumer_id, row.key.clone());
            s.refunds_by_key.entry(by_key).or_default().push(id.clone());
            s.refunds_by_op.insert(r.get(5)?, id.clone());
            s.refunds.insert(id, row);
            Ok(())
        },
    )?;
    c.query_each(
        "SELECT consumer_id, key, op_id, path, state, response_status, response_body \
         FROM idempotency_keys",
        args![],
        &mut |r| {
            let at: (i64, String) = (r.get(0)?, r.get(1)?);
            let row = KeyRow {
                op_id: r.get(2)?,
                path: r.get(3)?,
                state: r.get(4)?,
                status: r.get::<Option<i64>>(5)?.map(http_status),
                body: r.get(6)?,
            };
            s.keys_by_op.insert(row.op_id.clone(), at.clone());
            s.keys.insert(at, row);
            Ok(())
        },
    )?;
    c.query_each(
        "SELECT consumer_id, public_id, balance FROM accounts",
        args![],
        &mut |r| {
            s.balances.insert((r.get(0)?, r.get(1)?), r.get(2)?);
            Ok(())
        },
    )?;
    let mut of_notification: HashMap<(String, String), Vec<String>> = HashMap::new();
    c.query_each(
        "SELECT d.public_id, c.public_id, d.amount, n.public_id, s.public_id, n.webhook_id \
         FROM disputes d JOIN charges c ON c.id = d.charge_id \
         LEFT JOIN notifications n ON n.id = d.notification_id \
         LEFT JOIN notification_sources s ON s.id = n.source_id ORDER BY d.id",
        args![],
        &mut |r| {
            let id: String = r.get(0)?;
            let at: (Option<String>, Option<String>) = (r.get(4)?, r.get(5)?);
            if let (Some(source), Some(webhook_id)) = at {
                of_notification
                    .entry((source, webhook_id))
                    .or_default()
                    .push(id.clone());
            }
            let row = DisputeRow {
                charge: r.get(1)?,
                amount: r.get(2)?,
                notification: r.get::<Option<String>>(3)?.unwrap_or_default(),
                entries: Vec::new(),
            };
            s.disputes.insert(id, row);
            Ok(())
        },
    )?;
    c.query_each(
        "SELECT d.public_id, a.public_id, e.amount FROM entries e \
         JOIN disputes d ON d.id = e.dispute_id JOIN accounts a ON a.id = e.account_id \
         ORDER BY e.id",
        args![],
        &mut |r| {
            let id: String = r.get(0)?;
            if let Some(d) = s.disputes.get_mut(&id) {
                d.entries.push((r.get(1)?, r.get(2)?));
            }
            Ok(())
        },
    )?;
    c.query_each(
        "SELECT s.public_id, n.webhook_id, n.consumer_id, n.status, n.response_status, \
         n.response_body FROM notifications n JOIN notification_sources s ON s.id = n.source_id",
        args![],
        &mut |r| {
            let at: (String, String) = (r.get(0)?, r.get(1)?);
            let row = NotificationRow {
                consumer_id: r.get(2)?,
                status: r.get(3)?,
                response_status: http_status(r.get(4)?),
                response_body: r.get(5)?,
                disputes: of_notification.remove(&at).unwrap_or_default(),
            };
            s.notifications.insert(at, row);
            Ok(())
        },
    )?;
    Ok(s)
}

/// Queries whose every row (one text column) is a violation, valid on both
/// engines: `CAST(sum(...) AS BIGINT)` (PostgreSQL's `sum()` of a BIGINT is
/// a NUMERIC), `string_agg` (SQLite has it since 3.44), `IS DISTINCT FROM`,
/// `"authorization"` quoted (a reserved word on PostgreSQL), a subquery in
/// FROM named; a query that binds `?1` is given the test's clock (ms).
const SQL_CHECKS: &[(&str, &str)] = &[
    (
        "conservation: balances sum to zero per consumer and currency",
        "SELECT 'consumer ' || consumer_id || ' ' || currency || ' sums to ' \
         || CAST(sum(balance) AS BIGINT) \
         FROM accounts GROUP BY consumer_id, currency HAVING sum(balance) <> 0",
    ),
    (
        "conservation: each balance equals the sum of its entries",
        "SELECT 'account ' || a.public_id || ' balance ' || a.balance || ' entries ' \
         || CAST(coalesce(sum(e.amount), 0) AS BIGINT) \
         FROM accounts a LEFT JOIN entries e ON e.account_id = a.id \
         GROUP BY a.id, a.public_id, a.balance HAVING a.balance <> coalesce(sum(e.amount), 0)",
    ),
    // Only a chargeback may take a merchant below zero (forced by the
    // network); every other debit checks what is available. So a merchant's
    // balance plus what chargebacks took from it is never below zero, nor
    // (holds) below what it holds.
    (
        "conservation: no account without allow_negative is below zero by more than the \
         chargebacks forced on it",
        "SELECT 'account ' || public_id || ' is at ' || balance || ' (chargebacks took ' \
         || forced || ')' FROM (SELECT a.public_id, a.balance, a.allow_negative, \
           coalesce((SELECT -CAST(sum(e.amount) AS BIGINT) FROM entries e \
             WHERE e.account_id = a.id AND e.dispute_id IS NOT NULL AND e.amount < 0), 0) \
             AS forced FROM accounts a) t \
         WHERE allow_negative = 0 AND balance + forced < 0",
    ),
    (
        "holds: held and pending_credit are what the open holds on an account add up to",
        "SELECT 'account ' || public_id || ' held ' || held || ' pending_credit ' \
         || pending_credit || ' but its open holds add up to ' || want_held || ' and ' \
         || want_pending FROM (SELECT a.public_id, a.held, a.pending_credit, \
           coalesce((SELECT CAST(sum(c.amount) AS BIGINT) FROM charges c \
             WHERE c.source_id = a.id AND c.status = 'requires_capture'), 0) AS want_held, \
           coalesce((SELECT CAST(sum(c.amount) AS BIGINT) FROM charges c \
             WHERE c.destination_id = a.id AND c.status = 'requires_capture'), 0) \
             AS want_pending FROM accounts a) t \
         WHERE held <> want_held OR pending_credit <> want_pending",
    ),
    (
        "holds: no merchant has less available than 0, but for what chargebacks took",
        "SELECT 'account ' || public_id || ' has ' || (balance - held) || ' available (balance ' \
         || balance || ', held ' || held || ', chargebacks took ' || forced || ')' FROM \
         (SELECT a.public_id, a.balance, a.held, a.allow_negative, \
           coalesce((SELECT -CAST(sum(e.amount) AS BIGINT) FROM entries e \
             WHERE e.account_id = a.id AND e.dispute_id IS NOT NULL AND e.amount < 0), 0) \
             AS forced FROM accounts a) t \
         WHERE allow_negative = 0 AND balance - held + forced < 0",
    ),
    (
        "holds: a held or canceled charge has no entries, a captured one a debit and a credit \
         of amount_captured (besides its refunds' and disputes')",
        "SELECT 'charge ' || c.public_id || ' (' || c.status || ', captured ' \
         || c.amount_captured || ') has entries ' \
         || coalesce((SELECT string_agg(CAST(e.amount AS TEXT), ' ') \
         FROM entries e WHERE e.charge_id = c.id AND e.refund_id IS NULL \
           AND e.dispute_id IS NULL), 'none') \
         FROM charges c WHERE CASE WHEN c.status = 'succeeded' THEN \
           (SELECT count(*) FROM entries e WHERE e.charge_id = c.id AND e.refund_id IS NULL \
             AND e.dispute_id IS NULL) <> 2 \
           OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.charge_id = c.id \
             AND e.refund_id IS NULL AND e.dispute_id IS NULL AND e.account_id = c.source_id \
             AND e.amount = -c.amount_captured) \
           OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.charge_id = c.id \
             AND e.refund_id IS NULL AND e.dispute_id IS NULL \
             AND e.account_id = c.destination_id AND e.amount = c.amount_captured) \
         ELSE EXISTS (SELECT 1 FROM entries e WHERE e.charge_id = c.id) END",
    ),
    (
        "disputes: a dispute moved its amount once, from its charge's destination to its \
         source",
        "SELECT 'dispute ' || d.public_id || ' of ' || d.amount || ' on charge ' || c.public_id \
         || ' has entries ' || coalesce((SELECT string_agg(CAST(e.amount AS TEXT), ' ') \
           FROM entries e WHERE e.dispute_id = d.id), 'none') \
         FROM disputes d JOIN charges c ON c.id = d.charge_id \
         WHERE (SELECT count(*) FROM entries e WHERE e.dispute_id = d.id) <> 2 \
         OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.dispute_id = d.id AND e.charge_id = c.id \
           AND e.account_id = c.destination_id AND e.amount = -d.amount) \
         OR NOT EXISTS (SELECT 1 FROM entries e WHERE e.dispute_id = d.id AND e.charge_id = c.id \
           AND e.account_id = c.source_id AND e.amount = d.amount) \
         OR c.status <> 'succeeded' OR d.consumer_id <> c.consumer_id",
    ),
    (
        "disputes: amount_disputed is what the disputes add up to, and refunds and disputes \
         together stay within the captured money",
        "SELECT 'charge ' || c.public_id || ' captured ' || c.amount_captured || ', refunded ' \
         || c.amount_refunded || ', amount_disputed ' || c.amount_disputed || ', disputes ' \
         || coalesce((SELECT CAST(sum(d.amount) AS BIGINT) FROM disputes d \
           WHERE d.charge_id = c.id), 0) \
         FROM charges c WHERE c.amount_disputed \
           <> coalesce((SELECT sum(d.amount) FROM disputes d WHERE d.charge_id = c.id), 0) \
         OR c.amount_refunded + c.amount_disputed > c.amount_captured",
    ),
    (
        "disputes: a notification is applied if and only if it has one dispute, of the charge \
         its authorization names",
        "SELECT 'notification ' || n.public_id || ' (' || n.webhook_id || ') is ' || n.status \
         || ' with ' || (SELECT count(*) FROM disputes d WHERE d.notification_id = n.id) \
         || ' dispute(s)' FROM notifications n WHERE (n.status = 'applied') \
           <> ((SELECT count(*) FROM disputes d WHERE d.notification_id = n.id) = 1) \
         OR EXISTS (SELECT 1 FROM disputes d JOIN charges c ON c.id = d.charge_id \
           WHERE d.notification_id = n.id \
             AND (c.authorization_id IS DISTINCT FROM n.\"authorization\" \
               OR c.consumer_id <> n.consumer_id))",
    ),
    (
        "refunds: only captured money is refunded, and amount_refunded is what the refunds \
         add up to",
        "SELECT 'charge ' || c.public_id || ' (' || c.status || ', captured ' \
         || c.amount_captured || ') amount_refunded ' || c.amount_refunded || ', refunds ' \
         || coalesce((SELECT CAST(sum(r.amount) AS BIGINT) FROM refunds r \
           WHERE r.charge_id = c.id), 0) \
         FROM charges c WHERE c.amount_refunded \
           <> coalesce((SELECT sum(r.amount) FROM refunds r WHERE r.charge_id = c.id), 0) \
         OR c.amount_refunded > c.amount_captured \
         OR (c.status <> 'succeeded' AND EXISTS (SELECT 1 FROM refunds r WHERE r.charge_id = c.id))",
    ),
    (
        // A claim nobody will release keeps a hold forever: no capture or
        // cancel may take it, and the expiry skips it. `?1`: now (ms).
        "holds: a hold is claimed only by a capture or cancel of it in progress, or by the \
         expiry once it expired",
        "SELECT 'charge ' || c.public_id || ' (' || c.status || ', expires_at ' \
         || coalesce(CAST(c.expires_at AS TEXT), 'none') || ') is claimed by ' || c.claimed_by \
         || ', which is not a capture or cancel of it in progress' FROM charges c \
         WHERE c.claimed_by IS NOT NULL AND NOT ( \
           (c.claimed_by = 'expiry' AND c.expires_at <= ?1) \
           OR EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.op_id = c.claimed_by \
             AND k.state = 'in_progress' AND k.consumer_id = c.consumer_id \
             AND k.path IN ('/v1/charges/' || c.public_id || '/capture', \
                            '/v1/charges/' || c.public_id || '/cancel')))",
    ),
    (
        // The claim is made in the transaction that reserves the key, and
        // released in the one that completes it.
        "holds: a capture or cancel in progress holds the claim on its charge",
        "SELECT 'key ' || k.key || ' (' || k.op_id || ') ' || k.path || ' in progress at ' \
         || k.recovery_point || ', but ' || coalesce('its charge is ' || c.status \
           || ' claimed by ' || coalesce(c.claimed_by, 'nobody'), 'its charge is missing') \
         FROM idempotency_keys k LEFT JOIN charges c ON c.consumer_id = k.consumer_id \
           AND k.path IN ('/v1/charges/' || c.public_id || '/capture', \
                          '/v1/charges/' || c.public_id || '/cancel') \
         WHERE k.state = 'in_progress' \
           AND (k.path LIKE '/v1/charges/%/capture' OR k.path LIKE '/v1/charges/%/cancel') \
           AND (c.id IS NULL OR c.status <> 'requires_capture' \
             OR c.claimed_by IS DISTINCT FROM k.op_id)",
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
        // Each kind of operation at its own recovery points: a charge
        // authorized (or declined after), a capture captured, a cancel
        // voided, a refund applied. (That its request is JSON the reaper
        // can read is checked in `sql_problems`.)
        IN_PROGRESS_FINISHABLE,
        "SELECT 'key ' || key || ' (' || op_id || ') ' || path || ' in progress at ' \
         || recovery_point || ' with request ' || request || ' authorization ' \
         || coalesce(\"authorization\", 'none') FROM idempotency_keys \
         WHERE state = 'in_progress' \
         AND ((recovery_point IN ('authorized', 'declined')) <> (\"authorization\" IS NOT NULL) \
         OR (recovery_point IN ('declined', 'applied')) <> (response_status IS NOT NULL) \
         OR method <> 'POST' \
         OR NOT CASE \
           WHEN path = '/v1/charges' THEN recovery_point IN ('reserved', 'authorized', 'declined') \
           WHEN path LIKE '/v1/charges/%/refunds' THEN recovery_point IN ('reserved', 'applied') \
           WHEN path LIKE '/v1/charges/%/capture' THEN recovery_point IN ('reserved', 'captured') \
           WHEN path LIKE '/v1/charges/%/cancel' THEN recovery_point IN ('reserved', 'voided') \
           ELSE false END)",
    ),
    (
        "structure: a completed key has its answer",
        "SELECT 'key ' || key || ' completed without an answer' FROM idempotency_keys \
         WHERE state = 'completed' AND (response_status IS NULL OR response_body IS NULL)",
    ),
];

const IN_PROGRESS_FINISHABLE: &str = "structure: an in-progress key is one the reaper can finish";

/// Every row of every check in [`SQL_CHECKS`], and whether each in-progress
/// key's request is JSON; on an SQLite file, its `integrity_check` and
/// `foreign_key_check` first.
fn sql_problems(c: &dyn Db) -> idem::Result<Vec<String>> {
    let mut problems = Vec::new();
    if c.dialect() == Dialect::Sqlite {
        let integrity: Vec<String> =
            c.query_all("PRAGMA integrity_check", args![], |r| r.get(0))?;
        if integrity != ["ok"] {
            problems.push(format!("structure: integrity_check: {integrity:?}"));
        }
        let fk: Vec<String> = c.query_all("PRAGMA foreign_key_check", args![], |r| {
            Ok(format!(
                "{} row {:?} -> {}",
                r.get::<String>(0)?,
                r.get::<Option<i64>>(1)?,
                r.get::<String>(2)?
            ))
        })?;
        if !fk.is_empty() {
            problems.push(format!("structure: foreign_key_check: {fk:?}"));
        }
    }
    // Now is read once the snapshot is taken (PostgreSQL takes it at the
    // first statement): a claim it shows was made by then.
    c.query_value::<i64>("SELECT 1", args![])?;
    let now = now_ms();
    for (name, sql) in SQL_CHECKS {
        let binds: Vec<&dyn Arg> = if sql.contains("?1") {
            vec![&now]
        } else {
            Vec::new()
        };
        let lines: Vec<String> = c.query_all(sql, &binds, |r| r.get(0))?;
        problems.extend(lines.into_iter().map(|l| format!("{name}: {l}")));
    }
    c.query_each(
        "SELECT key, op_id, request FROM idempotency_keys WHERE state = 'in_progress'",
        args![],
        &mut |r| {
            let request: Vec<u8> = r.get(2)?;
            if serde_json::from_slice::<Value>(&request).is_err() {
                problems.push(format!(
                    "{IN_PROGRESS_FINISHABLE}: key {} ({}) has a request that is not JSON: {}",
                    r.get::<String>(0)?,
                    r.get::<String>(1)?,
                    String::from_utf8_lossy(&request)
                ));
            }
            Ok(())
        },
    )?;
    Ok(problems)
}

/// Nothing acknowledged is lost, and the stored answer is the one the client
/// saw: every answered intent has a completed key row with its exact status
/// and bytes, and the effect its answer names (or none, for a refusal).
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
        if let Kind::Chargeback { source, .. } = &intent.kind {
            // The notification row is its idempotency record.
            let at = (source.clone(), intent.key.clone());
            match s.notifications.get(&at) {
                None => problems.push(format!(
                    "lost: {what} answered {} has no notification row",
                    record.first.text()
                )),
                Some(n)
                    if n.response_status != record.first.status
                        || n.response_body != record.first.body
                        || n.consumer_id != consumer_id =>
                {
                    problems.push(format!(
                        "{what}: client saw {} but the notification row stores {} {}",
                        record.first.text(),
                        n.response_status,
                        String::from_utf8_lossy(&n.response_body)
                    ))
                }
                Some(_) => {}
            }
            if let Err(p) = effect_problem(s, consumer_id, record) {
                problems.push(format!("{what}: {p}"));
            }
            continue;
        }
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
    let id = answer.id().unwrap_or_default();
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
                capture,
                ..
            },
            201,
        ) => {
            let c = s
                .charges
                .get(&id)
                .ok_or(format!("lost: acknowledged charge {id} does not exist"))?;
            // A sale stays captured; what became of a hold is for its
            // captures and cancels (and, at the end, `hold_problems`).
            let same = c.consumer_id == consumer_id
                && c.amount == *amount
                && c.source == *source
                && c.destination == *destination
                && c.reference.as_deref() == Some(reference.as_str())
                && c.key == intent.key
                && (!capture || (c.status == "succeeded" && c.amount_captured == *amount));
            if !same || charges_of_key != 1 {
                return Err(format!(
                    "charge {id} in the database: consumer {} {} {} {}->{} ref {:?} key {} {} \
                     ({charges_of_key} charges for this key)",
                    c.consumer_id,
                    c.amount,
                    c.currency,
                    c.source,
                    c.destination,
                    c.reference,
                    c.key,
                    c.state()
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
        (Kind::Capture { charge, .. } | Kind::Cancel { charge, .. }, status) => {
            let c = s
                .charges
                .get(charge)
                .ok_or(format!("lost: hold {charge} does not exist"))?;
            if charges_of_key != 0 || refunds_of_key != 0 {
                return Err(format!(
                    "{charges_of_key} charges and {refunds_of_key} refunds carry its key"
                ));
            }
            let body = answer.json().unwrap_or(Value::Null);
            let holds = match (&intent.kind, status) {
                (Kind::Capture { .. }, 200) => {
                    c.status == "succeeded"
                        && Some(c.amount_captured) == body["amount_captured"].as_i64()
                }
                (Kind::Cancel { .. }, 200) => {
                    c.status == "canceled" && c.cancellation_reason.as_deref() == Some("requested")
                }
                // The acquirer was not called: see `journal_problems`.
                _ => true,
            };
            if !holds {
                return Err(format!(
                    "answered {status} but charge {charge} is {} in the database",
                    c.state()
                ));
            }
        }
        (
            Kind::Chargeback {
                charge,
                source,
                amount,
                ..
            },
            status,
        ) => {
            let n = s
                .notifications
                .get(&(source.clone(), intent.key.clone()))
                .ok_or("lost: no notification row")?;
            let c = s
                .charges
                .get(charge)
                .ok_or(format!("lost: charge {charge} of the chargeback"))?;
            let disputes: Vec<(&String, Option<&DisputeRow>)> = n
                .disputes
                .iter()
                .map(|id| (id, s.disputes.get(id)))
                .collect();
            // Applied: one dispute of its amount on its charge, and the
            // money moved once, from the destination back to the source.
            let once = vec![
                (c.destination.clone(), -amount),
                (c.source.clone(), *amount),
            ];
            let ok = match (status, &disputes[..]) {
                (200, [(_, Some(d))]) => {
                    n.status == "applied"
                        && d.charge == *charge
                        && d.amount == *amount
                        && d.entries == once
                }
                (200, _) => false,
                _ => n.status != "applied" && disputes.is_empty(),
            };
            if !ok {
                let shown: Vec<String> = disputes
                    .iter()
                    .map(|(id, d)| match d {
                        Some(d) => format!(
                            "{id} of {} on {} with entries {:?}",
                            d.amount, d.charge, d.entries
                        ),
                        None => format!("{id} (unreadable)"),
                    })
                    .collect();
                return Err(format!(
                    "answered {status} for {amount} of {charge}, but its notification is {} \
                     with disputes {shown:?} (the money moved once would be {once:?})",
                    n.status
                ));
            }
        }
    }
    Ok(())
}

fn call_kind(kind: CallKind) -> &'static str {
    match kind {
        CallKind::Authorize => "authorize",
        CallKind::Capture => "capture",
        CallKind::Void => "void",
        CallKind::Refund => "refund",
    }
}

/// The acquirer simulator's journal of calls against the ledger: at most
/// one authorization, capture, void or refund made per key, at most one
/// capture and one void per authorization; every call of a key answered with
/// the authorization its key concerns; every charge carries the
/// authorization its operation got, for its amount and currency; everything
/// the acquirer did is in the ledger (or its operation is still in
/// progress); and a capture or cancel answered 409 or 422 never called it.
fn journal_problems(calls: &[Call], s: &Snapshot, records: &[Record]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut made: HashMap<(&str, &str), &Call> = HashMap::new();
    let mut captures: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut voids: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for call in calls.iter().filter(|c| c.created) {
        let kind = call_kind(call.kind);
        match made.entry((kind, call.key.as_str())) {
            Entry::Vacant(first) => {
                first.insert(call);
            }
            Entry::Occupied(_) if call.kind == CallKind::Authorize => {
                problems.push(format!("acquirer authorized operation {} twice", call.key))
            }
            Entry::Occupied(_) => problems.push(format!(
                "acquirer made a second {kind} under key {}",
                call.key
            )),
        }
        let per_authorization = match call.kind {
            CallKind::Capture => &mut captures,
            CallKind::Void => &mut voids,
            _ => continue,
        };
        per_authorization
            .entry(&call.authorization)
            .or_default()
            .push(&call.key);
    }
    for (verb, per_authorization) in [("captured", &captures), ("voided", &voids)] {
        for (authorization, keys) in per_authorization {
            if keys.len() > 1 {
                problems.push(format!(
                    "acquirer {verb} authorization {authorization} {} times, under keys {keys:?}",
                    keys.len()
                ));
            }
        }
    }
    for call in calls {
        let kind = call_kind(call.kind);
        let first = made.get(&(kind, call.key.as_str()));
        if first.map(|m| m.authorization.as_str()) != Some(call.authorization.as_str()) {
            problems.push(format!(
                "acquirer answered {kind} {} with {}, not the authorization its key made or \
                 concerns",
                call.key, call.authorization
            ));
        }
    }
    for (id, c) in &s.charges {
        let expected = (c.authorization_id.as_str(), c.amount, c.currency.as_str());
        let got = made
            .get(&("authorize", c.op_id.as_str()))
            .map(|m| (m.authorization.as_str(), m.amount, m.currency.as_str()));
        if got != Some(expected) {
            problems.push(format!(
                "charge {id} ({}) carries authorization {expected:?}, the journal has {got:?}",
                c.op_id
            ));
        }
    }
    for call in made.values() {
        if let Err(p) = call_in_ledger(call, s, &made) {
            problems.push(p);
        }
    }
    let called: HashSet<&str> = calls.iter().map(|c| c.key.as_str()).collect();
    for r in records {
        let refused = r.first.status != 200 && r.intent.kind.settles().is_some();
        let at = (s.consumer_ids[r.intent.consumer], r.intent.key.clone());
        if let Some(k) = s
            .keys
            .get(&at)
            .filter(|k| refused && called.contains(&*k.op_id))
        {
            problems.push(format!(
                "{} key {} answered {} yet the acquirer was called under its operation {}",
                r.intent.path, r.intent.key, r.first.status, k.op_id
            ));
        }
    }
    problems
}

/// What the acquirer did under one key, as the ledger must show it.
fn call_in_ledger(
    call: &Call,
    s: &Snapshot,
    made: &HashMap<(&str, &str), &Call>,
) -> Result<(), String> {
    let key = call.key.as_str();
    let charge = s
        .charges_by_authorization
        .get(&call.authorization)
        .and_then(|id| s.charges.get(id).map(|c| (id.as_str(), c)));
    let shown = || {
        charge.map_or("no charge".to_string(), |(id, c)| {
            format!("{id} {}", c.state())
        })
    };
    let path_of = |op: &str| s.key_of_op(op).map(|k| k.path.as_str());
    let ok = match call.kind {
        // Its charge exists, or its operation is still going, or the
        // ledger declined it and it was voided.
        CallKind::Authorize => {
            s.charges_by_op.contains_key(key)
                || s.in_progress(key)
                || made.contains_key(&("void", format!("{key}:void").as_str()))
        }
        CallKind::Capture => {
            s.in_progress(key)
                || charge.is_some_and(|(id, c)| {
                    c.status == "succeeded"
                        && c.amount_captured == call.amount
                        && path_of(key) == Some(format!("/v1/charges/{id}/capture").as_str())
                })
        }
        CallKind::Void => {
            if let Some(expired) = key.strip_prefix("expire:") {
                charge.is_some_and(|(id, c)| {
                    id == expired
                        && (c.cancellation_reason.as_deref() == Some("expired")
                            || (c.status == "requires_capture"
                                && c.claimed_by.as_deref() == Some("expiry")))
                })
            } else if let Some(op) = key.strip_suffix(":void") {
                // A charge declined after its authorization: no charge.
                !s.charges_by_op.contains_key(op) && s.key_of_op(op).is_some()
            } else {
                s.in_progress(key)
                    || charge.is_some_and(|(id, c)| {
                        c.cancellation_reason.as_deref() == Some("requested")
                            && path_of(key) == Some(format!("/v1/charges/{id}/cancel").as_str())
                    })
            }
        }
        CallKind::Refund => s
            .refunds_by_op
            .get(key)
            .and_then(|id| s.refunds.get(id))
            .is_some_and(|r| {
                r.amount == call.amount
                    && s.charges.get(&r.charge).map(|c| &c.authorization_id)
                        == Some(&call.authorization)
            }),
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "the acquirer's {} of {} for {} under key {key} is not in the ledger, which has {}",
            call_kind(call.kind),
            call.amount,
            call.authorization,
            shown()
        ))
    }
}

/// Every check on a quiescent file (the child is dead): SQL, the answers
/// clients saw, the acquirer journal, then `idem verify`.
fn check_quiescent(ctx: &Ctx, db: &Path, records: &[Record]) -> (Snapshot, Vec<Call>) {
    let (problems, snapshot, calls) = quiescent_problems(ctx, db, records);
    ctx.check(problems);
    (snapshot, calls)
}

/// The acquirer simulator's file of the servers on `db`: beside an SQLite
/// file, or the `--acquirer-store` the servers on a PostgreSQL database
/// share.
fn acquirer_file(db: &Path) -> std::path::PathBuf {
    support::acquirer_store(db).unwrap_or_else(|| Simulator::store_path(db))
}

/// The checks of the database alone, on one read of it: the SQL checks,
/// and every answer clients saw (`records`, taken before it) against it.
/// On PostgreSQL the read is one snapshot, so they hold while other nodes
/// keep writing: every answer was committed before it was given.
fn snapshot_problems(ctx: &Ctx, db: &Path, records: &[Record]) -> (Vec<String>, Snapshot) {
    let (mut problems, snapshot) = read_db(db, |c| Ok((sql_problems(c)?, read_snapshot(c)?)))
        .unwrap_or_else(|e| ctx.fail(&[format!("read db: {e}")]));
    problems.extend(record_problems(&snapshot, records));
    (problems, snapshot)
}

/// What [`check_quiescent`] finds, and what it read.
fn quiescent_problems(
    ctx: &Ctx,
    db: &Path,
    records: &[Record],
) -> (Vec<String>, Snapshot, Vec<Call>) {
    let (mut problems, snapshot) = snapshot_problems(ctx, db, records);
    let calls = Simulator::journal_of_file(&acquirer_file(db)).unwrap_or_else(|e| {
        problems.push(format!("acquirer journal: {e}"));
        Vec::new()
    });
    problems.extend(journal_problems(&calls, &snapshot, records));
    let (code, report) = support::verify_cli(db);
    if code != 0 {
        problems.push(format!("idem verify exited {code}:\n{report}"));
    }
    (problems, snapshot, calls)
}

/// At the end, with every intent answered and every hold settled: the
/// database holds exactly the effects the answers name — no charge or
/// refund nobody was told of — and every balance is what those answers add
/// up to (a sale moves its amount, a hold what its capture answered).
fn model_problems(s: &Snapshot, records: &[Record]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut charges: HashSet<&str> = HashSet::new();
    let mut refunds: HashSet<&str> = HashSet::new();
    let mut expected: HashMap<(i64, String), i64> = HashMap::new();
    let mut charge_accounts: HashMap<String, (i64, &str, &str)> = HashMap::new();
    let mut moved: Vec<(&str, i64)> = Vec::new();
    for r in records {
        let consumer_id = s.consumer_ids[r.intent.consumer];
        let id = r.first.id().unwrap_or_default();
        match (&r.intent.kind, r.first.status) {
            (
                Kind::Charge {
                    source,
                    destination,
                    amount,
                    capture,
                    ..
                },
                201,
            ) => {
                charges.insert(s.charges.get_key_value(&id).map_or("", |(k, _)| k.as_str()));
                charge_accounts.insert(id, (consumer_id, source, destination));
                if *capture {
                    moved.push((&r.intent.key, *amount));
                }
            }
            (Kind::Capture { .. }, 200) => {
                let captured = r.first.json().unwrap()["amount_captured"]
                    .as_i64()
                    .unwrap_or(0);
                moved.push((&r.intent.key, captured));
            }
            _ => {}
        }
    }
    let key_charge: HashMap<&str, String> = records
        .iter()
        .filter_map(|r| match (&r.intent.kind, r.first.status) {
            (Kind::Charge { .. }, 201) => Some((r.intent.key.as_str(), r.first.id()?)),
            (Kind::Capture { charge, .. }, 200) => Some((r.intent.key.as_str(), charge.clone())),
            _ => None,
        })
        .collect();
    for (key, amount) in moved {
        let accounts = key_charge.get(key).and_then(|c| charge_accounts.get(c));
        let Some(&(consumer_id, source, destination)) = accounts else {
            problems.push(format!(
                "key {key} moved {amount} of a charge no answer created"
            ));
            continue;
        };
        *expected
            .entry((consumer_id, source.to_string()))
            .or_default() -= amount;
        *expected
            .entry((consumer_id, destination.to_string()))
            .or_default() += amount;
    }
    for r in records {
        if let (Kind::Refund { charge, .. }, 201, Some(id)) =
            (&r.intent.kind, r.first.status, r.first.id())
        {
            let amount = r.first.json().unwrap()["amount"].as_i64().unwrap_or(0);
            let Some(&(consumer_id, source, destination)) = charge_accounts.get(charge) else {
                problems.push(format!("refund {id} of {charge}, which no answer created"));
                continue;
            };
            *expected
                .entry((consumer_id, source.to_string()))
                .or_default() += amount;
            *expected
                .entry((consumer_id, destination.to_string()))
                .or_default() -= amount;
            refunds.insert(s.refunds.get_key_value(&id).map_or("", |(k, _)| k.as_str()));
        }
    }
    // Chargebacks answered 200 moved their amount back, from the
    // destination to the source, once; one answered 422 moved nothing.
    let mut disputed: HashMap<&str, i64> = HashMap::new();
    let mut disputes: HashSet<&str> = HashSet::new();
    let mut notifications: HashSet<(&str, &str)> = HashSet::new();
    for r in records {
        let Kind::Chargeback {
            charge,
            source: from,
            amount,
            ..
        } = &r.intent.kind
        else {
            continue;
        };
        notifications.insert((from.as_str(), r.intent.key.as_str()));
        if r.first.status != 200 {
            continue;
        }
        let Some(&(consumer_id, source, destination)) = charge_accounts.get(charge) else {
            problems.push(format!(
                "chargeback {} of {charge}, which no answer created",
                r.intent.key
            ));
            continue;
        };
        *expected
            .entry((consumer_id, destination.to_string()))
            .or_default() -= amount;
        *expected
            .entry((consumer_id, source.to_string()))
            .or_default() += amount;
        *disputed.entry(charge.as_str()).or_default() += amount;
        if let Some(n) = s.notifications.get(&(from.clone(), r.intent.key.clone())) {
            disputes.extend(n.disputes.iter().map(String::as_str));
        }
    }
    for (id, c) in &s.charges {
        let want = disputed.get(id.as_str()).copied().unwrap_or(0);
        if c.amount_disputed != want {
            problems.push(format!(
                "charge {id} amount_disputed {}, the chargebacks answered 200 add up to {want}",
                c.amount_disputed
            ));
        }
    }
    for (id, d) in &s.disputes {
        if !disputes.contains(id.as_str()) {
            problems.push(format!(
                "dispute {id} ({} of {}, notification {}) answered to nobody",
                d.amount, d.charge, d.notification
            ));
        }
    }
    for (source, webhook_id) in s.notifications.keys() {
        if !notifications.contains(&(source.as_str(), webhook_id.as_str())) {
            problems.push(format!(
                "notification {webhook_id} of {source} stored, but nobody sent it"
            ));
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

/// At the end, every hold is settled as its answers say: captured by its one
/// capture answered 200 (for as much), canceled by its one cancel answered
/// 200, or — when nothing won — expired (`cancellation_reason: expired`).
/// And a capture or cancel answered 409 before its hold expired lost to
/// another capture or cancel of it, answered 200: before the expiry nothing
/// else can claim or settle a hold, and whoever claims it ends with 200.
fn hold_problems(s: &Snapshot, records: &[Record]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut holds: BTreeMap<String, (i64, Vec<&Record>)> = BTreeMap::new();
    for r in records {
        if let (Kind::Charge { capture: false, .. }, 201) = (&r.intent.kind, r.first.status) {
            let body = r.first.json().unwrap_or(Value::Null);
            let expires_at = time_of(&body, "expires_at").unwrap_or(i64::MIN);
            holds.insert(r.first.id().unwrap_or_default(), (expires_at, Vec::new()));
        }
    }
    for r in records {
        if let Some(charge) = r.intent.kind.settles() {
            match holds.get_mut(charge) {
                Some((_, tries)) => tries.push(r),
                None => problems.push(format!(
                    "{} key {} aims at {charge}, which no client was told is a hold",
                    r.intent.path, r.intent.key
                )),
            }
        }
    }
    for (id, (expires_at, tries)) in &holds {
        let Some(c) = s.charges.get(id) else {
            continue; // lost: `record_problems` says so
        };
        let winners: Vec<&&Record> = tries.iter().filter(|r| r.first.status == 200).collect();
        let told: Vec<String> = tries
            .iter()
            .map(|r| format!("{} {}", r.intent.tag, r.first.status))
            .collect();
        let settled = match (
            c.status.as_str(),
            c.cancellation_reason.as_deref(),
            &winners[..],
        ) {
            ("succeeded", _, [w]) => {
                matches!(w.intent.kind, Kind::Capture { .. })
                    && w.first.json().unwrap()["amount_captured"].as_i64()
                        == Some(c.amount_captured)
            }
            ("canceled", Some("requested"), [w]) => matches!(w.intent.kind, Kind::Cancel { .. }),
            ("canceled", Some("expired"), []) => true,
            _ => false,
        };
        if c.status == "requires_capture" {
            problems.push(format!(
                "hold {id} is still held after the drain ({}, expired at {})",
                c.state(),
                idem::time::rfc3339(*expires_at)
            ));
        } else if !settled {
            problems.push(format!(
                "hold {id} ended {} but its captures and cancels were answered {told:?}",
                c.state()
            ));
        }
        for r in tries {
            let lost_to_another = winners.iter().any(|w| w.intent.key != r.intent.key);
            if r.first.status == 409 && r.first.received_ms < *expires_at && !lost_to_another {
                problems.push(format!(
                    "{} key {} was answered 409 at {}, before hold {id} expired at {}, and no \
                     other capture or cancel of it won: {}",
                    r.intent.path,
                    r.intent.key,
                    idem::time::rfc3339(r.first.received_ms),
                    idem::time::rfc3339(*expires_at),
                    r.first.text()
                ));
            }
        }
    }
    problems
}

/// An event as stored: public id, type, body, and its deliveries (endpoint
/// url, status).
type StoredEvent = (String, String, Vec<u8>, Vec<(String, String)>);

/// At the end, with every delivery settled: every event (one per state
/// change, which `idem verify` checks) has one delivery, to its consumer's
/// endpoint, `succeeded`, and arrived there, byte-identical to
/// `events.body`; and the receiver accepted no event the database does not
/// have. So the ids received are exactly the events: none lost, none
/// invented.
fn delivery_problems(db: &Path, arrivals: &HashMap<String, Arrival>) -> Vec<String> {
    let mut problems = Vec::new();
    let read = |c: &dyn Db| -> idem::Result<Vec<StoredEvent>> {
        let mut deliveries: HashMap<i64, Vec<(String, String)>> = HashMap::new();
        c.query_each(
            "SELECT d.event_id, w.url, d.status FROM deliveries d \
             JOIN webhook_endpoints w ON w.id = d.endpoint_id ORDER BY d.id",
            args![],
            &mut |r| {
                let of = deliveries.entry(r.get(0)?).or_default();
                of.push((r.get(1)?, r.get(2)?));
                Ok(())
            },
        )?;
        c.query_all(
            "SELECT id, public_id, type, body FROM events ORDER BY id",
            args![],
            |r| {
                let of = deliveries.remove(&r.get::<i64>(0)?).unwrap_or_default();
                Ok((r.get(1)?, r.get(2)?, r.get(3)?, of))
            },
        )
    };
    let events = match read_db(db, read) {
        Ok(events) => events,
        Err(e) => return vec![format!("deliveries: read db: {e}")],
    };
    let mut ids: HashSet<&str> = HashSet::new();
    for (id, kind, body, deliveries) in &events {
        ids.insert(id);
        let arrival = arrivals.get(id).filter(|a| a.accepted);
        match arrival {
            None => problems.push(format!(
                "lost: event {id} ({kind}) never arrived at the receiver (deliveries: \
                 {deliveries:?})"
            )),
            Some(a) if a.body != *body => problems.push(format!(
                "event {id} ({kind}) in the database differs from the bytes the receiver got: \
                 {} / {}",
                String::from_utf8_lossy(body),
                String::from_utf8_lossy(&a.body)
            )),
            Some(_) => {}
        }
        if deliveries.len() != 1 {
            problems.push(format!(
                "event {id} ({kind}) has deliveries {deliveries:?}, not one to its consumer's \
                 endpoint"
            ));
        }
        for (url, status) in deliveries {
            let got_there = arrival.is_some_and(|a| url.ends_with(&a.path));
            if status != "succeeded" || !got_there {
                problems.push(format!(
                    "the delivery of event {id} ({kind}) to {url} is {status}, but the receiver \
                     never got it there (it got it at {:?})",
                    arrival.map(|a| &a.path)
                ));
            }
        }
    }
    let mut invented: Vec<&String> = arrivals
        .iter()
        .filter(|(id, a)| a.accepted && !ids.contains(id.as_str()))
        .map(|(id, _)| id)
        .collect();
    invented.sort();
    for id in invented {
        problems.push(format!(
            "event {id} arrived at the receiver but is not in the database"
        ));
    }
    let received = arrivals.values().filter(|a| a.accepted).count();
    if received != events.len() {
        problems.push(format!(
            "the receiver accepted {received} distinct event ids, the database has {} events",
            events.len()
        ));
    }
    problems
}

fn pending_deliveries(db: &Path) -> Result<Vec<String>, String> {
    read_db(db, |c| {
        c.query_all(
            "SELECT e.public_id || ' (' || e.type || ') attempts ' || d.attempts || ' last ' \
             || coalesce(CAST(d.last_status AS TEXT), d.last_error, 'none') || ' next at ' \
             || coalesce(CAST(d.next_attempt_at AS TEXT), 'never') \
             FROM deliveries d JOIN events e ON e.id = d.event_id WHERE d.status = 'pending'",
            args![],
            |r| r.get(0),
        )
    })
}

fn in_progress_keys(db: &Path) -> Result<Vec<String>, String> {
    read_db(db, |c| {
        c.query_all(
            "SELECT key || ' at ' || recovery_point || ' locked_at ' || locked_at \
             FROM idempotency_keys WHERE state = 'in_progress'",
            args![],
            |r| r.get(0),
        )
    })
}

fn open_holds(db: &Path) -> Result<Vec<String>, String> {
    read_db(db, |c| {
        c.query_all(
            "SELECT public_id || ' expires_at ' || coalesce(CAST(expires_at AS TEXT), 'none') \
             || ' claimed by ' || coalesce(claimed_by, 'nobody') \
             FROM charges WHERE status = 'requires_capture'",
            args![],
            |r| r.get(0),
        )
    })
}

/// Waits (bounded) until `left` finds nothing: the reaper has resolved every
/// in-progress key, or voided and released every hold.
fn drain(
    ctx: &Ctx,
    db: &Path,
    what: &str,
    within: Duration,
    find: fn(&Path) -> Result<Vec<String>, String>,
) {
    let deadline = Instant::now() + within;
    loop {
        let left = find(db).unwrap_or_else(|e| vec![format!("read db: {e}")]);
        if left.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            let mut problems = vec![format!(
                "{} {what} still there {within:?} after the clients stopped",
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
    // Which of them reached the database, read before any is re-sent.
    let reserved = read_db(db, |c| {
        let consumer_ids = consumer_ids(c)?;
        abandoned
            .iter()
            .map(|intent| {
                c.exists(
                    "SELECT 1 FROM idempotency_keys WHERE consumer_id = ?1 AND key = ?2",
                    args![consumer_ids[intent.consumer], intent.key],
                )
            })
            .collect::<idem::Result<Vec<bool>>>()
    })
    .unwrap_or_else(|e| ctx.fail(&[format!("read db: {e}")]));
    let mut problems = Vec::new();
    let mut finished = 0;
    for (intent, reserved) in abandoned.into_iter().zip(reserved) {
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

/// When to kill, counted from "listening": a fifth of the kills land during
/// startup (takeovers of the last crash's orphans by retries), a fifth
/// around the reaper's first pass (orphans, then the holds that expired
/// while the child was down: expiries cut short), the rest under steady
/// load.
fn kill_delay(rng: &mut Rng) -> Duration {
    let ms = match rng.below(100) {
        0..=19 => rng.between(0, 40),
        20..=39 => rng.between(190, 320),
        _ => rng.between(50, 600),
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
    /// Nodes on each database (the same for every database of a run).
    nodes: u64,
    /// Processes killed, and (with several nodes) kills of all of them.
    kills: u64,
    cluster_kills: u64,
    /// Found in the file after the kills: keys in progress, of them captures
    /// and cancels, and holds claimed by an expiry (of them, voided at the
    /// acquirer already).
    orphans_at_kills: u64,
    settling_at_kills: u64,
    expiries_cut: u64,
    expiries_cut_after_void: u64,
    answered: u64,
    /// Answers by what the intent was (its tag) and status.
    by_tag: BTreeMap<&'static str, BTreeMap<u16, u64>>,
    races: u64,
    races_won_by_capture: u64,
    races_won_by_cancel: u64,
    races_won_by_nobody: u64,
    abandoned: u64,
    abandoned_finished: u64,
    requests: u64,
    retries: u64,
    retries_elsewhere: u64,
    connection_errors: u64,
    in_use_409: u64,
    unavailable_503: u64,
    accepted_202: u64,
    replays_mid_run: u64,
    replays_at_end: u64,
    charges_in_db: u64,
    holds_captured: u64,
    holds_canceled: u64,
    holds_expired: u64,
    refunds_in_db: u64,
    /// Calls that made something at the acquirer, by kind (voids by why).
    acquirer_made: BTreeMap<&'static str, u64>,
    /// Notifications sent as concurrent copies of one id, and the copies.
    copied_notifications: u64,
    copies: u64,
    disputes_in_db: u64,
    /// Events in the databases, each delivered; the receiver's attempts,
    /// those it refused with a 500 or cut, and those of an id it had
    /// accepted already.
    events: u64,
    webhook_attempts: u64,
    webhook_refused_500: u64,
    webhook_cut: u64,
    webhook_redelivered: u64,
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        let pairs = [
            (&mut self.databases, o.databases),
            (&mut self.kills, o.kills),
            (&mut self.cluster_kills, o.cluster_kills),
            (&mut self.orphans_at_kills, o.orphans_at_kills),
            (&mut self.settling_at_kills, o.settling_at_kills),
            (&mut self.expiries_cut, o.expiries_cut),
            (&mut self.expiries_cut_after_void, o.expiries_cut_after_void),
            (&mut self.answered, o.answered),
            (&mut self.races, o.races),
            (&mut self.races_won_by_capture, o.races_won_by_capture),
            (&mut self.races_won_by_cancel, o.races_won_by_cancel),
            (&mut self.races_won_by_nobody, o.races_won_by_nobody),
            (&mut self.abandoned, o.abandoned),
            (&mut self.abandoned_finished, o.abandoned_finished),
            (&mut self.requests, o.requests),
            (&mut self.retries, o.retries),
            (&mut self.retries_elsewhere, o.retries_elsewhere),
            (&mut self.connection_errors, o.connection_errors),
            (&mut self.in_use_409, o.in_use_409),
            (&mut self.unavailable_503, o.unavailable_503),
            (&mut self.accepted_202, o.accepted_202),
            (&mut self.replays_mid_run, o.replays_mid_run),
            (&mut self.replays_at_end, o.replays_at_end),
            (&mut self.charges_in_db, o.charges_in_db),
            (&mut self.holds_captured, o.holds_captured),
            (&mut self.holds_canceled, o.holds_canceled),
            (&mut self.holds_expired, o.holds_expired),
            (&mut self.refunds_in_db, o.refunds_in_db),
            (&mut self.copied_notifications, o.copied_notifications),
            (&mut self.copies, o.copies),
            (&mut self.disputes_in_db, o.disputes_in_db),
            (&mut self.events, o.events),
            (&mut self.webhook_attempts, o.webhook_attempts),
            (&mut self.webhook_refused_500, o.webhook_refused_500),
            (&mut self.webhook_cut, o.webhook_cut),
            (&mut self.webhook_redelivered, o.webhook_redelivered),
        ];
        for (mine, theirs) in pairs {
            *mine += theirs;
        }
        self.nodes = self.nodes.max(o.nodes);
        for (tag, statuses) in &o.by_tag {
            let mine = self.by_tag.entry(*tag).or_default();
            for (status, n) in statuses {
                *mine.entry(*status).or_default() += n;
            }
        }
        for (kind, n) in &o.acquirer_made {
            *self.acquirer_made.entry(*kind).or_default() += n;
        }
    }
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let killed = if self.nodes > 1 {
            format!(
                "{} nodes: {} processes killed ({} times all {} at once)",
                self.nodes, self.kills, self.cluster_kills, self.nodes
            )
        } else {
            format!("{} kills", self.kills)
        };
        writeln!(
            f,
            "{killed} on {} database(s); found in the database after the kills that left it \
             quiescent: {} keys in progress ({} of them captures or cancels), {} expiries cut \
             short ({} after the acquirer's void)",
            self.databases,
            self.orphans_at_kills,
            self.settling_at_kills,
            self.expiries_cut,
            self.expiries_cut_after_void,
        )?;
        writeln!(f, "  {} intents answered:", self.answered)?;
        for (tag, statuses) in &self.by_tag {
            let shown: Vec<String> = statuses.iter().map(|(s, n)| format!("{n}×{s}")).collect();
            writeln!(f, "    {tag}: {}", shown.join(", "))?;
        }
        writeln!(
            f,
            "  {} races (won by the capture {}, by the cancel {}, by nobody {}); {} abandoned \
             after one attempt ({} reserved and finished without their client, the rest never \
             reserved)",
            self.races,
            self.races_won_by_capture,
            self.races_won_by_cancel,
            self.races_won_by_nobody,
            self.abandoned,
            self.abandoned_finished,
        )?;
        writeln!(
            f,
            "  {} requests, {} of them retries ({} to another node; after {} connection errors, \
             {} 409 in use, {} 503, {} async 202); {} replays compared byte for byte ({} during \
             the run, {} at the end)",
            self.requests,
            self.retries,
            self.retries_elsewhere,
            self.connection_errors,
            self.in_use_409,
            self.unavailable_503,
            self.accepted_202,
            self.replays_mid_run + self.replays_at_end,
            self.replays_mid_run,
            self.replays_at_end,
        )?;
        let made: Vec<String> = self
            .acquirer_made
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect();
        writeln!(
            f,
            "  in the databases: {} charges ({} holds captured, {} canceled, {} expired), {} \
             refunds and {} disputes; the acquirer made {}",
            self.charges_in_db,
            self.holds_captured,
            self.holds_canceled,
            self.holds_expired,
            self.refunds_in_db,
            self.disputes_in_db,
            made.join(", ")
        )?;
        write!(
            f,
            "  {} events, each delivered once to the receiver at least: {} attempts ({} \
             refused with 500, {} cut unanswered, {} of an id already accepted); {} \
             notifications sent as {} concurrent copies",
            self.events,
            self.webhook_attempts,
            self.webhook_refused_500,
            self.webhook_cut,
            self.webhook_redelivered,
            self.copied_notifications,
            self.copies,
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
    torture(ONE_NODE, 1, KILLS_DEFAULT);
}

/// The name of the one-node test, for replay lines.
const ONE_NODE: &str = "sigkill_at_random_moments_loses_nothing_and_moves_money_once";
const THREE_NODES: &str = "three_nodes_sigkilled_at_random_moves_money_once";

/// Three `idem serve` nodes on one PostgreSQL database (and one acquirer
/// store): every client's attempts are spread over the live nodes, a
/// re-send going to another node than the attempt before (so a retry
/// after a kill or a transport error lands elsewhere), while a random node
/// is SIGKILLed at random moments and restarted, and every
/// `CLUSTER_KILL_EVERY`th kill takes all three down at once. An owner killed
/// on one node is taken over by a retry on another after
/// `--inflight-timeout`, or finished by any node's reaper; holds expire and
/// webhooks are delivered by whichever node leases them. After a kill of
/// one node the others keep writing: the SQL checks and every answer are
/// checked on one snapshot of the database; after a kill of all three, and
/// at the end, every check of the one-node test (journal, `idem verify`,
/// model, holds, deliveries).
#[test]
fn three_nodes_sigkilled_at_random_moves_money_once() {
    if !support::on_postgres() {
        eprintln!(
            "skipped: three nodes share a PostgreSQL database; set IDEM_TEST_POSTGRES to run it"
        );
        return;
    }
    torture(THREE_NODES, 3, THREE_NODES_KILLS_DEFAULT);
}

/// The three-node CI profile: about three kills per node, two of them of
/// the whole cluster.
const THREE_NODES_KILLS_DEFAULT: u32 = 9;
/// With several nodes, every this many kills takes them all down at once:
/// a quiescent database, for the checks that need one.
const CLUSTER_KILL_EVERY: u32 = 4;

/// A run of `test` on `nodes` nodes: the profile's kills spread over fresh
/// databases of at most `KILLS_PER_DATABASE_MAX` kills each.
fn torture(test: &'static str, nodes: usize, default_kills: u32) {
    let profile = Profile::from_env(default_kills);
    println!(
        "torture: {nodes} node(s), seed {seed}, {kills} kills (replay: IDEM_TORTURE_SEED={seed} \
         IDEM_TORTURE_KILLS={kills} cargo test --test torture {test})",
        seed = profile.seed,
        kills = profile.kills
    );
    let began = Instant::now();
    let mut total = Figures::default();
    let mut left = profile.kills;
    for index in 0.. {
        let kills = left.min(KILLS_PER_DATABASE_MAX);
        let seed = database_seed(profile.seed, index);
        total.add(&run_database(test, seed, kills, nodes));
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

/// The end of a database, on the quiescent file: every check after a kill,
/// then the answers against the whole ledger, every hold settled, and every
/// event delivered (`arrivals`: what the webhook receiver accepted).
fn check_end(
    ctx: &Ctx,
    db: &Path,
    records: &[Record],
    arrivals: &HashMap<String, Arrival>,
) -> (Snapshot, Vec<Call>) {
    let (mut problems, snapshot, calls) = quiescent_problems(ctx, db, records);
    problems.extend(model_problems(&snapshot, records));
    problems.extend(hold_problems(&snapshot, records));
    problems.extend(delivery_problems(db, arrivals));
    ctx.check(problems);
    (snapshot, calls)
}

/// Starts node `node` and lets the clients use it.
fn start_node(
    ctx: &Ctx,
    db: &Path,
    shared: &Shared,
    servers: &mut [Option<ChildServer>],
    node: usize,
) {
    let server = start_server(ctx, db);
    shared.nodes.write().unwrap()[node] = Some(server.addr);
    servers[node] = Some(server);
}

/// One database: clients run while nodes are killed `kills` times (with
/// one node, each kill stops the database; with several, one node or, every
/// `CLUSTER_KILL_EVERY`th time, all), each kill followed by every check the
/// database's state allows; then the end checks.
fn run_database(test: &'static str, seed: u64, kills: u32, nodes: usize) -> Figures {
    let dir = TempDir::new("torture");
    let db = dir.db();
    let keys: Vec<String> = (0..CONSUMERS)
        .map(|i| support::create_consumer_cli(&db, &format!("torture-{i}")))
        .collect();
    let ctx = |at: String| Ctx {
        test,
        seed,
        kills,
        at,
    };
    let receiver = Receiver::start(seed);
    let _stop_receiver = StopReceiver(Arc::clone(&receiver));
    let mut servers: Vec<Option<ChildServer>> = (0..nodes)
        .map(|i| Some(start_server(&ctx(format!("first start of node {i}")), &db)))
        .collect();
    let setup = ctx("setup".into());
    let first = servers[0].as_ref().expect("node 0 is up").addr;
    let sources = create_endpoints_and_sources(&setup, first, &keys, &receiver);
    create_accounts(&setup, first, &keys);
    let shared = Arc::new(Shared {
        seed,
        keys,
        sources,
        nodes: RwLock::new(vec![None; nodes]),
        first_turn: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        abort: AtomicBool::new(false),
        kills: AtomicU64::new(0),
        answered: Mutex::new(Vec::new()),
        abandoned: Mutex::new(Vec::new()),
        failures: Mutex::new(Vec::new()),
        stats: Stats::default(),
    });
    let _abort = AbortOnDrop(Arc::clone(&shared));
    for (node, server) in servers.iter().enumerate() {
        shared.nodes.write().unwrap()[node] = server.as_ref().map(|s| s.addr);
    }
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
    // Holds found claimed by an expiry after a kill: the next passes must
    // finish each one.
    let mut cut_short: BTreeMap<String, String> = BTreeMap::new();
    let mut figures = Figures {
        databases: 1,
        nodes: nodes as u64,
        ..Figures::default()
    };
    for n in 1..=kills {
        std::thread::sleep(kill_delay(&mut rng));
        let whole = nodes == 1 || n % CLUSTER_KILL_EVERY == 0;
        let victims: Vec<usize> = if whole {
            (0..nodes).collect()
        } else {
            vec![rng.below(nodes as u64) as usize]
        };
        for &node in &victims {
            let server = servers[node]
                .take()
                .expect("every node is up between kills");
            panics.extend(kill(&shared, node, server));
        }
        figures.kills += victims.len() as u64;
        let at = ctx(match (nodes, whole) {
            (1, _) => format!("after kill {n}/{kills}"),
            (_, true) => format!("after kill {n}/{kills}, of all {nodes} nodes"),
            (_, false) => format!("after kill {n}/{kills}, of node {}", victims[0]),
        });
        let mut problems = take_failures(&shared);
        problems.extend(receiver.take_problems());
        problems.extend(panics.iter().map(|p| format!("server stderr: {p}")));
        at.check(problems);
        let records = shared.answered.lock().unwrap().clone();
        if whole {
            figures.cluster_kills += u64::from(nodes > 1);
            let (snapshot, calls) = check_quiescent(&at, &db, &records);
            for k in snapshot.keys.values().filter(|k| k.state == "in_progress") {
                figures.orphans_at_kills += 1;
                if k.path.ends_with("/capture") || k.path.ends_with("/cancel") {
                    figures.settling_at_kills += 1;
                }
            }
            let voided: HashSet<&str> = calls
                .iter()
                .filter(|c| c.kind == CallKind::Void)
                .map(|c| c.key.as_str())
                .collect();
            for (id, c) in &snapshot.charges {
                if c.claimed_by.as_deref() == Some("expiry") {
                    figures.expiries_cut += 1;
                    let void = voided.contains(format!("expire:{id}").as_str());
                    figures.expiries_cut_after_void += u64::from(void);
                    let when = if void {
                        "after its void"
                    } else {
                        "before its void"
                    };
                    cut_short.insert(id.clone(), format!("cut short by kill {n} {when}"));
                }
            }
        } else {
            // The other nodes write on: what holds in any one snapshot.
            let (problems, snapshot) = snapshot_problems(&at, &db, &records);
            at.check(problems);
            for (id, c) in &snapshot.charges {
                if c.claimed_by.as_deref() == Some("expiry") {
                    let when = format!("claimed by an expiry when node {} was killed", victims[0]);
                    cut_short.insert(id.clone(), format!("{when} (kill {n})"));
                }
            }
        }
        for node in victims {
            start_node(&at, &db, &shared, &mut servers, node);
        }
    }

    let end = ctx("at the end".into());
    shared.stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.join().expect("client thread");
    }
    end.check(take_failures(&shared));
    let keys_in_progress = "key(s) in progress";
    drain(
        &end,
        &db,
        keys_in_progress,
        DRAIN_DEADLINE,
        in_progress_keys,
    );
    figures.abandoned = shared.abandoned.lock().unwrap().len() as u64;
    figures.abandoned_finished = resolve_abandoned(&end, &shared, &db) as u64;
    let records = shared.answered.lock().unwrap().clone();
    let replays_mid_run = shared.stats.replays_compared.load(Ordering::Relaxed);
    replay_all(&end, &shared, &records);
    drain(
        &end,
        &db,
        keys_in_progress,
        DRAIN_DEADLINE,
        in_progress_keys,
    );
    let ttl = Duration::from_millis(AUTHORIZATION_TTL_MS as u64);
    drain(&end, &db, "hold(s)", ttl + DRAIN_DEADLINE, open_holds);
    // The expiries were the last state changes: their events are the last
    // to deliver.
    drain(
        &end,
        &db,
        "pending deliveries",
        DELIVERY_DRAIN_DEADLINE,
        pending_deliveries,
    );
    for (node, server) in servers.into_iter().enumerate() {
        panics.extend(kill(
            &shared,
            node,
            server.expect("every node is up at the end"),
        ));
    }
    let mut problems = take_failures(&shared);
    problems.extend(receiver.take_problems());
    problems.extend(panics.iter().map(|p| format!("server stderr: {p}")));
    end.check(problems);
    let arrivals = receiver.arrivals();
    let (snapshot, calls) = check_end(&end, &db, &records, &arrivals);
    let unfinished: Vec<String> = cut_short
        .iter()
        .filter_map(|(id, when)| {
            let c = snapshot.charges.get(id)?;
            let finished = c.cancellation_reason.as_deref() == Some("expired");
            (!finished).then(|| format!("the expiry of {id}, {when}, ended {}", c.state()))
        })
        .collect();
    end.check(unfinished);

    for r in &records {
        *figures
            .by_tag
            .entry(r.intent.tag)
            .or_default()
            .entry(r.first.status)
            .or_default() += 1;
    }
    for c in calls.iter().filter(|c| c.created) {
        let kind = match (c.kind, c.key.as_str()) {
            (CallKind::Void, key) if key.starts_with("expire:") => "void (expiry)",
            (CallKind::Void, key) if key.ends_with(":void") => "void (decline)",
            (CallKind::Void, _) => "void (cancel)",
            (kind, _) => call_kind(kind),
        };
        *figures.acquirer_made.entry(kind).or_default() += 1;
    }
    let holds = |status: &str, reason: Option<&str>| {
        snapshot
            .charges
            .values()
            .filter(|c| c.status == status && c.cancellation_reason.as_deref() == reason)
            .count() as u64
    };
    let captures: HashSet<&str> = records
        .iter()
        .filter(|r| r.first.status == 200 && matches!(r.intent.kind, Kind::Capture { .. }))
        .filter_map(|r| r.intent.kind.settles())
        .collect();
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let stats = &shared.stats;
    Figures {
        answered: records.len() as u64,
        races: get(&stats.races),
        races_won_by_capture: get(&stats.races_won_by_capture),
        races_won_by_cancel: get(&stats.races_won_by_cancel),
        races_won_by_nobody: get(&stats.races_won_by_nobody),
        requests: get(&stats.attempts),
        retries: get(&stats.retries),
        retries_elsewhere: get(&stats.retries_elsewhere),
        connection_errors: get(&stats.connection_errors),
        in_use_409: get(&stats.in_use_409),
        unavailable_503: get(&stats.unavailable_503),
        accepted_202: get(&stats.accepted_202),
        replays_mid_run,
        replays_at_end: get(&stats.replays_compared) - replays_mid_run,
        charges_in_db: snapshot.charges.len() as u64,
        holds_captured: captures.len() as u64,
        holds_canceled: holds("canceled", Some("requested")),
        holds_expired: holds("canceled", Some("expired")),
        refunds_in_db: snapshot.refunds.len() as u64,
        copied_notifications: get(&stats.copied_notifications),
        copies: get(&stats.copies),
        disputes_in_db: snapshot.disputes.len() as u64,
        events: arrivals.values().filter(|a| a.accepted).count() as u64,
        webhook_attempts: get(&receiver.stats.attempts),
        webhook_refused_500: get(&receiver.stats.refused_500),
        webhook_cut: get(&receiver.stats.cut),
        webhook_redelivered: get(&receiver.stats.redelivered),
        ..figures
    }
}

/// A way a bug could leave the file, and the words the checks must say.
struct Tampering {
    name: &'static str,
    /// Run on a copy of the ledger, with the copy of the acquirer
    /// simulator's file attached as `acquirer`.
    sql: &'static str,
    /// What runs on a copy of a PostgreSQL database instead.
    postgres: OnPostgres,
    expect: &'static str,
}

/// How a tampering is done on PostgreSQL, where the acquirer simulator's
/// file cannot be attached to the ledger and the engine keeps its own
/// structure (foreign keys always on).
enum OnPostgres {
    /// The same SQL.
    Same,
    /// Its own SQL.
    Sql(&'static str),
    /// Not done: it edits the simulator's file or SQLite's structure,
    /// which the SQLite run of this test covers (the checks that catch it
    /// read the simulator's file, SQLite on either backend, or are
    /// SQLite's own).
    Skipped,
}

/// The file holds, for consumer `torture-0` (see `checks_file`): a sale of
/// 700 from `fund_brl` to `shop_brl_a` (reference `checks-ref`); a hold of
/// 1000 from `fund_brl` to `shop_brl_b` captured for 600 and refunded 100
/// (`checks-ref-1`); a hold of 300 from `shop_brl_a` to `shop_brl_c`,
/// canceled, then refused a capture (`checks-ref-2`); a hold of 200 from
/// `fund_brl` to `shop_brl_c` left to expire, then refused a capture
/// (`checks-ref-3`); a sale of 500 from `fund_brl` to `shop_brl_c`
/// (`checks-ref-4`), disputed for 150 (`checks-ntf-1`, applied) and then
/// for 400 (`checks-ntf-2`, 422). Each consumer has one webhook endpoint,
/// and every event was delivered to the receiver.
const TAMPERINGS: &[Tampering] = &[
    Tampering {
        name: "an acknowledged charge is lost (balances fixed up to hide it)",
        sql: "DELETE FROM entries WHERE charge_id = \
              (SELECT id FROM charges WHERE reference = 'checks-ref'); \
              DELETE FROM charges WHERE reference = 'checks-ref'; \
              UPDATE accounts SET balance = \
              (SELECT coalesce(sum(e.amount), 0) FROM entries e WHERE e.account_id = accounts.id);",
        postgres: OnPostgres::Same,
        expect: "lost: acknowledged charge",
    },
    Tampering {
        name: "the stored answer differs from the one the client saw",
        sql:
            "UPDATE idempotency_keys SET response_body = CAST(replace(CAST(response_body AS TEXT), \
              '\"amount\":700', '\"amount\":701') AS BLOB);",
        postgres: OnPostgres::Sql(
            "UPDATE idempotency_keys SET response_body = convert_to(replace(\
              convert_from(response_body, 'UTF8'), '\"amount\":700', '\"amount\":701'), 'UTF8');",
        ),
        expect: "client saw 201",
    },
    Tampering {
        name: "one key moved money twice (consistently, so the sums still hold)",
        sql: "INSERT INTO charges (consumer_id, public_id, amount, currency, source_id, \
              destination_id, reference, metadata, fingerprint, op_id, idempotency_key, \
              authorization_id, created_at, status, amount_captured) SELECT consumer_id, \
              public_id || 'x', amount, currency, source_id, destination_id, NULL, metadata, \
              fingerprint, op_id || 'x', idempotency_key, authorization_id, created_at, status, \
              amount_captured FROM charges WHERE reference = 'checks-ref'; \
              INSERT INTO entries (public_id, account_id, amount, charge_id, created_at) \
              SELECT e.public_id || 'x', e.account_id, e.amount, (SELECT max(id) FROM charges), \
              e.created_at FROM entries e JOIN charges c ON c.id = e.charge_id \
              WHERE c.reference = 'checks-ref'; \
              UPDATE accounts SET balance = \
              (SELECT coalesce(sum(e.amount), 0) FROM entries e WHERE e.account_id = accounts.id);",
        postgres: OnPostgres::Same,
        expect: "at most once: one charge per (consumer, key)",
    },
    Tampering {
        name: "money created out of nothing",
        sql: "UPDATE accounts SET balance = balance + 1 WHERE public_id = 'shop_brl_a';",
        postgres: OnPostgres::Same,
        expect: "conservation: balances sum to zero",
    },
    Tampering {
        name: "a merchant below zero",
        sql: "UPDATE entries SET amount = -amount WHERE charge_id = \
              (SELECT id FROM charges WHERE reference = 'checks-ref'); \
              UPDATE accounts SET balance = \
              (SELECT coalesce(sum(e.amount), 0) FROM entries e WHERE e.account_id = accounts.id);",
        postgres: OnPostgres::Same,
        expect: "shop_brl_a is at -700",
    },
    Tampering {
        name: "an effect committed while its key is still in progress",
        sql: "UPDATE idempotency_keys SET state = 'in_progress', response_status = NULL, \
              response_body = NULL, completed_at = NULL;",
        postgres: OnPostgres::Same,
        expect: "an effect belongs to a completed key row",
    },
    Tampering {
        name: "an entry pointing at no account",
        sql: "PRAGMA foreign_keys = OFF; UPDATE entries SET account_id = 9999 \
              WHERE id = (SELECT min(id) FROM entries);",
        postgres: OnPostgres::Skipped,
        expect: "foreign_key_check",
    },
    Tampering {
        name: "the acquirer authorized one operation twice",
        // As if the simulator had forgotten the key (a lost file, a prune
        // too early) and the takeover had been authorized afresh.
        sql: "INSERT INTO acquirer.calls (kind, key, authorization_id, amount, currency, \
              created, timed_out, at) SELECT kind, key, authorization_id || 'x', amount, \
              currency, 1, 0, at FROM acquirer.calls WHERE kind = 'authorize';",
        postgres: OnPostgres::Skipped,
        expect: "authorized operation",
    },
    Tampering {
        name: "an account's held is off: it holds what no open hold adds up to",
        sql: "UPDATE accounts SET held = held + 250 WHERE public_id = 'fund_brl';",
        postgres: OnPostgres::Same,
        expect: "holds: held and pending_credit are what the open holds on an account add up to",
    },
    Tampering {
        name: "a merchant holds more than its balance",
        sql: "UPDATE accounts SET held = balance + 1 WHERE public_id = 'shop_brl_b';",
        postgres: OnPostgres::Same,
        expect: "holds: no merchant has less available than 0",
    },
    Tampering {
        name: "a partial capture posted the whole authorization",
        sql: "UPDATE entries SET amount = amount / 600 * 1000 WHERE refund_id IS NULL \
              AND charge_id = (SELECT id FROM charges WHERE reference = 'checks-ref-1'); \
              UPDATE accounts SET balance = \
              (SELECT coalesce(sum(e.amount), 0) FROM entries e WHERE e.account_id = accounts.id);",
        postgres: OnPostgres::Same,
        expect: "(succeeded, captured 600) has entries",
    },
    Tampering {
        name: "the ledger says a capture took the whole authorization; the client was told 600",
        sql: "UPDATE charges SET amount_captured = 1000 WHERE reference = 'checks-ref-1';",
        postgres: OnPostgres::Same,
        expect: "answered 200 but charge",
    },
    Tampering {
        name: "an acknowledged cancel shows as an expiry",
        sql: "UPDATE charges SET cancellation_reason = 'expired' WHERE reference = 'checks-ref-2';",
        postgres: OnPostgres::Same,
        expect: "is canceled (expired) in the database",
    },
    Tampering {
        name: "an authorization is open at the acquirer with no held charge",
        sql: "UPDATE acquirer.authorizations SET state = 'authorized', captured = 0 \
              WHERE authorization_id = (SELECT authorization_id FROM charges \
              WHERE reference = 'checks-ref');",
        // `idem verify`'s acquirer agreement, through the CLI.
        postgres: OnPostgres::Skipped,
        expect: "is open at the acquirer, but its charge",
    },
    Tampering {
        name: "a claim left on a hold by a capture that finished",
        sql: "UPDATE charges SET status = 'requires_capture', canceled_at = NULL, \
              cancellation_reason = NULL, expires_at = created_at + 2000, \
              claimed_by = (SELECT op_id FROM idempotency_keys WHERE key = 'checks-capture-3') \
              WHERE reference = 'checks-ref-3'; \
              UPDATE accounts SET held = held + 200 WHERE public_id = 'fund_brl' \
              AND consumer_id = (SELECT id FROM consumers WHERE name = 'torture-0'); \
              UPDATE accounts SET pending_credit = pending_credit + 200 \
              WHERE public_id = 'shop_brl_c' \
              AND consumer_id = (SELECT id FROM consumers WHERE name = 'torture-0');",
        postgres: OnPostgres::Same,
        expect: "which is not a capture or cancel of it in progress",
    },
    Tampering {
        name: "an expired hold that no expiry voided or released",
        sql: "UPDATE charges SET status = 'requires_capture', canceled_at = NULL, \
              cancellation_reason = NULL, expires_at = created_at + 2000 \
              WHERE reference = 'checks-ref-3'; \
              UPDATE acquirer.authorizations SET state = 'authorized' WHERE authorization_id = \
              (SELECT authorization_id FROM charges WHERE reference = 'checks-ref-3'); \
              DELETE FROM acquirer.operations WHERE key LIKE 'expire:%'; \
              DELETE FROM acquirer.calls WHERE key LIKE 'expire:%'; \
              UPDATE accounts SET held = held + 200 WHERE public_id = 'fund_brl' \
              AND consumer_id = (SELECT id FROM consumers WHERE name = 'torture-0'); \
              UPDATE accounts SET pending_credit = pending_credit + 200 \
              WHERE public_id = 'shop_brl_c' \
              AND consumer_id = (SELECT id FROM consumers WHERE name = 'torture-0');",
        postgres: OnPostgres::Skipped,
        expect: "is still held after the drain",
    },
    Tampering {
        name: "the acquirer captured one authorization twice",
        sql: "INSERT INTO acquirer.calls (kind, key, authorization_id, amount, currency, \
              created, timed_out, at) SELECT kind, key || 'x', authorization_id, amount, \
              currency, 1, 0, at FROM acquirer.calls WHERE kind = 'capture';",
        postgres: OnPostgres::Skipped,
        expect: "captured authorization",
    },
    Tampering {
        name: "a capture refused with 409 called the acquirer",
        sql: "INSERT INTO acquirer.calls (kind, key, authorization_id, amount, currency, \
              created, timed_out, at) SELECT 'capture', k.op_id, c.authorization_id, 0, \
              c.currency, 0, 0, 0 FROM idempotency_keys k, charges c \
              WHERE k.key = 'checks-capture-2' AND c.reference = 'checks-ref-2';",
        postgres: OnPostgres::Skipped,
        expect: "answered 409 yet the acquirer was called",
    },
    Tampering {
        name: "an event is lost (deleted with its delivery) after it was delivered",
        sql: "DELETE FROM deliveries WHERE event_id IN \
              (SELECT id FROM events WHERE type = 'charge.dispute.created'); \
              DELETE FROM events WHERE type = 'charge.dispute.created';",
        postgres: OnPostgres::Same,
        expect: "arrived at the receiver but is not in the database",
    },
    Tampering {
        name: "an event's stored body is not the bytes that were delivered",
        sql: "UPDATE events SET body = CAST(replace(CAST(body AS TEXT), \
              '\"amount\":500', '\"amount\":501') AS BLOB) WHERE type = 'charge.succeeded';",
        postgres: OnPostgres::Sql(
            "UPDATE events SET body = convert_to(replace(convert_from(body, 'UTF8'), \
              '\"amount\":500', '\"amount\":501'), 'UTF8') WHERE type = 'charge.succeeded';",
        ),
        expect: "differs from the bytes the receiver got",
    },
    Tampering {
        name: "a delivery marked succeeded that the receiver never saw",
        sql: "INSERT INTO webhook_endpoints (consumer_id, public_id, url, enabled_events, secret, \
              created_at) SELECT consumer_id, public_id || 'x', url || 'x', enabled_events, \
              secret, created_at FROM webhook_endpoints \
              WHERE id = (SELECT min(id) FROM webhook_endpoints); \
              INSERT INTO deliveries (event_id, endpoint_id, status, attempts, last_status, \
              updated_at) SELECT id, (SELECT max(id) FROM webhook_endpoints), 'succeeded', 1, \
              200, created_at FROM events WHERE type = 'charge.dispute.created';",
        postgres: OnPostgres::Same,
        expect: "is succeeded, but the receiver never got it there",
    },
    Tampering {
        name: "a chargeback applied twice (consistently: balances and amount_disputed follow)",
        sql: "INSERT INTO entries (public_id, account_id, amount, charge_id, dispute_id, \
              created_at) SELECT public_id || 'x', account_id, amount, charge_id, dispute_id, \
              created_at FROM entries WHERE dispute_id IS NOT NULL; \
              UPDATE charges SET amount_disputed = 2 * amount_disputed; \
              UPDATE accounts SET balance = \
              (SELECT coalesce(sum(e.amount), 0) FROM entries e WHERE e.account_id = accounts.id);",
        postgres: OnPostgres::Same,
        expect: "disputes: a dispute moved its amount once",
    },
    Tampering {
        name: "a chargeback answered 422 moved money anyway",
        sql: "INSERT INTO disputes (consumer_id, public_id, charge_id, notification_id, amount, \
              created_at) SELECT n.consumer_id, 'dp_tampered', c.id, n.id, 100, n.received_at \
              FROM notifications n, charges c WHERE n.webhook_id = 'checks-ntf-2' \
              AND c.reference = 'checks-ref-4'; \
              INSERT INTO entries (public_id, account_id, amount, charge_id, dispute_id, \
              created_at) SELECT 'ent_tampered_' || v.n, \
              CASE v.n WHEN 1 THEN c.destination_id ELSE c.source_id END, \
              CASE v.n WHEN 1 THEN -100 ELSE 100 END, c.id, \
              (SELECT id FROM disputes WHERE public_id = 'dp_tampered'), c.created_at \
              FROM charges c, (SELECT 1 AS n UNION ALL SELECT 2) v \
              WHERE c.reference = 'checks-ref-4'; \
              UPDATE charges SET amount_disputed = amount_disputed + 100 \
              WHERE reference = 'checks-ref-4'; \
              UPDATE accounts SET balance = \
              (SELECT coalesce(sum(e.amount), 0) FROM entries e WHERE e.account_id = accounts.id);",
        postgres: OnPostgres::Same,
        expect: "is ignored with 1 dispute(s)",
    },
];

/// Sends one intent of the self-test until its final answer, judges it and
/// records it.
fn checks_intent(
    ctx: &Ctx,
    addr: SocketAddr,
    secret: &str,
    intent: Intent,
    records: &mut Vec<Record>,
) -> Value {
    let r = send_intent(addr, secret, &intent)
        .unwrap_or_else(|e| ctx.fail(&[format!("{}: {e}", intent.path)]));
    let first = Answer {
        status: r.status,
        replayed: r.replayed(),
        body: r.body,
        received_ms: now_ms(),
    };
    if let Err(what) = judge(&intent, &first) {
        ctx.fail(&[what]);
    }
    let body = first.json().unwrap_or(Value::Null);
    records.push(Record {
        intent: Arc::new(intent),
        first,
    });
    body
}

/// The self-test's file (see `TAMPERINGS`), built through a real server
/// and left quiescent, both WALs checkpointed, every event delivered; the
/// answers its client saw, and what the webhook receiver accepted.
fn checks_file(ctx: &Ctx, db: &Path) -> (Vec<Record>, HashMap<String, Arrival>) {
    let keys: Vec<String> = (0..CONSUMERS)
        .map(|i| support::create_consumer_cli(db, &format!("torture-{i}")))
        .collect();
    let receiver = Receiver::start(0);
    let _stop_receiver = StopReceiver(Arc::clone(&receiver));
    let server = start_server(ctx, db);
    let sources = create_endpoints_and_sources(ctx, server.addr, &keys, &receiver);
    create_accounts(ctx, server.addr, &keys);
    let mut records = Vec::new();
    let intent = |key: &str, path: String, body: Value, kind: Kind, tag: &'static str| Intent {
        client: 0,
        consumer: 0,
        key: key.into(),
        path,
        body: body.to_string(),
        kind,
        respond_async: false,
        created_ms: now_ms(),
        tag,
    };
    let charge = |n: &str, amount: i64, source: &'static str, destination: &'static str| {
        let reference = format!("checks-ref{n}");
        let capture = n.is_empty() || n == "-4";
        let mut body = json!({"amount": amount, "currency": "BRL", "source": source,
                              "destination": destination, "reference": reference});
        if !capture {
            body["capture"] = json!(false);
        }
        let kind = Kind::Charge {
            amount,
            source,
            destination,
            reference,
            may_decline: false,
            capture,
        };
        intent(
            &format!("checks-key{n}"),
            "/v1/charges".into(),
            body,
            kind,
            if capture { "sale" } else { "hold" },
        )
    };
    let mut send = |intent: Intent| {
        let secret = match intent.kind {
            Kind::Chargeback { .. } => &sources[0].secret,
            _ => &keys[0],
        };
        checks_intent(ctx, server.addr, secret, intent, &mut records)
    };
    send(charge("", 700, "fund_brl", "shop_brl_a"));
    let holds: Vec<(String, i64)> = [
        charge("-1", 1000, "fund_brl", "shop_brl_b"),
        charge("-2", 300, "shop_brl_a", "shop_brl_c"),
        charge("-3", 200, "fund_brl", "shop_brl_c"),
    ]
    .into_iter()
    .map(|hold| {
        let body = send(hold);
        let expires_at = time_of(&body, "expires_at").expect("a hold expires");
        (body["id"].as_str().unwrap().to_string(), expires_at)
    })
    .collect();
    let capture = |n: usize, amount: Option<i64>, authorized: i64, settled: bool, tag| {
        let (charge, expires_at_ms) = holds[n - 1].clone();
        let body = amount.map_or(json!({}), |a| json!({ "amount": a }));
        let path = format!("/v1/charges/{charge}/capture");
        let kind = Kind::Capture {
            charge,
            amount,
            authorized,
            expires_at_ms,
            settled,
        };
        intent(&format!("checks-capture-{n}"), path, body, kind, tag)
    };
    send(capture(1, Some(600), 1000, false, "partial capture"));
    let refund = Kind::Refund {
        charge: holds[0].0.clone(),
        amount: Some(100),
        left: Some(600),
    };
    let path = format!("/v1/charges/{}/refunds", holds[0].0);
    send(intent(
        "checks-refund-1",
        path,
        json!({"amount": 100}),
        refund,
        "refund",
    ));
    let held = holds[1].0.clone();
    let path = format!("/v1/charges/{held}/cancel");
    let cancel = Kind::Cancel {
        charge: held,
        authorized: 300,
        settled: false,
    };
    send(intent("checks-cancel-2", path, json!({}), cancel, "cancel"));
    send(capture(2, None, 300, true, "capture of a settled hold"));
    // Hold 3 is left alone until the reaper has voided and released it.
    let deadline =
        Instant::now() + Duration::from_millis(AUTHORIZATION_TTL_MS as u64) + DRAIN_DEADLINE;
    let auth = format!("Bearer {}", keys[0]);
    let expired = loop {
        let path = format!("/v1/charges/{}", holds[2].0);
        let r = support::send(server.addr, "GET", &path, &[("Authorization", &auth)], b"")
            .unwrap_or_else(|e| ctx.fail(&[format!("GET {path}: {e}")]));
        let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        if body["status"] == "canceled" {
            break body;
        }
        if Instant::now() > deadline {
            ctx.fail(&[format!("hold 3 did not expire: {body}")]);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(expired["cancellation_reason"], "expired", "{expired}");
    send(capture(3, None, 200, false, "late capture"));
    // A sale of 500 disputed for 150 (applied), then for 400 (422: 350 is
    // left).
    let sale = send(charge("-4", 500, "fund_brl", "shop_brl_c"));
    let chargeback = |n: usize, amount: i64, left: i64, tag| {
        let data = json!({"authorization": sale["authorization"], "amount": amount});
        let kind = Kind::Chargeback {
            charge: sale["id"].as_str().unwrap_or_default().to_string(),
            source: sources[0].id.clone(),
            amount,
            left,
        };
        let path = format!("/v1/notifications/{}", sources[0].id);
        let body = json!({"type": "chargeback.created", "data": data});
        intent(&format!("checks-ntf-{n}"), path, body, kind, tag)
    };
    send(chargeback(1, 150, 500, "chargeback"));
    send(chargeback(2, 400, 350, "chargeback over what is left"));
    drain(
        ctx,
        db,
        "pending deliveries",
        DELIVERY_DRAIN_DEADLINE,
        pending_deliveries,
    );
    ctx.check(receiver.take_problems());
    server.kill();
    let mut files = vec![acquirer_file(db)];
    if !support::on_postgres() {
        files.push(db.to_path_buf());
    }
    for file in files {
        Connection::open(&file)
            .unwrap()
            .execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
            .unwrap();
    }
    (records, receiver.arrivals())
}

/// The kills are only worth something if the checks fail when they should:
/// on a real file with a sale and holds captured, canceled and expired,
/// each tampering is caught and named; the untouched copy passes.
#[test]
fn the_checks_catch_what_they_claim_to() {
    let dir = TempDir::new("torture-checks");
    let db = dir.db();
    let ctx = Ctx {
        test: "the_checks_catch_what_they_claim_to",
        seed: 0,
        kills: 0,
        at: "checks self-test".into(),
    };
    let (records, arrivals) = checks_file(&ctx, &db);
    let statuses: Vec<u16> = records.iter().map(|r| r.first.status).collect();
    assert_eq!(
        statuses,
        [201, 201, 201, 201, 200, 201, 200, 409, 409, 201, 200, 422]
    );

    // A copy of the database and of the simulator's file, each in a
    // directory (and on PostgreSQL a database) of its own.
    let copy = |tag: &str| dir.copy(&format!("torture-checks-{tag}"));
    check_end(&ctx, &copy("untouched").db(), &records, &arrivals);
    let mut skipped = Vec::new();
    for (i, t) in TAMPERINGS.iter().enumerate() {
        let sql = match (support::on_postgres(), &t.postgres) {
            (false, _) | (true, OnPostgres::Same) => t.sql,
            (true, OnPostgres::Sql(sql)) => sql,
            (true, OnPostgres::Skipped) => {
                skipped.push(t.name);
                continue;
            }
        };
        let tampered = copy(&format!("tampered-{i}"));
        let path = tampered.db();
        if support::on_postgres() {
            let url = path.to_str().expect("a URL");
            postgres::Client::connect(url, postgres::NoTls)
                .and_then(|mut c| c.batch_execute(sql))
                .unwrap_or_else(|e| panic!("{}: {e}", t.name));
        } else {
            let conn = Connection::open(&path).unwrap();
            conn.execute(
                "ATTACH DATABASE ?1 AS acquirer",
                [Simulator::store_path(&path).to_str().unwrap()],
            )
            .unwrap();
            conn.execute_batch(sql)
                .unwrap_or_else(|e| panic!("{}: {e}", t.name));
        }
        let caught = std::panic::catch_unwind(|| check_end(&ctx, &path, &records, &arrivals));
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
    // The answers, not only the file: the late capture of hold 3, as if it
    // had come back before the hold expired, with nothing else trying.
    let mut early = records.clone();
    let late = early
        .iter_mut()
        .find(|r| r.intent.key == "checks-capture-3")
        .unwrap();
    let Kind::Capture { expires_at_ms, .. } = late.intent.kind else {
        unreachable!("checks-capture-3 is a capture")
    };
    late.first.received_ms = expires_at_ms - 1;
    let early_copy = copy("early");
    let path = early_copy.db();
    let caught = std::panic::catch_unwind(|| check_end(&ctx, &path, &early, &arrivals));
    let message = caught
        .err()
        .and_then(|e| e.downcast_ref::<String>().cloned());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("before hold") && m.contains("no other capture or cancel")),
        "a 409 before the expiry with no winner: {message:?}"
    );
    // And the receiver's side: an event the database marks delivered that
    // never reached it (the receiver's log without the dispute's event).
    let dispute_event = arrivals
        .iter()
        .find(|(_, a)| a.body.windows(22).any(|w| w == b"charge.dispute.created"))
        .map(|(id, _)| id.clone())
        .expect("the dispute's event arrived");
    let mut lost = arrivals.clone();
    lost.remove(&dispute_event);
    let lost_copy = copy("lost-event");
    let path = lost_copy.db();
    let caught = std::panic::catch_unwind(|| check_end(&ctx, &path, &records, &lost));
    let message = caught
        .err()
        .and_then(|e| e.downcast_ref::<String>().cloned());
    assert!(
        message.as_deref().is_some_and(|m| m.contains(&format!(
            "lost: event {dispute_event} (charge.dispute.created) never arrived"
        ))),
        "an event that never arrived: {message:?}"
    );
    if !skipped.is_empty() {
        eprintln!(
            "on PostgreSQL, {} of {} tamperings were done (the others edit the simulator's file \
             or SQLite's structure): skipped {skipped:?}",
            TAMPERINGS.len() - skipped.len(),
            TAMPERINGS.len()
        );
    }
}

/// The judge accepts the answers the contract allows an intent, given what
/// its client knows, and nothing else.
#[test]
fn the_judge_allows_exactly_what_the_contract_allows() {
    const EXPIRES: i64 = 1_796_000_002_000;
    let intent = |kind: Kind, created_ms: i64| Intent {
        client: 0,
        consumer: 0,
        key: "k".into(),
        path: "/v1/charges".into(),
        body: "{}".into(),
        kind,
        respond_async: false,
        created_ms,
        tag: "judge",
    };
    let answer = |status: u16, body: Value| Answer {
        status,
        body: body.to_string().into_bytes(),
        replayed: false,
        received_ms: 0,
    };
    let problem = |status: u16, slug: &str| {
        answer(
            status,
            json!({"type": format!("urn:idem:problem:{slug}"), "status": status}),
        )
    };
    let time = |ms: i64| json!(idem::time::rfc3339(ms));
    let hold = |lifetime: i64| {
        let kind = Kind::Charge {
            amount: 1000,
            source: "fund_brl",
            destination: "shop_brl_a",
            reference: "r".into(),
            may_decline: false,
            capture: false,
        };
        let body = json!({"object": "charge", "id": "ch_1", "amount": 1000,
            "source": "fund_brl", "destination": "shop_brl_a", "reference": "r",
            "authorization": "auth_1", "status": "requires_capture", "amount_captured": 0,
            "amount_capturable": 1000, "amount_refunded": 0, "canceled_at": null,
            "cancellation_reason": null, "created_at": time(EXPIRES - lifetime),
            "expires_at": time(EXPIRES)});
        (intent(kind, 0), answer(201, body))
    };
    let settled = |status: &str, captured: i64, reason: Value| {
        let canceled_at = if reason.is_null() {
            Value::Null
        } else {
            time(EXPIRES)
        };
        answer(
            200,
            json!({"object": "charge", "id": "ch_1", "amount": 1000, "status": status,
                "amount_captured": captured, "amount_capturable": 0, "amount_refunded": 0,
                "expires_at": null, "canceled_at": canceled_at, "cancellation_reason": reason}),
        )
    };
    let capture = |amount: Option<i64>, created_ms: i64, settled: bool| {
        let kind = Kind::Capture {
            charge: "ch_1".into(),
            amount,
            authorized: 1000,
            expires_at_ms: EXPIRES,
            settled,
        };
        intent(kind, created_ms)
    };
    let cancel = |settled: bool| {
        let kind = Kind::Cancel {
            charge: "ch_1".into(),
            authorized: 1000,
            settled,
        };
        intent(kind, 0)
    };
    let refund = |amount: Option<i64>, left: Option<i64>| {
        let kind = Kind::Refund {
            charge: "ch_1".into(),
            amount,
            left,
        };
        intent(kind, 0)
    };
    let refunded = |amount: i64| {
        answer(
            201,
            json!({"object": "refund", "id": "re_1", "charge": "ch_1", "amount": amount}),
        )
    };
    let captured = |n: i64| settled("succeeded", n, Value::Null);
    let chargeback = |amount: i64, left: i64| {
        let kind = Kind::Chargeback {
            charge: "ch_1".into(),
            source: "src_1".into(),
            amount,
            left,
        };
        intent(kind, 0)
    };
    let notified = |source: &str, status: &str| {
        answer(
            200,
            json!({"id": "ntf_1", "object": "notification", "source": source,
                "webhook_id": "k", "type": "chargeback.created", "status": status,
                "received_at": time(EXPIRES)}),
        )
    };
    let before = EXPIRES - 1;
    let cases: Vec<(&str, Intent, Answer, bool)> = vec![
        (
            "a hold",
            hold(AUTHORIZATION_TTL_MS).0,
            hold(AUTHORIZATION_TTL_MS).1,
            true,
        ),
        ("a hold with another lifetime", hold(1).0, hold(1).1, false),
        (
            "a full capture",
            capture(None, before, false),
            captured(1000),
            true,
        ),
        (
            "a partial capture",
            capture(Some(600), before, false),
            captured(600),
            true,
        ),
        (
            "a capture for another amount",
            capture(Some(600), before, false),
            captured(1000),
            false,
        ),
        (
            "a capture made at the expiry",
            capture(None, EXPIRES, false),
            captured(1000),
            false,
        ),
        (
            "a capture of a settled hold",
            capture(None, before, true),
            captured(1000),
            false,
        ),
        (
            "a capture lost",
            capture(None, before, false),
            problem(409, "invalid-charge-state"),
            true,
        ),
        (
            "a capture told its key is busy",
            capture(None, before, false),
            problem(409, "idempotency-key-in-use"),
            false,
        ),
        (
            "a capture over",
            capture(Some(1001), before, false),
            problem(422, "capture-exceeds-authorization"),
            true,
        ),
        (
            "a capture not over, 422",
            capture(Some(1000), before, false),
            problem(422, "capture-exceeds-authorization"),
            false,
        ),
        (
            "a cancel",
            cancel(false),
            settled("canceled", 0, json!("requested")),
            true,
        ),
        (
            "a cancel that expired",
            cancel(false),
            settled("canceled", 0, json!("expired")),
            false,
        ),
        (
            "a cancel that captured",
            cancel(false),
            captured(1000),
            false,
        ),
        (
            "a cancel of a settled hold",
            cancel(true),
            settled("canceled", 0, json!("requested")),
            false,
        ),
        (
            "a refund of all that is left",
            refund(None, Some(300)),
            refunded(300),
            true,
        ),
        (
            "a refund that fits",
            refund(Some(300), Some(300)),
            refunded(300),
            true,
        ),
        (
            "a refund that fits, 422",
            refund(Some(300), Some(300)),
            problem(422, "refund-exceeds-charge"),
            false,
        ),
        (
            "a refund that fits, 402",
            refund(Some(300), Some(300)),
            problem(402, "insufficient-funds"),
            true,
        ),
        (
            "a refund past what is left",
            refund(Some(301), Some(300)),
            problem(422, "refund-exceeds-charge"),
            true,
        ),
        (
            "a refund past what is left, 201",
            refund(Some(301), Some(300)),
            refunded(301),
            false,
        ),
        (
            "a refund past what is left, 402",
            refund(Some(301), Some(300)),
            problem(402, "insufficient-funds"),
            false,
        ),
        (
            "a refund of nothing left",
            refund(None, Some(0)),
            problem(422, "refund-exceeds-charge"),
            true,
        ),
        (
            "a refund of a hold",
            refund(None, None),
            problem(409, "invalid-charge-state"),
            true,
        ),
        (
            "a refund of a hold, 201",
            refund(None, None),
            refunded(1000),
            false,
        ),
        (
            "a refund of a sale, 409",
            refund(None, Some(300)),
            problem(409, "invalid-charge-state"),
            false,
        ),
        (
            "a chargeback of all that is left",
            chargeback(300, 300),
            notified("src_1", "applied"),
            true,
        ),
        (
            "a chargeback that fits, 422",
            chargeback(300, 300),
            problem(422, "dispute-exceeds-charge"),
            false,
        ),
        (
            "a chargeback past what is left",
            chargeback(301, 300),
            problem(422, "dispute-exceeds-charge"),
            true,
        ),
        (
            "a chargeback past what is left, applied",
            chargeback(301, 300),
            notified("src_1", "applied"),
            false,
        ),
        (
            "a chargeback of a captured charge left unmatched",
            chargeback(1, 300),
            notified("src_1", "unmatched"),
            false,
        ),
        (
            "a chargeback of a captured charge ignored",
            chargeback(1, 300),
            notified("src_1", "ignored"),
            false,
        ),
        (
            "a chargeback answered for another source",
            chargeback(1, 300),
            notified("src_2", "applied"),
            false,
        ),
        (
            "a chargeback refused for the charge's state",
            chargeback(1, 300),
            problem(409, "invalid-charge-state"),
            false,
        ),
    ];
    for (name, intent, answer, allowed) in cases {
        let verdict = judge(&intent, &answer);
        assert_eq!(verdict.is_ok(), allowed, "{name}: {verdict:?}");
    }
}

/// The test's reading of idem's timestamps agrees with idem's rendering,
/// and refuses anything else.
#[test]
fn timestamps_read_back_as_idem_writes_them() {
    for ms in [0, 951_782_400_000, 1_796_032_872_123, 4_107_542_399_999] {
        assert_eq!(parse_rfc3339_ms(&idem::time::rfc3339(ms)), Some(ms));
    }
    let now = now_ms();
    assert_eq!(parse_rfc3339_ms(&idem::time::rfc3339(now)), Some(now));
    for bad in [
        "",
        "2026-11-30T10:01:12Z",
        "2026-11-30T10:01:12.123+00:00",
        "2026-02-30T10:01:12.123Z",
        "2026-11-30T10:01:12.12aZ",
        "+026-11-30T10:01:12.123Z",
    ] {
        assert_eq!(parse_rfc3339_ms(bad), None, "{bad:?}");
    }
}
