//! The acquirer: every call has a deadline that fits in the in-flight
//! timeout, so a slow acquirer makes retries wait or get 503, never take a
//! live owner's key over (the livelock of issue 8); settings where it cannot
//! fit are refused. And the built-in simulator: what it remembers stays
//! bounded (no memory per charge, rows past the retention pruned), and a v1
//! text journal is imported once.
//!
//! The memory test counts this thread's heap with a counting global
//! allocator and SQLite's own heap, which is process-wide: every test of
//! this file holds `SERIAL`, so no other test allocates SQLite memory
//! meanwhile.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use idem::acquirer::{Acquirer, Clock, Simulator};
use idem::config::{SIMULATOR_PRUNE_BATCH_LEN, SIMULATOR_PRUNE_EVERY_CALLS};
use idem::Error;
use support::{charge_body, ChildServer, Client, TempDir};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts, per thread, the bytes allocated and not yet freed by that thread.
struct Counting;

thread_local! {
    static LIVE_BYTES: Cell<i64> = const { Cell::new(0) };
}

fn count(delta: i64) {
    // `try_with`: a thread being torn down has no counter any more.
    let _ = LIVE_BYTES.try_with(|live| live.set(live.get() + delta));
}

// SAFETY: every method forwards to `System` with the caller's arguments and
// only adds bookkeeping in a const-initialised thread local (no allocation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as i64));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Rust heap bytes this thread holds.
fn live_bytes() -> i64 {
    LIVE_BYTES.with(Cell::get)
}

/// SQLite's heap bytes, all connections of this process.
fn sqlite_bytes() -> i64 {
    // SAFETY: a read of SQLite's memory statistics, no arguments.
    unsafe { rusqlite::ffi::sqlite3_memory_used() }
}

/// A clock a test moves by hand.
fn manual_clock(start_ms: i64) -> (Arc<AtomicI64>, Clock) {
    let now = Arc::new(AtomicI64::new(start_ms));
    let read = Arc::clone(&now);
    (now, Arc::new(move || read.load(Ordering::SeqCst)))
}

fn authorize(sim: &Simulator, key: &str) -> String {
    sim.authorize(
        key,
        100,
        "BRL",
        true,
        Instant::now() + Duration::from_secs(10),
    )
    .unwrap_or_else(|e| panic!("{key}: {e:?}"))
    .approved()
    .expect("the simulator approves")
    .id
}

fn rows(db: &Path) -> (usize, usize) {
    (
        support::authorizations(db).unwrap().len(),
        support::journal(db).unwrap().len(),
    )
}

/// The v1 simulator kept every authorization in a HashMap (about 200 bytes
/// per charge ever made); this one keeps them on disk. After a warm-up that
/// fills its page cache (`SIMULATOR_CACHE_MAX_KIB`), 20,000 more charges
/// grow neither this thread's heap nor SQLite's.
#[test]
fn the_simulator_holds_no_memory_per_charge() {
    let _serial = serial();
    const WARM_UP: usize = 5_000;
    const CHARGES: usize = 20_000;
    let dir = TempDir::new("sim-memory");
    let sim = Simulator::open(&dir.db(), Duration::ZERO, Duration::from_secs(3600)).unwrap();
    for i in 0..WARM_UP {
        authorize(&sim, &format!("op_warm_{i}"));
    }
    let (heap, sqlite) = (live_bytes(), sqlite_bytes());
    for i in 0..CHARGES {
        authorize(&sim, &format!("op_{i}"));
    }
    let heap_growth = live_bytes() - heap;
    let sqlite_growth = sqlite_bytes() - sqlite;
    assert_eq!(
        rows(&dir.db()),
        (WARM_UP + CHARGES, WARM_UP + CHARGES),
        "all remembered (on disk)"
    );
    assert!(
        heap_growth < 16 * 1024,
        "the heap grew by {heap_growth} bytes over {CHARGES} charges"
    );
    assert!(
        sqlite_growth < 64 * 1024,
        "SQLite's heap grew by {sqlite_growth} bytes over {CHARGES} charges"
    );
}

/// Rows older than the retention are forgotten: by `prune`, and by the
/// simulator itself every `SIMULATOR_PRUNE_EVERY_CALLS` calls, so a long
/// run keeps a bounded number of rows and a file that stops growing.
#[test]
fn the_simulator_forgets_what_is_past_its_retention() {
    let _serial = serial();
    const RETENTION_MS: i64 = 1_000;
    let dir = TempDir::new("sim-prune");
    let db = dir.db();
    let (now, clock) = manual_clock(1_000_000);
    let retention = Duration::from_millis(RETENTION_MS as u64);
    let sim = Simulator::open_with_clock(&db, Duration::ZERO, retention, clock).unwrap();

    let old = authorize(&sim, "op_old");
    assert_eq!(authorize(&sim, "op_old"), old, "deduplicated by key");
    now.fetch_add(600, Ordering::SeqCst);
    let young = authorize(&sim, "op_young");
    now.fetch_add(RETENTION_MS - 100, Ordering::SeqCst);
    assert_eq!(
        sim.prune().unwrap(),
        3,
        "op_old: its authorization and two calls"
    );
    let kept = support::authorizations(&db).unwrap();
    assert_eq!(kept.len(), 1);
    assert_eq!(
        (kept[0].key.as_str(), kept[0].id.as_str()),
        ("op_young", young.as_str())
    );
    assert!(support::journal(&db)
        .unwrap()
        .iter()
        .all(|c| c.key == "op_young"));

    // A long run, one call per millisecond: at most a retention's worth of
    // rows, plus what arrived since the last prune.
    let bound = RETENTION_MS as usize + SIMULATOR_PRUNE_EVERY_CALLS as usize;
    let size = |sim: &Simulator| {
        drop(sim.prune());
        let conn = rusqlite::Connection::open(Simulator::store_path(&db)).unwrap();
        conn.query_row("PRAGMA page_count", [], |r| r.get::<_, i64>(0))
            .unwrap()
    };
    let mut pages = Vec::new();
    for round in 0..3 {
        for i in 0..10_000 {
            now.fetch_add(1, Ordering::SeqCst);
            authorize(&sim, &format!("op_{round}_{i}"));
        }
        let (authorizations, calls) = rows(&db);
        assert!(
            authorizations <= bound && calls <= bound,
            "round {round}: {authorizations} authorizations, {calls} calls kept (bound {bound})"
        );
        pages.push(size(&sim));
    }
    assert!(
        pages[2] <= pages[1],
        "freed pages are reused, the file stops growing: {pages:?} pages"
    );
    assert!(SIMULATOR_PRUNE_BATCH_LEN >= SIMULATOR_PRUNE_EVERY_CALLS as usize);
}

/// A v1 text journal is imported once: its authorizations are given again
/// for their keys, journaled once as the calls that made them, and the file
/// is renamed. Importing it again (a crash after the commit, before the
/// rename) changes nothing; malformed (torn) lines are skipped.
#[test]
fn a_v1_journal_is_imported_once() {
    let _serial = serial();
    let dir = TempDir::new("sim-import");
    let db = dir.db();
    let v1 = Simulator::v1_journal_path(&db);
    let text = "op_a auth_0001 700 BRL\nop_b auth_0002 55 USD\nop_c auth_00";
    std::fs::write(&v1, text).unwrap();
    let imported = dir.0.join("idem.db.acquirer.imported");

    let sim = Simulator::open(&db, Duration::ZERO, Duration::from_secs(3600)).unwrap();
    assert!(!v1.exists() && imported.exists(), "renamed once imported");
    let journal = support::journal(&db).unwrap();
    let made: Vec<_> = journal
        .iter()
        .map(|c| {
            (
                c.key.as_str(),
                c.authorization.as_str(),
                c.amount,
                c.currency.as_str(),
            )
        })
        .collect();
    assert_eq!(
        made,
        [
            ("op_a", "auth_0001", 700, "BRL"),
            ("op_b", "auth_0002", 55, "USD")
        ]
    );
    assert!(journal.iter().all(|c| c.created && !c.timed_out));
    assert_eq!(authorize(&sim, "op_a"), "auth_0001");
    drop(sim);
    let journal = support::journal(&db).unwrap();
    assert_eq!(journal.len(), 3, "the repeated call is journaled");
    assert!(!journal[2].created);

    // Undo the rename, as a crash right after the import's commit would:
    // the next start imports the file again, and nothing changes.
    std::fs::rename(&imported, &v1).unwrap();
    let sim = Simulator::open(&db, Duration::ZERO, Duration::from_secs(3600)).unwrap();
    assert!(!v1.exists());
    assert_eq!(support::journal(&db).unwrap(), journal);
    assert_eq!(support::authorizations(&db).unwrap().len(), 2);
    assert_eq!(authorize(&sim, "op_b"), "auth_0002");
}

/// How long a retrying client of the deadline tests may take to get its
/// final answer, and how long it pauses after a 409 or a 503 (impatient on
/// purpose: the server says `Retry-After: 1`).
const CLIENT_DEADLINE: Duration = Duration::from_secs(20);
const CLIENT_PAUSE: Duration = Duration::from_millis(20);

/// Sends `key`'s charge until an answer other than 409 or 503, or gives up
/// after `CLIENT_DEADLINE`; returns that answer and the statuses before it.
fn retry_until_final(client: &Client, key: &str, amount: i64) -> (Option<support::Resp>, Vec<u16>) {
    let body = charge_body(amount).to_string();
    let started = Instant::now();
    let mut seen = Vec::new();
    while started.elapsed() < CLIENT_DEADLINE {
        match client.try_request("POST", "/v1/charges", &[("Idempotency-Key", key)], &body) {
            Ok(r) if r.status == 409 || r.status == 503 => seen.push(r.status),
            Ok(r) => return (Some(r), seen),
            Err(e) => panic!("{key}: {e}"),
        }
        std::thread::sleep(CLIENT_PAUSE);
    }
    (None, seen)
}

/// Issue 8's livelock, with its numbers: the acquirer takes 2.5 s to decide,
/// the in-flight timeout is 1 s, and clients retry one key aggressively.
/// Before, every retry found the owner's lock older than 1 s (the owner was
/// still inside the acquirer), took the key over, restarted the call and
/// fenced the owner off: nothing ever completed. Now each call gives up at
/// its deadline (half the in-flight timeout by default) with a 503 that
/// unlocks the key, the next retry asks again with the same operation id,
/// and the call that is waiting when the authorization is decided gets it:
/// one charge, one authorization, every client the same answer.
#[test]
fn a_slow_acquirer_does_not_livelock_retries() {
    let _serial = serial();
    const CLIENTS: usize = 4;
    let dir = TempDir::new("livelock");
    let db = dir.db();
    let server = ChildServer::start(
        &db,
        &["--inflight-timeout", "1s", "--acquirer-latency", "2500ms"],
        &[],
    );
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let barrier = Arc::new(Barrier::new(CLIENTS));
    let started = Instant::now();
    let threads: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, barrier) = (client.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                retry_until_final(&client, "slow-key", 321)
            })
        })
        .collect();
    let answers: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let took = started.elapsed();
    let finals: Vec<_> = answers
        .iter()
        .map(|(answer, seen)| {
            answer
                .as_ref()
                .unwrap_or_else(|| panic!("no final answer in {CLIENT_DEADLINE:?}: {seen:?}"))
        })
        .collect();
    for answer in &finals {
        assert_eq!(
            answer.status,
            201,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(answer.body, finals[0].body, "every client the same answer");
    }
    assert_eq!(
        finals.iter().filter(|a| !a.replayed()).count(),
        1,
        "one request made the charge, the others replay it"
    );
    assert!(
        answers.iter().any(|(_, seen)| seen.contains(&503)),
        "calls gave up at their deadline: {answers:?}"
    );
    assert!(took < Duration::from_secs(10), "converged in {took:?}");

    let charges = client.all_charges();
    assert_eq!(charges.len(), 1);
    assert_eq!(client.balance("shop"), 321);
    let journal = support::journal(&db).unwrap();
    let made: Vec<_> = journal.iter().filter(|c| c.created).collect();
    assert_eq!(made.len(), 1, "one authorization: {journal:?}");
    assert!(journal
        .iter()
        .all(|c| c.authorization == made[0].authorization));
    assert!(journal.iter().any(|c| c.timed_out), "{journal:?}");
    assert!(
        !journal.last().unwrap().timed_out,
        "the last call got the authorization"
    );
    support::assert_verified(&db);
}

/// A call slower than `--acquirer-timeout` answers 503 at its deadline, not
/// after the acquirer's latency, and unlocks the key: the next retry is not
/// a 409 but asks the acquirer again, and once the authorization is decided
/// a retry resumes and charges with it.
#[test]
fn a_call_past_its_deadline_answers_503_at_once_and_unlocks() {
    let _serial = serial();
    const TIMEOUT: Duration = Duration::from_millis(300);
    const LATENCY: Duration = Duration::from_millis(2500);
    let (server, client) = support::server(|c| {
        c.acquirer_latency = LATENCY;
        c.acquirer_timeout = Some(TIMEOUT);
    });
    let sent = Instant::now();
    let first = client.charge("deadline", &charge_body(77));
    let took = sent.elapsed();
    assert_eq!(
        (first.status, first.slug().as_str()),
        (503, "temporarily-unavailable")
    );
    assert_eq!(first.header("retry-after"), Some("1"));
    assert!(
        took >= TIMEOUT && took < LATENCY - TIMEOUT,
        "answered at the deadline, not after the latency: {took:?}"
    );
    let second = client.charge("deadline", &charge_body(77));
    assert_eq!(second.status, 503, "unlocked: asked again, not 409");
    let journal = support::journal(server.db_path()).unwrap();
    assert_eq!(journal.len(), 2, "{journal:?}");
    assert!(journal.iter().all(|c| c.timed_out));

    let (last, seen) = retry_until_final(&client, "deadline", 77);
    let last = last.unwrap_or_else(|| panic!("no final answer: {seen:?}"));
    assert_eq!(last.status, 201);
    assert!(!last.replayed());
    assert!(!seen.contains(&409), "never in use after a 503: {seen:?}");
    assert!(
        sent.elapsed() >= LATENCY,
        "the authorization took its latency"
    );
    let charge = &client.all_charges()[0];
    let journal = support::journal(server.db_path()).unwrap();
    let made: Vec<_> = journal.iter().filter(|c| c.created).collect();
    assert_eq!(made.len(), 1, "{journal:?}");
    assert_eq!(charge["id"], last.json()["id"]);
    assert!(journal
        .iter()
        .all(|c| c.authorization == made[0].authorization));
    let stored: String = rusqlite::Connection::open(server.db_path())
        .unwrap()
        .query_row("SELECT authorization_id FROM charges", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        stored, made[0].authorization,
        "the first call's authorization"
    );
    assert_eq!(client.balance("shop"), 77);
}

/// The embedding API refuses an acquirer deadline that does not fit in the
/// in-flight timeout (more than half of it), naming both settings, and
/// creates nothing; the largest that fits starts.
#[test]
fn the_embedding_api_refuses_a_deadline_that_does_not_fit() {
    let _serial = serial();
    let cases = [
        (
            Duration::from_secs(60),
            Some(Duration::from_secs(31)),
            false,
        ),
        (Duration::from_secs(60), Some(Duration::from_secs(30)), true),
        (
            Duration::from_secs(1),
            Some(Duration::from_millis(501)),
            false,
        ),
        (
            Duration::from_secs(1),
            Some(Duration::from_millis(500)),
            true,
        ),
        (Duration::from_secs(1), Some(Duration::ZERO), false),
        (Duration::from_millis(300), None, true),
    ];
    for (inflight, timeout, starts) in cases {
        let case = format!("inflight {inflight:?}, acquirer timeout {timeout:?}");
        let dir = TempDir::new("embed-timeout");
        let configure = |c: &mut idem::Config| {
            c.addr = "127.0.0.1:0".parse().unwrap();
            c.inflight_timeout = inflight;
            c.acquirer_timeout = timeout;
        };
        let mut config = idem::Config::new(dir.db());
        configure(&mut config);
        let starts_by: [(&str, &dyn Fn() -> idem::Result<idem::Server>); 3] = [
            ("start", &|| idem::Server::start(config.clone())),
            ("start_with_acquirer", &|| {
                let acquirer = Arc::new(Simulator::new(Duration::ZERO));
                idem::Server::start_with_acquirer(config.clone(), acquirer)
            }),
            ("start_temporary", &|| {
                idem::Server::start_temporary(configure)
            }),
        ];
        for (how, start) in starts_by {
            match (starts, start()) {
                (true, Ok(server)) => server.shutdown(),
                (false, Err(Error::Usage(why))) => {
                    let names_both =
                        why.contains("--acquirer-timeout") && why.contains("--inflight-timeout");
                    let zero = timeout == Some(Duration::ZERO) && why.contains("longer than 0ms");
                    assert!(names_both || zero, "{case}, {how}: {why}");
                    assert!(!dir.db().exists(), "{case}, {how}: nothing created");
                }
                (_, other) => panic!("{case}, {how}: {:?}", other.map(|_| "started")),
            }
        }
    }
}

/// An acquirer whose first `held` calls block until the test opens the
/// gate (ignoring their deadline), then answers through a simulator.
struct Gate {
    held: usize,
    calls: std::sync::atomic::AtomicUsize,
    open: (Mutex<bool>, std::sync::Condvar),
    inner: Simulator,
}

impl Gate {
    fn open(&self) {
        *self.open.0.lock().unwrap() = true;
        self.open.1.notify_all();
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Acquirer for Gate {
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        deadline: Instant,
    ) -> Result<idem::acquirer::AuthorizeOutcome, idem::acquirer::Unavailable> {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.held {
            let open = self.open.0.lock().unwrap();
            let waited = self
                .open
                .1
                .wait_timeout_while(open, CLIENT_DEADLINE, |open| !*open);
            assert!(*waited.unwrap().0, "the test opens the gate");
        }
        self.inner
            .authorize(key, amount, currency, capture, deadline)
    }

    crate::settle_through_inner!();
}

/// The deadline counts from the owner's lock, not from the call: an
/// operation that waited in the operation queue past its acquirer timeout
/// does not start a call it could not finish before the recovery point.
/// Every operation thread is held inside the acquirer while more charges
/// queue behind them; once the held calls return, the queued ones answer
/// 503 (their keys unlocked) without calling, and a retry of each charges.
#[test]
fn an_operation_that_queued_past_its_deadline_does_not_call() {
    let _serial = serial();
    const HELD: usize = idem::config::OPERATION_THREADS;
    const QUEUED: usize = 8;
    const TIMEOUT: Duration = Duration::from_millis(300);
    let dir = TempDir::new("queued-deadline");
    let gate = Arc::new(Gate {
        held: HELD,
        calls: Default::default(),
        open: (Mutex::new(false), std::sync::Condvar::new()),
        inner: Simulator::new(Duration::ZERO),
    });
    let (server, client) = support::server_with_acquirer(&dir, gate.clone(), |c| {
        c.acquirer_timeout = Some(TIMEOUT);
    });
    let barrier = Arc::new(Barrier::new(HELD + QUEUED));
    let senders: Vec<_> = (0..HELD + QUEUED)
        .map(|i| {
            let (client, barrier) = (client.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                let key = format!("queued-{i}");
                let headers = [
                    ("Idempotency-Key", key.as_str()),
                    ("Prefer", "respond-async"),
                ];
                let r =
                    client.request("POST", "/v1/charges", &headers, &charge_body(5).to_string());
                assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
                r.header("location").unwrap().to_string()
            })
        })
        .collect();
    let locations: Vec<String> = senders.into_iter().map(|s| s.join().unwrap()).collect();
    support::eventually(Duration::from_secs(10), || {
        (gate.calls() == HELD).then_some(())
    });
    // Every key is reserved (202 came after its commit); let the queued
    // ones' locks age past the acquirer timeout, then let the held go.
    std::thread::sleep(TIMEOUT * 2);
    gate.open();
    // Wait until every operation has settled: completed, or given up (its
    // key unlocked, `locked_at = 0`).
    let db = rusqlite::Connection::open_with_flags(
        server.db_path(),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let count = |sql: &str| db.query_row(sql, [], |r| r.get::<_, i64>(0)).unwrap() as usize;
    support::eventually(Duration::from_secs(10), || {
        let settled = count(
            "SELECT count(*) FROM idempotency_keys WHERE state = 'completed' OR locked_at = 0",
        );
        (settled == HELD + QUEUED).then_some(())
    });
    assert_eq!(gate.calls(), HELD, "the queued operations never called");
    assert_eq!(
        count("SELECT count(*) FROM idempotency_keys WHERE state = 'completed'"),
        HELD
    );
    assert_eq!(client.all_charges().len(), HELD);

    // Their keys were unlocked: each retry charges at once.
    for (i, location) in locations.iter().enumerate() {
        if client.get(location).json()["status"] == "completed" {
            continue;
        }
        let r = client.charge(&format!("queued-{i}"), &charge_body(5));
        assert_eq!(
            r.status,
            201,
            "queued-{i}: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
    assert_eq!(gate.calls(), HELD + QUEUED);
    assert_eq!(client.all_charges().len(), HELD + QUEUED);
    support::assert_verified(server.db_path());
}
