//! Crashes in the middle of the two-phase operations, with real `idem serve`
//! children that abort at an `IDEM_FAULT=KIND:POINT` (or are SIGKILLed) and
//! are restarted on the same database file: a capture or cancel killed at
//! each of its four points, finished by a retry and by the reaper (also
//! while its hold expires); a refund
//! killed after its ledger effect and after the acquirer's refund; an expiry
//! killed between its void and its release; a capture killed while the
//! acquirer is slow; and the void of an authorization the ledger declined,
//! killed between the decline and the void.
//!
//! Each proves from the outside what ARCHITECTURE.md's fault table says: the
//! state on disk after the crash (key row, ledger, the acquirer simulator's
//! own file), that a retry before `--inflight-timeout` is 409 and one after it
//! takes over and finishes, that a later replay is the same bytes, that the
//! acquirer made exactly one capture, void or refund (counted in its journal,
//! `Simulator::journal`), the balances, and `idem verify` (which holds the
//! ledger against the acquirer's books) on the crashed and the finished file.
//!
//! The variants of one scenario run in parallel threads, each on its own
//! database and children, so the file waits out the in-flight timeout a few
//! times, not once per variant.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use idem::acquirer::{Call, CallKind, Simulator, StoredAuthorization};
use rusqlite::{Connection, OpenFlags};
use serde_json::{json, Value};
use support::{ChildServer, Client, Resp, TempDir};

// Long enough for a restart on a loaded 2-core CI machine to fit inside it
// (as in tests/crash.rs).
const INFLIGHT: &str = "3s";
const INFLIGHT_TIMEOUT: Duration = Duration::from_secs(3);
/// Past the in-flight timeout by this much, a lock is surely stale (the
/// server counts whole milliseconds of wall-clock time).
const MARGIN: Duration = Duration::from_millis(300);
/// The reaper never runs: only the test's retries finish an orphan.
const REAPER_OFF: [&str; 2] = ["--reaper-interval", "1h"];
/// The reaper runs often: it finishes an orphan nobody retries.
const REAPER_ON: [&str; 2] = ["--reaper-interval", "200ms"];
/// How long the reaper may take to finish an orphan once it is one.
const REAPER_WITHIN: Duration = Duration::from_secs(20);

/// What `wallet` is funded with, how much the hold takes, how much a
/// capture captures (a partial capture: the rest is released).
const FUNDS: i64 = 10_000;
const HELD: i64 = 4_000;
const CAPTURED: i64 = 3_000;
/// The idempotency key of the operation that is killed.
const KEY: &str = "crash-key";

// ---------------------------------------------------------------------------
// Servers, requests and what is on disk

/// Starts `idem serve` on `db` with the test's in-flight timeout, `args`
/// and, if given, `IDEM_FAULT`.
fn start(db: &Path, args: &[&str], fault: Option<&str>) -> ChildServer {
    let mut all = vec!["--inflight-timeout", INFLIGHT];
    all.extend_from_slice(args);
    let env: Vec<(&str, &str)> = fault.map(|f| ("IDEM_FAULT", f)).into_iter().collect();
    ChildServer::start(db, &all, &env)
}

/// Starts a server again on `db`, without a fault, and points `client` at it.
fn restart(db: &Path, client: &mut Client, args: &[&str]) -> ChildServer {
    let server = start(db, args, None);
    assert!(
        server.initial_key.is_none(),
        "the same database, not a new one"
    );
    client.addr = server.addr;
    server
}

/// A client of a new server on an empty database.
fn client_of(server: &ChildServer) -> Client {
    Client::new(
        server.addr,
        server.initial_key.as_deref().expect("default key"),
    )
}

/// When the request that crashed the server was sent, and when the server
/// was seen dead. The key's lock was taken (or last refreshed) in between.
struct Crash {
    sent: Instant,
    dead: Instant,
}

impl Crash {
    /// A request answered now was decided before the key's lock could be
    /// stale: it was decided less than the in-flight timeout after `sent`.
    fn assert_still_fresh(&self, what: &str) {
        assert!(
            self.sent.elapsed() < INFLIGHT_TIMEOUT,
            "{what}: the restart took longer than the in-flight timeout ({:?}); \
             this machine is too slow for the test",
            self.sent.elapsed()
        );
    }

    /// Sleeps until the key's lock is surely stale.
    fn wait_out_the_inflight_timeout(&self) {
        std::thread::sleep(INFLIGHT_TIMEOUT.saturating_sub(self.dead.elapsed()) + MARGIN);
    }
}

/// Sends `request`, which the server aborts in the middle of, and waits for
/// the process to die. Returns the crash and what the client got (nothing,
/// unless the request was asynchronous: then maybe its 202).
fn crash_on(
    server: ChildServer,
    fault: &str,
    request: impl FnOnce() -> std::io::Result<Resp>,
) -> (Crash, std::io::Result<Resp>) {
    let sent = Instant::now();
    let got = request();
    // Anything but an asynchronous request's 202 means the fault point was
    // not reached: say so now rather than wait for an exit that never comes.
    if let Some(r) = got.as_ref().ok().filter(|r| r.status != 202) {
        panic!(
            "{fault}: the fault point was not reached: the server answered {} {}",
            r.status,
            body_text(r)
        );
    }
    let status = server.wait_exit(Duration::from_secs(20));
    assert!(!status.success(), "{fault}: the server aborted: {status}");
    let dead = Instant::now();
    (Crash { sent, dead }, got)
}

/// Sends a request the server aborts in the middle of: no answer.
fn lose_answer(
    server: ChildServer,
    fault: &str,
    client: &Client,
    path: &str,
    body: &Value,
) -> Crash {
    let (crash, got) = crash_on(server, fault, || {
        client.try_request("POST", path, &[("Idempotency-Key", KEY)], &body.to_string())
    });
    assert!(
        got.is_err(),
        "{fault}: the server died before answering, but it answered {:?}",
        got.map(|r| (r.status, body_text(&r)))
    );
    crash
}

/// The key row of `key`, read from the database file.
#[derive(Debug, Clone)]
struct KeyRow {
    op_id: String,
    state: String,
    recovery_point: String,
    generation: i64,
    locked_at_ms: i64,
    response_status: Option<u16>,
    response_body: Option<Vec<u8>>,
    completed_at_ms: Option<i64>,
}

fn read_only(db: &Path) -> Connection {
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY).expect("open read-only")
}

fn key_row(db: &Path, key: &str) -> KeyRow {
    read_only(db)
        .query_row(
            "SELECT op_id, state, recovery_point, generation, locked_at, response_status, \
             response_body, completed_at FROM idempotency_keys WHERE key = ?1",
            [key],
            |r| {
                Ok(KeyRow {
                    op_id: r.get(0)?,
                    state: r.get(1)?,
                    recovery_point: r.get(2)?,
                    generation: r.get(3)?,
                    locked_at_ms: r.get(4)?,
                    response_status: r.get(5)?,
                    response_body: r.get(6)?,
                    completed_at_ms: r.get(7)?,
                })
            },
        )
        .unwrap_or_else(|e| panic!("key row {key}: {e}"))
}

/// Polls `probe` until it returns `Ok`; fails after `within` with `what`
/// and the last thing `probe` saw.
fn wait_until<T>(within: Duration, what: &str, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + within;
    loop {
        match probe() {
            Ok(found) => return found,
            Err(seen) if Instant::now() >= deadline => {
                panic!("not within {within:?}: {what}; last seen: {seen}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Waits until `key` is completed (by the reaper) and returns its row.
fn completed(db: &Path, key: &str) -> KeyRow {
    wait_until(REAPER_WITHIN, "the reaper completes the key", || {
        let row = key_row(db, key);
        if row.state == "completed" {
            Ok(row)
        } else {
            Err(format!("{row:?}"))
        }
    })
}

/// (status, claimed_by) of a charge, read from the database file.
fn charge_row(db: &Path, charge: &str) -> (String, Option<String>) {
    read_only(db)
        .query_row(
            "SELECT status, claimed_by FROM charges WHERE public_id = ?1",
            [charge],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
}

/// Every call of `kind` the acquirer simulator of `db` journaled about
/// `authorization`.
fn calls(db: &Path, kind: CallKind, authorization: &str) -> Vec<Call> {
    support::journal(db)
        .expect("read the acquirer's journal")
        .into_iter()
        .filter(|c| c.kind == kind && c.authorization == authorization)
        .collect()
}

/// Of those, the ones that made something (not a repeat that found it).
fn made(calls: &[Call]) -> usize {
    calls.iter().filter(|c| c.created).count()
}

/// What the acquirer's books say of `authorization`.
fn at_acquirer(db: &Path, authorization: &str) -> StoredAuthorization {
    support::authorizations(db)
        .expect("read the acquirer's books")
        .into_iter()
        .find(|a| a.id == authorization)
        .unwrap_or_else(|| panic!("the acquirer never made {authorization}"))
}

/// (balance, held, available) of an account.
fn funds(client: &Client, id: &str) -> (i64, i64, i64) {
    let r = client.get(&format!("/v1/accounts/{id}"));
    assert_eq!(r.status, 200);
    let a = r.json();
    (
        a["balance"].as_i64().unwrap(),
        a["held"].as_i64().unwrap(),
        a["available"].as_i64().unwrap(),
    )
}

fn charge(client: &Client, id: &str) -> Value {
    let r = client.get(&format!("/v1/charges/{id}"));
    assert_eq!(r.status, 200);
    r.json()
}

/// The value of a counter in `/metrics`.
fn metric(client: &Client, name: &str) -> u64 {
    let text = String::from_utf8(client.get("/metrics").body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

fn body_text(r: &Resp) -> String {
    String::from_utf8_lossy(&r.body).into_owned()
}

/// Runs `run` for every variant, each on its own thread (named after it),
/// and fails naming the variants that failed (their panics are printed as
/// they happen).
fn in_parallel<V: std::fmt::Debug + Sync>(variants: &[V], run: impl Fn(&V) + Sync) {
    let failed: Vec<String> = std::thread::scope(|s| {
        let running: Vec<_> = variants
            .iter()
            .map(|v| {
                let run = &run;
                let thread = std::thread::Builder::new()
                    .name(format!("{v:?}"))
                    .spawn_scoped(s, move || run(v))
                    .expect("spawn a variant");
                (format!("{v:?}"), thread)
            })
            .collect();
        running
            .into_iter()
            .filter_map(|(name, thread)| thread.join().is_err().then_some(name))
            .collect()
    });
    assert!(failed.is_empty(), "failed variants: {failed:?}");
}

// ---------------------------------------------------------------------------
// A hold, and its capture or cancel

/// A hold placed before the crash.
struct Hold {
    id: String,
    authorization: String,
}

/// A new database with `card` (may go negative), `wallet` (funded with
/// FUNDS) and `shop`, and a hold of HELD from wallet to shop; the server
/// (with `fault`, which none of this reaches) is left running.
fn server_with_hold(db: &Path, fault: Option<&str>, args: &[&str]) -> (ChildServer, Client, Hold) {
    let server = start(db, args, fault);
    let client = client_of(&server);
    client.card_and_shop();
    client.account("wallet", false);
    let fund = json!({"amount": FUNDS, "currency": "BRL", "source": "card",
                      "destination": "wallet"});
    let funded = client.charge("fund", &fund);
    assert_eq!(funded.status, 201, "{}", body_text(&funded));
    let held = client.charge(
        "hold",
        &json!({"amount": HELD, "currency": "BRL", "source": "wallet", "destination": "shop",
                "capture": false}),
    );
    assert_eq!(held.status, 201, "{}", body_text(&held));
    let held = held.json();
    assert_eq!(held["status"], "requires_capture");
    let hold = Hold {
        id: held["id"].as_str().unwrap().to_string(),
        authorization: held["authorization"].as_str().unwrap().to_string(),
    };
    assert_eq!(funds(&client, "wallet"), (FUNDS, HELD, FUNDS - HELD));
    (server, client, hold)
}

/// A capture (of CAPTURED) or a cancel of the hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    Capture,
    Cancel,
}

impl Settle {
    /// The `KIND` of `IDEM_FAULT=KIND:POINT`.
    fn kind(self) -> &'static str {
        match self {
            Settle::Capture => "capture",
            Settle::Cancel => "cancel",
        }
    }

    fn path(self, charge: &str) -> String {
        format!("/v1/charges/{charge}/{}", self.kind())
    }

    fn body(self) -> Value {
        match self {
            Settle::Capture => json!({"amount": CAPTURED}),
            Settle::Cancel => json!({}),
        }
    }

    fn send(self, client: &Client, charge: &str) -> Resp {
        client.post(&self.path(charge), Some(KEY), &self.body())
    }

    /// The acquirer call it makes, and the one it must never make.
    fn call(self) -> (CallKind, CallKind) {
        match self {
            Settle::Capture => (CallKind::Capture, CallKind::Void),
            Settle::Cancel => (CallKind::Void, CallKind::Capture),
        }
    }

    /// The recovery point recorded after its acquirer call.
    fn recovery_point(self) -> &'static str {
        match self {
            Settle::Capture => "captured",
            Settle::Cancel => "voided",
        }
    }

    /// The authorization's state at the acquirer once it is made.
    fn acquirer_state(self) -> &'static str {
        self.recovery_point()
    }

    /// The charge's status once it is done.
    fn status(self) -> &'static str {
        match self {
            Settle::Capture => "succeeded",
            Settle::Cancel => "canceled",
        }
    }
}

/// Where the server aborts (named as in `IDEM_FAULT`, hence the prefix).
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    AfterReserve,
    AfterAcquirer,
    AfterRecoveryPoint,
    AfterCommit,
}

const POINTS: [Point; 4] = [
    Point::AfterReserve,
    Point::AfterAcquirer,
    Point::AfterRecoveryPoint,
    Point::AfterCommit,
];

impl Point {
    fn name(self) -> &'static str {
        match self {
            Point::AfterReserve => "after_reserve",
            Point::AfterAcquirer => "after_acquirer",
            Point::AfterRecoveryPoint => "after_recovery_point",
            Point::AfterCommit => "after_commit",
        }
    }
}

/// Checks the state the crash left on disk, as ARCHITECTURE.md's fault
/// table has it: where the key row stands, and whether the acquirer made
/// the capture or void already.
fn assert_crash_state(db: &Path, op: Settle, point: Point, hold: &Hold, row: &KeyRow) {
    let at = point.name();
    let (kind, never) = op.call();
    let made_before: usize = match point {
        Point::AfterReserve => 0,
        _ => 1,
    };
    let expected_point = match point {
        Point::AfterReserve | Point::AfterAcquirer => "reserved",
        Point::AfterRecoveryPoint | Point::AfterCommit => op.recovery_point(),
    };
    let expected_state = match point {
        Point::AfterCommit => "completed",
        _ => "in_progress",
    };
    assert_eq!(
        (
            row.state.as_str(),
            row.recovery_point.as_str(),
            row.generation
        ),
        (expected_state, expected_point, 1),
        "{at}: the key row after the crash"
    );
    let so_far = calls(db, kind, &hold.authorization);
    assert_eq!(
        (so_far.len(), made(&so_far)),
        (made_before, made_before),
        "{at}: {kind:?} calls before the restart: {so_far:?}"
    );
    assert!(calls(db, never, &hold.authorization).is_empty());
    let expected_at_acquirer = if made_before == 0 {
        "authorized"
    } else {
        op.acquirer_state()
    };
    assert_eq!(
        at_acquirer(db, &hold.authorization).state,
        expected_at_acquirer,
        "{at}"
    );
    // The ledger has moved only if the commit happened; until then the
    // charge is held and claimed by the operation.
    let (status, claimed_by) = charge_row(db, &hold.id);
    if point == Point::AfterCommit {
        assert_eq!((status.as_str(), claimed_by), (op.status(), None), "{at}");
    } else {
        assert_eq!(
            (status.as_str(), claimed_by.as_deref()),
            ("requires_capture", Some(row.op_id.as_str())),
            "{at}"
        );
    }
}

/// After the operation killed at `point` finished with `answer`: a later
/// replay is the same bytes; the key row is completed with it (after one
/// takeover unless the crash came after the commit); the acquirer made
/// exactly one capture (or void) under the operation's id, was asked as
/// often as `calls_in_all(point)` says, and made no void (or capture); the
/// charge and the balances are right; `idem verify` passes.
fn assert_settled_once(
    db: &Path,
    client: &Client,
    op: Settle,
    point: Point,
    hold: &Hold,
    answer: &Resp,
    what: &str,
) {
    let generation = if point == Point::AfterCommit { 1 } else { 2 };
    let calls_expected = calls_in_all(point);
    assert_eq!(answer.status, 200, "{what}: {}", body_text(answer));
    let done = answer.json();
    assert_eq!(done["status"], op.status(), "{what}");
    match op {
        Settle::Capture => {
            assert_eq!(
                (
                    done["amount_captured"].as_i64(),
                    done["amount_capturable"].as_i64()
                ),
                (Some(CAPTURED), Some(0)),
                "{what}"
            );
        }
        Settle::Cancel => {
            assert_eq!(done["cancellation_reason"], "requested", "{what}");
            assert!(done["canceled_at"].is_string(), "{what}");
        }
    }
    let late = op.send(client, &hold.id);
    assert!(late.replayed(), "{what}: a later retry replays");
    assert_eq!(late.status, 200);
    assert_eq!(
        late.body, answer.body,
        "{what}: the replay is the same bytes"
    );

    let row = key_row(db, KEY);
    assert_eq!(
        (row.state.as_str(), row.generation),
        ("completed", generation),
        "{what}"
    );
    assert_eq!(row.response_body.as_deref(), Some(&answer.body[..]));

    let (kind, never) = op.call();
    let asked = calls(db, kind, &hold.authorization);
    assert_eq!(
        made(&asked),
        1,
        "{what}: exactly one {kind:?} made: {asked:?}"
    );
    assert_eq!(asked.len(), calls_expected, "{what}: {asked:?}");
    assert!(
        asked.iter().all(|c| c.key == row.op_id),
        "{what}: every {kind:?} under the operation's id {}: {asked:?}",
        row.op_id
    );
    let other = calls(db, never, &hold.authorization);
    assert!(other.is_empty(), "{what}: no {never:?}: {other:?}");
    let books = at_acquirer(db, &hold.authorization);
    assert_eq!(books.state, op.acquirer_state(), "{what}");

    assert_eq!(
        charge(client, &hold.id),
        done,
        "{what}: the charge as answered"
    );
    let (wallet, shop) = match op {
        Settle::Capture => {
            assert_eq!(books.captured, CAPTURED, "{what}");
            (FUNDS - CAPTURED, CAPTURED)
        }
        Settle::Cancel => (FUNDS, 0),
    };
    assert_eq!(funds(client, "wallet"), (wallet, 0, wallet), "{what}");
    assert_eq!(funds(client, "shop"), (shop, 0, shop), "{what}");
    support::assert_verified(db);
}

/// How many capture (or void) calls the acquirer sees in all: the takeover
/// asks again only when the crash left the row at `reserved`.
fn calls_in_all(point: Point) -> usize {
    match point {
        Point::AfterAcquirer => 2,
        _ => 1,
    }
}

/// A hold, then its capture or cancel killed at `point`; restart; a retry
/// before the in-flight timeout is 409, one after it takes the orphan over
/// and finishes it (200, not a replay); see `assert_settled_once`.
fn settle_killed_then_retried(op: Settle, point: Point) {
    let dir = TempDir::new(&format!("2pc-{}-{}", op.kind(), point.name()));
    let db = dir.db();
    let fault = format!("{}:{}", op.kind(), point.name());
    let (server, mut client, hold) = server_with_hold(&db, Some(&fault), &REAPER_OFF);
    let crash = lose_answer(server, &fault, &client, &op.path(&hold.id), &op.body());
    let crashed = key_row(&db, KEY);
    assert_crash_state(&db, op, point, &hold, &crashed);

    let _server = restart(&db, &mut client, &REAPER_OFF);
    let answer = if point == Point::AfterCommit {
        // Committed, never answered: nothing is left to run.
        let replay = op.send(&client, &hold.id);
        assert!(replay.replayed(), "{fault}: committed before the crash");
        replay
    } else {
        let early = op.send(&client, &hold.id);
        crash.assert_still_fresh(&fault);
        assert_eq!(
            (early.status, early.slug().as_str()),
            (409, "idempotency-key-in-use"),
            "{fault}: the orphan is not yet past the in-flight timeout"
        );
        // The claim survived the crash: the opposite operation is refused
        // before it reaches the acquirer.
        let rival = match op {
            Settle::Capture => Settle::Cancel,
            Settle::Cancel => Settle::Capture,
        };
        let refused = client.post(&rival.path(&hold.id), Some("rival"), &rival.body());
        assert_eq!(
            (refused.status, refused.slug().as_str()),
            (409, "invalid-charge-state"),
            "{fault}: a {} while the {} is an orphan",
            rival.kind(),
            op.kind()
        );
        // The crashed state, unchanged by the 409s, holds up too.
        support::assert_verified(&db);
        crash.wait_out_the_inflight_timeout();
        let taken_over = op.send(&client, &hold.id);
        assert!(
            !taken_over.replayed(),
            "{fault}: the takeover finished it: {}",
            body_text(&taken_over)
        );
        taken_over
    };
    assert_settled_once(&db, &client, op, point, &hold, &answer, &fault);
}

/// The same kill, but nobody retries: the reaper takes the orphan over once
/// it is past the in-flight timeout (not before) and finishes it; a later
/// retry replays the answer the reaper stored.
fn settle_killed_then_reaped(op: Settle, point: Point) {
    let dir = TempDir::new(&format!("2pc-reap-{}-{}", op.kind(), point.name()));
    let db = dir.db();
    let fault = format!("{}:{}", op.kind(), point.name());
    let (server, mut client, hold) = server_with_hold(&db, Some(&fault), &REAPER_OFF);
    let crash = lose_answer(server, &fault, &client, &op.path(&hold.id), &op.body());
    let crashed = key_row(&db, KEY);
    assert_crash_state(&db, op, point, &hold, &crashed);
    support::assert_verified(&db);

    let _server = restart(&db, &mut client, &REAPER_ON);
    let row = if point == Point::AfterCommit {
        // Give the reaper a few passes past the in-flight timeout: it must
        // leave a completed key alone.
        crash.wait_out_the_inflight_timeout();
        std::thread::sleep(Duration::from_millis(500));
        key_row(&db, KEY)
    } else {
        let row = completed(&db, KEY);
        let completed_at = row.completed_at_ms.unwrap();
        assert!(
            completed_at - crashed.locked_at_ms > INFLIGHT_TIMEOUT.as_millis() as i64,
            "{fault}: the reaper waited out the in-flight timeout \
             (locked at {}, completed at {completed_at})",
            crashed.locked_at_ms
        );
        row
    };
    let replay = op.send(&client, &hold.id);
    assert!(replay.replayed(), "{fault}: the reaper completed the key");
    assert_eq!(
        (Some(replay.status), row.response_body.as_deref()),
        (row.response_status, Some(&replay.body[..])),
        "{fault}: the replay is the answer the reaper stored"
    );
    let taken_over = u64::from(point != Point::AfterCommit);
    assert_eq!(
        metric(&client, "idem_orphans_taken_over_total"),
        taken_over,
        "{fault}"
    );
    assert_settled_once(
        &db,
        &client,
        op,
        point,
        &hold,
        &replay,
        &format!("{fault} (reaper)"),
    );
}

/// Issue 9: a capture killed at each point — before the acquirer, between
/// the acquirer's capture and its recovery point, between the recovery
/// point and the ledger commit, after the commit — is captured once after
/// the takeover.
#[test]
fn a_capture_killed_at_each_point_is_captured_once_by_the_retry_that_takes_over() {
    in_parallel(&POINTS, |&point| {
        settle_killed_then_retried(Settle::Capture, point)
    });
}

/// The same for a cancel: one void.
#[test]
fn a_cancel_killed_at_each_point_is_voided_once_by_the_retry_that_takes_over() {
    in_parallel(&POINTS, |&point| {
        settle_killed_then_retried(Settle::Cancel, point)
    });
}

/// The same kills with nobody retrying: the reaper finishes each, once.
#[test]
fn a_capture_or_cancel_killed_at_each_point_is_finished_once_by_the_reaper() {
    let variants: Vec<(Settle, Point)> = [Settle::Capture, Settle::Cancel]
        .into_iter()
        .flat_map(|op| POINTS.map(|point| (op, point)))
        .collect();
    in_parallel(&variants, |&(op, point)| {
        settle_killed_then_reaped(op, point)
    });
}

/// A capture or cancel claimed its hold, then died; the hold expires while
/// the operation is an orphan. The reaper must not expire a hold that a
/// capture or cancel claimed (the acquirer may have captured it already):
/// it finishes the orphan instead, once past the in-flight timeout, and the
/// authorization is captured (or voided) once, never voided as expired.
fn settle_killed_as_its_hold_expires(op: Settle, point: Point) {
    let dir = TempDir::new(&format!("2pc-expiring-{}-{}", op.kind(), point.name()));
    let db = dir.db();
    let fault = format!("{}:{}", op.kind(), point.name());
    // Expires 1 s before the orphan's lock goes stale (or more: the capture
    // follows the hold at once).
    let args = ["--authorization-ttl", "2s", "--reaper-interval", "1h"];
    let (server, mut client, hold) = server_with_hold(&db, Some(&fault), &args);
    let expires_at_ms: i64 = read_only(&db)
        .query_row(
            "SELECT expires_at FROM charges WHERE public_id = ?1",
            [&hold.id],
            |r| r.get(0),
        )
        .unwrap();
    let _crash = lose_answer(server, &fault, &client, &op.path(&hold.id), &op.body());
    let crashed = key_row(&db, KEY);
    assert_crash_state(&db, op, point, &hold, &crashed);

    let _server = restart(&db, &mut client, &REAPER_ON);
    let row = completed(&db, KEY);
    assert!(
        row.completed_at_ms.unwrap() > expires_at_ms,
        "{fault}: the hold had expired before the orphan was finished"
    );
    let replay = op.send(&client, &hold.id);
    assert!(replay.replayed(), "{fault}: the reaper completed the key");
    assert_eq!(row.response_body.as_deref(), Some(&replay.body[..]));
    assert_eq!(
        metric(&client, "idem_authorizations_expired_total"),
        0,
        "{fault}: nothing was expired"
    );
    assert_settled_once(
        &db,
        &client,
        op,
        point,
        &hold,
        &replay,
        &format!("{fault} (expiring)"),
    );
}

#[test]
fn a_capture_or_cancel_killed_as_its_hold_expires_is_finished_not_expired() {
    let variants = [
        (Settle::Capture, Point::AfterReserve),
        (Settle::Capture, Point::AfterAcquirer),
        (Settle::Cancel, Point::AfterReserve),
        (Settle::Cancel, Point::AfterAcquirer),
    ];
    in_parallel(&variants, |&(op, point)| {
        settle_killed_as_its_hold_expires(op, point)
    });
}

/// A real SIGKILL (not an abort at a fault point) while a capture waits for
/// a slow acquirer that has already made it: the retry after the in-flight
/// timeout takes over, asks again under the same key and is given that
/// capture, not a second one.
#[test]
fn a_capture_sigkilled_while_the_acquirer_is_slow_is_captured_once() {
    let dir = TempDir::new("2pc-sigkill");
    let db = dir.db();
    let (server, mut client, hold) = server_with_hold(&db, None, &REAPER_OFF);
    server.kill();
    // Slower than the acquirer deadline (half the in-flight timeout): the
    // capture is made at once and answered never, so the kill lands inside
    // the call.
    let server = restart(
        &db,
        &mut client,
        &["--acquirer-latency", "3s", "--reaper-interval", "1h"],
    );
    let sent = Instant::now();
    let pending = {
        let (client, id) = (client.clone(), hold.id.clone());
        std::thread::spawn(move || {
            let op = Settle::Capture;
            client.try_request(
                "POST",
                &op.path(&id),
                &[("Idempotency-Key", KEY)],
                &op.body().to_string(),
            )
        })
    };
    wait_until(
        Duration::from_secs(10),
        "the acquirer has made the capture",
        || match calls(&db, CallKind::Capture, &hold.authorization) {
            none if none.is_empty() => Err("no capture journaled".into()),
            _ => Ok(()),
        },
    );
    server.kill();
    let crash = Crash {
        sent,
        dead: Instant::now(),
    };
    let got = pending.join().unwrap();
    assert!(
        got.is_err(),
        "the kill came inside the acquirer call, before any answer: {:?}",
        got.map(|r| (r.status, body_text(&r)))
    );
    let crashed = key_row(&db, KEY);
    assert_crash_state(&db, Settle::Capture, Point::AfterAcquirer, &hold, &crashed);

    let _server = restart(&db, &mut client, &REAPER_OFF);
    let early = Settle::Capture.send(&client, &hold.id);
    crash.assert_still_fresh("sigkill");
    assert_eq!(
        (early.status, early.slug().as_str()),
        (409, "idempotency-key-in-use")
    );
    crash.wait_out_the_inflight_timeout();
    let taken_over = Settle::Capture.send(&client, &hold.id);
    assert!(!taken_over.replayed(), "{}", body_text(&taken_over));
    assert_settled_once(
        &db,
        &client,
        Settle::Capture,
        Point::AfterAcquirer,
        &hold,
        &taken_over,
        "sigkill",
    );
}

// ---------------------------------------------------------------------------
// Refunds, ledger first

/// Who finishes the orphan after the restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finisher {
    Retry,
    Reaper,
}

const SALE: i64 = 4_200;
const REFUNDED: i64 = 1_500;

/// Where a refund is killed, and how it was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefundKill {
    /// `refund:after_recovery_point` of an asynchronous refund (`Prefer:
    /// respond-async`): its ledger effect and answer are committed by the
    /// operation (recovery point `applied`), the acquirer not yet called.
    AppliedAsync,
    /// The same point of a synchronous refund, whose ledger effect and
    /// answer commit in the transaction that reserves its key.
    AppliedSync,
    /// `refund:after_acquirer`: the acquirer refunded, the key is not yet
    /// completed.
    AfterAcquirer,
}

impl RefundKill {
    fn fault(self) -> &'static str {
        match self {
            RefundKill::AppliedAsync | RefundKill::AppliedSync => "refund:after_recovery_point",
            RefundKill::AfterAcquirer => "refund:after_acquirer",
        }
    }

    /// Refund calls the acquirer journaled before the restart.
    fn refunded_before(self) -> usize {
        match self {
            RefundKill::AfterAcquirer => 1,
            _ => 0,
        }
    }
}

/// A sale (captured at once) of SALE from card to shop, then a refund of
/// REFUNDED killed at `kill`, finished by `finisher`: one refund at the
/// acquirer, the key completes with the 201 body stored before the crash,
/// later replays are those bytes, verify passes.
fn refund_killed(kill: RefundKill, finisher: Finisher) {
    let dir = TempDir::new(&format!("2pc-refund-{kill:?}-{finisher:?}"));
    let db = dir.db();
    let fault = kill.fault();
    let server = start(&db, &REAPER_OFF, Some(fault));
    let mut client = client_of(&server);
    client.card_and_shop();
    let sale = client.charge("sale", &support::charge_body(SALE));
    assert_eq!(sale.status, 201);
    let sale = sale.json();
    let (id, auth) = (
        sale["id"].as_str().unwrap().to_string(),
        sale["authorization"].as_str().unwrap().to_string(),
    );
    let path = format!("/v1/charges/{id}/refunds");
    let body = json!({"amount": REFUNDED}).to_string();
    let (crash, got) = crash_on(server, fault, || {
        let mut headers = vec![("Idempotency-Key", KEY)];
        if kill == RefundKill::AppliedAsync {
            headers.push(("Prefer", "respond-async"));
        }
        client.try_request("POST", &path, &headers, &body)
    });
    match got {
        // The 202 may or may not leave before the operation aborts.
        Ok(r) if kill == RefundKill::AppliedAsync => assert_eq!(r.status, 202),
        other => assert!(
            other.is_err(),
            "{fault} ({kill:?}): the server died before answering, but it answered {:?}",
            other.map(|r| (r.status, body_text(&r)))
        ),
    }

    // Ledger first: the refund and its answer are committed, the key is
    // still in progress at `applied`.
    let crashed = key_row(&db, KEY);
    assert_eq!(
        (
            crashed.state.as_str(),
            crashed.recovery_point.as_str(),
            crashed.response_status
        ),
        ("in_progress", "applied", Some(201)),
        "{kill:?}"
    );
    let stored = crashed.response_body.clone().unwrap();
    let before = calls(&db, CallKind::Refund, &auth);
    assert_eq!(
        (before.len(), made(&before)),
        (kill.refunded_before(), kill.refunded_before()),
        "{kill:?}: {before:?}"
    );

    let args: &[&str] = match finisher {
        Finisher::Retry => &REAPER_OFF,
        Finisher::Reaper => &REAPER_ON,
    };
    let _server = restart(&db, &mut client, args);
    let retry = || client.request("POST", &path, &[("Idempotency-Key", KEY)], &body);
    let answer = match finisher {
        Finisher::Retry => {
            let early = retry();
            crash.assert_still_fresh(fault);
            assert_eq!(
                (early.status, early.slug().as_str()),
                (409, "idempotency-key-in-use"),
                "{kill:?}"
            );
            // The ledger never shows less than the acquirer sent back.
            assert_eq!(client.balance("shop"), SALE - REFUNDED);
            support::assert_verified(&db);
            crash.wait_out_the_inflight_timeout();
            let taken_over = retry();
            assert!(
                !taken_over.replayed(),
                "{kill:?}: {}",
                body_text(&taken_over)
            );
            taken_over
        }
        Finisher::Reaper => {
            completed(&db, KEY);
            let replay = retry();
            assert!(replay.replayed(), "{kill:?}: the reaper completed the key");
            assert_eq!(metric(&client, "idem_orphans_taken_over_total"), 1);
            replay
        }
    };
    assert_eq!(answer.status, 201, "{kill:?}: {}", body_text(&answer));
    assert_eq!(
        answer.body, stored,
        "{kill:?}: the answer decided before the crash"
    );
    let refund = answer.json();
    assert_eq!(
        (refund["amount"].as_i64(), refund["charge"].as_str()),
        (Some(REFUNDED), Some(id.as_str()))
    );
    let late = retry();
    assert!(late.replayed());
    assert_eq!(late.body, answer.body);

    let row = key_row(&db, KEY);
    assert_eq!((row.state.as_str(), row.generation), ("completed", 2));
    let refunds = calls(&db, CallKind::Refund, &auth);
    assert_eq!(made(&refunds), 1, "{kill:?}: one refund made: {refunds:?}");
    assert_eq!(refunds.len(), 1 + kill.refunded_before(), "{refunds:?}");
    assert!(refunds
        .iter()
        .all(|c| c.key == row.op_id && c.amount == REFUNDED));
    let books = at_acquirer(&db, &auth);
    assert_eq!(
        (books.state.as_str(), books.captured, books.refunded),
        ("captured", SALE, REFUNDED)
    );
    assert_eq!(charge(&client, &id)["amount_refunded"], REFUNDED);
    assert_eq!(client.balance("shop"), SALE - REFUNDED);
    assert_eq!(client.balance("card"), REFUNDED - SALE);
    support::assert_verified(&db);
}

/// A refund killed after its ledger effect (asked for asynchronously, the
/// way `refund:after_recovery_point` fires today) and one killed after the
/// acquirer refunded, each finished by a retry and by the reaper.
#[test]
fn a_refund_killed_after_its_ledger_effect_or_the_acquirers_refund_is_refunded_once() {
    let variants = [
        (RefundKill::AppliedAsync, Finisher::Retry),
        (RefundKill::AppliedAsync, Finisher::Reaper),
        (RefundKill::AfterAcquirer, Finisher::Retry),
        (RefundKill::AfterAcquirer, Finisher::Reaper),
    ];
    in_parallel(&variants, |&(kill, finisher)| refund_killed(kill, finisher));
}

/// KNOWN BUG (fails today): `refund:after_recovery_point` never fires for
/// a synchronous refund — the ordinary kind. Its ledger effect and answer
/// commit inside the reservation's transaction (`app::prepare`), and
/// `run_refund`, starting at `applied`, skips the `commit` whose
/// `Committed::Decided` arm holds the fault; so the server answers 201 and
/// lives, and this crash — entries committed, the acquirer not yet called —
/// cannot be produced for a synchronous refund, though ARCHITECTURE.md's
/// fault table lists it. Kept failing until the fault fires after the
/// reservation that applied the refund.
#[test]
fn a_synchronous_refund_killed_after_its_ledger_effect_is_refunded_once() {
    refund_killed(RefundKill::AppliedSync, Finisher::Retry);
}

// ---------------------------------------------------------------------------
// Expiry

/// The reaper claimed an expired hold and the acquirer voided it, then the
/// server died before the release (`expiry:after_acquirer`): after the
/// restart the next pass finds its own claim, voids again under the same
/// key (given the first void, not a second) and releases the hold as
/// expired.
#[test]
fn an_expiry_killed_between_its_void_and_its_release_is_finished_by_the_next_pass() {
    let dir = TempDir::new("2pc-expiry");
    let db = dir.db();
    let fault = "expiry:after_acquirer";
    let args = ["--authorization-ttl", "1s", "--reaper-interval", "200ms"];
    let (server, mut client, hold) = server_with_hold(&db, Some(fault), &args);
    // No request: the reaper itself dies once the hold has expired.
    let status = server.wait_exit(Duration::from_secs(20));
    assert!(!status.success(), "{fault}: the server aborted: {status}");

    let (status, claimed_by) = charge_row(&db, &hold.id);
    assert_eq!(
        (status.as_str(), claimed_by.as_deref()),
        ("requires_capture", Some("expiry")),
        "claimed by the reaper, not released"
    );
    let key = format!("expire:{}", hold.id);
    let voids = calls(&db, CallKind::Void, &hold.authorization);
    assert_eq!(voids.len(), 1, "{voids:?}");
    assert!(voids[0].created && voids[0].key == key, "{voids:?}");
    assert_eq!(at_acquirer(&db, &hold.authorization).state, "voided");
    support::assert_verified(&db);

    // Until the next pass, the reaper's claim stands: neither a cancel (a
    // second void, under another key) nor a capture (of a voided
    // authorization) reaches the acquirer.
    let server = restart(&db, &mut client, &REAPER_OFF);
    for (op, key) in [(Settle::Cancel, "cancel"), (Settle::Capture, "capture")] {
        let refused = client.post(&op.path(&hold.id), Some(key), &op.body());
        assert_eq!(
            (refused.status, refused.slug().as_str()),
            (409, "invalid-charge-state"),
            "a {key} of a hold the reaper claimed"
        );
    }
    server.kill();
    let _server = restart(&db, &mut client, &REAPER_ON);
    let released = wait_until(REAPER_WITHIN, "the next pass releases the hold", || {
        let c = charge(&client, &hold.id);
        if c["status"] == "canceled" {
            Ok(c)
        } else {
            Err(format!("{:?}", charge_row(&db, &hold.id)))
        }
    });
    assert_eq!(released["cancellation_reason"], "expired");
    assert!(released["canceled_at"].is_string() && released["expires_at"].is_null());
    assert_eq!(released["amount_capturable"], 0);
    assert_eq!(charge_row(&db, &hold.id).1, None, "the claim is gone");
    let voids = calls(&db, CallKind::Void, &hold.authorization);
    assert_eq!(made(&voids), 1, "one void made: {voids:?}");
    assert_eq!(voids.len(), 2, "asked again once: {voids:?}");
    assert!(voids.iter().all(|c| c.key == key), "{voids:?}");
    assert!(calls(&db, CallKind::Capture, &hold.authorization).is_empty());
    assert_eq!(metric(&client, "idem_authorizations_expired_total"), 1);
    assert_eq!(funds(&client, "wallet"), (FUNDS, 0, FUNDS));
    assert_eq!(funds(&client, "shop"), (0, 0, 0));
    // Later passes have nothing left to do.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(calls(&db, CallKind::Void, &hold.authorization).len(), 2);
    support::assert_verified(&db);
}

// ---------------------------------------------------------------------------
// The void of an authorization the ledger declined

/// The charges whose authorization is `authorization`.
fn charges_with(db: &Path, authorization: &str) -> usize {
    read_only(db)
        .query_row(
            "SELECT count(*) FROM charges WHERE authorization_id = ?1",
            [authorization],
            |r| r.get::<_, i64>(0),
        )
        .unwrap() as usize
}

/// The wallet's funds, what the late hold asks for, and what the refund
/// that spends the funds meanwhile takes back.
const DECLINE_FUNDS: i64 = 1_000;
const LATE_HOLD: i64 = 800;
const SPENT: i64 = 900;

/// A charge authorised and killed before its ledger phase (the key still
/// `reserved`: a charge's authorization has no commit of its own); its
/// funds spent before it resumes; its takeover asks the acquirer again (the
/// same authorization), its ledger phase declines, and the server is
/// killed again between the decline record (`declined`, with the
/// authorization and the 402 stored) and the void; then `finisher`
/// finishes it: the void once, under `<op_id>:void`, the 402 answered and
/// replayed, no charge and no open authorization left.
///
/// `charge:after_recovery_point` fires only where a charge records a
/// recovery point, its decline. The funds are spent by a refund of the
/// sale that funded the wallet (a refund is no `charge`, so no charge fault
/// fires).
fn decline_killed_before_its_void(finisher: Finisher) {
    let dir = TempDir::new(&format!("2pc-decline-{finisher:?}"));
    let db = dir.db();
    let authorized_fault = "charge:after_acquirer";
    let fault = "charge:after_recovery_point";
    let late_hold = json!({"amount": LATE_HOLD, "currency": "BRL", "source": "wallet",
                           "destination": "shop", "capture": false});

    // 1. The wallet, funded by a sale (no fault: it is a charge).
    let server = start(&db, &REAPER_OFF, None);
    let mut client = client_of(&server);
    client.card_and_shop();
    client.account("wallet", false);
    let fund = json!({"amount": DECLINE_FUNDS, "currency": "BRL", "source": "card",
                      "destination": "wallet"});
    let funded = client.charge("fund", &fund);
    assert_eq!(funded.status, 201);
    let fund_id = funded.json()["id"].as_str().unwrap().to_string();
    server.kill();

    // 2. The late hold is authorised; the server dies before its ledger
    //    phase, the key still `reserved`.
    let server = start(&db, &REAPER_OFF, Some(authorized_fault));
    client.addr = server.addr;
    let first = lose_answer(server, authorized_fault, &client, "/v1/charges", &late_hold);
    let authorized = key_row(&db, KEY);
    assert_eq!(
        (
            authorized.state.as_str(),
            authorized.recovery_point.as_str()
        ),
        ("in_progress", "reserved")
    );
    let auth = support::authorizations(&db)
        .expect("read the acquirer's books")
        .into_iter()
        .find(|a| a.key == authorized.op_id)
        .expect("the acquirer authorised the hold")
        .id;
    assert_eq!(at_acquirer(&db, &auth).state, "authorized");

    // 3. Meanwhile the funds go; the takeover's ledger phase declines,
    //    records it, and the server dies before the void.
    let server = start(&db, &REAPER_OFF, Some(fault));
    client.addr = server.addr;
    let spend = client.post(
        &format!("/v1/charges/{fund_id}/refunds"),
        Some("spend"),
        &json!({"amount": SPENT}),
    );
    assert_eq!(spend.status, 201, "{}", body_text(&spend));
    assert_eq!(funds(&client, "wallet").2, DECLINE_FUNDS - SPENT);
    first.wait_out_the_inflight_timeout();
    let crash = lose_answer(server, fault, &client, "/v1/charges", &late_hold);
    let declined = key_row(&db, KEY);
    assert_eq!(
        (
            declined.state.as_str(),
            declined.recovery_point.as_str(),
            declined.generation,
            declined.response_status
        ),
        ("in_progress", "declined", 2, Some(402)),
        "the decline is recorded, the void not yet made"
    );
    let stored = declined.response_body.clone().unwrap();
    assert!(calls(&db, CallKind::Void, &auth).is_empty());
    assert_eq!(at_acquirer(&db, &auth).state, "authorized");
    assert_eq!(charges_with(&db, &auth), 0, "the ledger declined it");
    support::assert_verified(&db);

    // 4. Finished by a retry or by the reaper.
    let args: &[&str] = match finisher {
        Finisher::Retry => &REAPER_OFF,
        Finisher::Reaper => &REAPER_ON,
    };
    let _server = restart(&db, &mut client, args);
    let answer = match finisher {
        Finisher::Retry => {
            let early = client.charge(KEY, &late_hold);
            crash.assert_still_fresh("declined");
            assert_eq!(
                (early.status, early.slug().as_str()),
                (409, "idempotency-key-in-use")
            );
            crash.wait_out_the_inflight_timeout();
            let taken_over = client.charge(KEY, &late_hold);
            assert!(!taken_over.replayed(), "{}", body_text(&taken_over));
            taken_over
        }
        Finisher::Reaper => {
            completed(&db, KEY);
            let replay = client.charge(KEY, &late_hold);
            assert!(replay.replayed(), "the reaper completed the key");
            replay
        }
    };
    assert_eq!(
        (answer.status, answer.slug().as_str()),
        (402, "insufficient-funds")
    );
    assert_eq!(answer.body, stored, "the answer decided before the crash");
    let late = client.charge(KEY, &late_hold);
    assert!(late.replayed());
    assert_eq!(late.body, answer.body);

    let row = key_row(&db, KEY);
    assert_eq!((row.state.as_str(), row.generation), ("completed", 3));
    let voids = calls(&db, CallKind::Void, &auth);
    assert_eq!(voids.len(), 1, "one void: {voids:?}");
    assert!(voids[0].created);
    assert_eq!(voids[0].key, format!("{}:void", row.op_id));
    assert!(calls(&db, CallKind::Capture, &auth).is_empty());
    let authorizations = calls(&db, CallKind::Authorize, &auth);
    assert_eq!(made(&authorizations), 1, "{authorizations:?}");
    assert_eq!(at_acquirer(&db, &auth).state, "voided", "not left dangling");
    assert_eq!(charges_with(&db, &auth), 0);
    assert_eq!(client.all_charges().len(), 1, "only the sale");
    let left = DECLINE_FUNDS - SPENT;
    assert_eq!(funds(&client, "wallet"), (left, 0, left));
    assert_eq!(funds(&client, "shop"), (0, 0, 0));
    support::assert_verified(&db);
}

#[test]
fn a_decline_killed_before_its_void_is_voided_once_by_a_retry_or_by_the_reaper() {
    in_parallel(&[Finisher::Retry, Finisher::Reaper], |&finisher| {
        decline_killed_before_its_void(finisher)
    });
}
