//! Case 4 of the battery — a crash in the middle — with a real `idem serve`
//! child process that aborts at a fault point or is killed with SIGKILL, then
//! restarted on the same database file. And fencing: an owner stuck past the
//! in-flight timeout is taken over and cannot apply its effect twice.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::acquirer::{Acquirer, AuthorizeOutcome, Call, Simulator, Unavailable};
use rusqlite::Connection;
use support::{charge_body, ChildServer, Client, TempDir};

// Long enough for a restart on a loaded 2-core CI machine to fit inside it.
const INFLIGHT: &str = "3s";
const INFLIGHT_TIMEOUT: Duration = Duration::from_secs(3);

/// Every call the simulator of `db` journaled.
fn journal(db: &Path) -> Vec<Call> {
    support::journal(db).expect("read the acquirer simulator's journal")
}

/// The calls that made a new authorization.
fn authorizations_made(calls: &[Call]) -> Vec<&Call> {
    calls.iter().filter(|c| c.created).collect()
}

/// (charges, authorization ids of charges) straight from the database.
fn charges_in_db(db: &Path) -> Vec<(String, String)> {
    let conn = Connection::open(db).unwrap();
    let mut stmt = conn
        .prepare("SELECT public_id, authorization_id FROM charges ORDER BY id")
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// Starts a server that aborts at `fault`, creates accounts, sends one charge
/// (which never gets an answer) and returns the key, the client and the
/// instant the charge was sent.
fn crash_during_charge(db: &Path, fault: &str) -> Client {
    let server = ChildServer::start(
        db,
        &["--inflight-timeout", INFLIGHT],
        &[("IDEM_FAULT", fault)],
    );
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let lost = client.try_request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "crash-key")],
        &charge_body(4200).to_string(),
    );
    assert!(lost.is_err(), "the server died before answering: {lost:?}");
    let status = server.wait_exit(Duration::from_secs(10));
    assert!(!status.success(), "aborted at {fault}");
    client
}

fn restart(db: &Path, client: &mut Client, args: &[&str]) -> ChildServer {
    let mut all = vec!["--inflight-timeout", INFLIGHT];
    all.extend_from_slice(args);
    let server = ChildServer::start(db, &all, &[]);
    assert!(
        server.initial_key.is_none(),
        "the default key is printed only once"
    );
    client.addr = server.addr;
    server
}

/// Before the in-flight timeout a retry gets 409; after it, the retry takes
/// the orphan over and exactly one charge exists; a late retry replays it.
/// `calls`: how many acquirer calls the crash and the takeover make in all.
fn retries_recover_exactly_once(db: &Path, fault: &str, calls: usize) {
    let mut client = crash_during_charge(db, fault);
    let crashed_at = Instant::now();
    let journal = after_crash_one_charge(db, &mut client, "crash-key", 4200, crashed_at, &[]);
    assert_eq!(journal.len(), calls, "{fault}: {journal:?}");
    assert!(
        journal.iter().all(|c| c.key == journal[0].key),
        "one operation id throughout: {journal:?}"
    );
}

/// After a crash that left `key` reserved (at `crashed_at`): restart with
/// `args`; a retry before the in-flight timeout gets 409, one after it takes
/// the orphan over and charges once, a late retry replays it, the acquirer
/// authorised once, and `idem verify` passes. Returns the acquirer's journal.
fn after_crash_one_charge(
    db: &Path,
    client: &mut Client,
    key: &str,
    amount: i64,
    crashed_at: Instant,
    args: &[&str],
) -> Vec<Call> {
    let _server = restart(db, client, args);
    let early = client.charge(key, &charge_body(amount));
    assert!(
        crashed_at.elapsed() < INFLIGHT_TIMEOUT,
        "restart was too slow for this test"
    );
    assert_eq!(
        early.status, 409,
        "{key}: the orphan is not yet past the in-flight timeout"
    );
    assert_eq!(early.slug(), "idempotency-key-in-use");

    std::thread::sleep(
        INFLIGHT_TIMEOUT.saturating_sub(crashed_at.elapsed()) + Duration::from_millis(300),
    );
    let taken_over = client.charge(key, &charge_body(amount));
    assert_eq!(
        taken_over.status,
        201,
        "{key}: {}",
        String::from_utf8_lossy(&taken_over.body)
    );
    assert!(!taken_over.replayed());
    let late = client.charge(key, &charge_body(amount));
    assert!(late.replayed());
    assert_eq!(late.body, taken_over.body);

    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(client.balance("shop"), amount);
    let charges = charges_in_db(db);
    let journal = journal(db);
    let made = authorizations_made(&journal);
    assert_eq!(charges.len(), 1);
    assert_eq!(
        made.len(),
        1,
        "{key}: the acquirer authorised exactly once: {journal:?}"
    );
    assert_eq!(
        made[0].authorization, charges[0].1,
        "the charge carries that authorization"
    );
    assert!(
        journal.iter().all(|c| c.authorization == charges[0].1),
        "every call answered that authorization: {journal:?}"
    );
    support::assert_verified(db);
    journal
}

#[test]
fn crash_after_reserve() {
    let dir = TempDir::new("after-reserve");
    retries_recover_exactly_once(&dir.db(), "after_reserve", 1);
}

#[test]
fn crash_after_acquirer_before_recovery_point() {
    let dir = TempDir::new("after-acquirer");
    // The takeover asks again and is given the first call's authorization.
    retries_recover_exactly_once(&dir.db(), "after_acquirer", 2);
}

/// An upgrade keeps an in-progress key's authorization: a server crashed
/// after the acquirer answered, leaving the authorization in a v1 text
/// journal (`<db>.acquirer`); the restarted server imports it, and the
/// takeover is given that authorization, not a second one.
#[test]
fn an_upgrade_imports_the_v1_journal_of_an_in_progress_key() {
    let dir = TempDir::new("v1-import");
    let db = dir.db();
    let mut client = crash_during_charge(&db, "after_acquirer");
    let crashed_at = Instant::now();
    // What a v1 build would have left: its text journal, no simulator file.
    let made = support::authorizations(&db).unwrap();
    assert_eq!(made.len(), 1);
    let a = &made[0];
    let line = format!("{} {} {} {}\n", a.key, a.id, a.amount, a.currency);
    std::fs::write(Simulator::v1_journal_path(&db), line).unwrap();
    let store = Simulator::store_path(&db).into_os_string();
    for suffix in ["", "-wal", "-shm"] {
        let mut file = store.clone();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
    let journal = after_crash_one_charge(&db, &mut client, "crash-key", 4200, crashed_at, &[]);
    assert_eq!(journal.len(), 2, "imported, then asked again: {journal:?}");
    assert_eq!(journal[1].authorization, a.id);
    assert!(!Simulator::v1_journal_path(&db).exists(), "imported once");
}

/// A charge's authorization has no commit of its own: the ledger phase
/// records it with the charge, in one transaction. So a sale passes no
/// recovery point at all (`after_recovery_point` never fires for it), and
/// its key goes from `reserved` straight to `completed` with the charge
/// naming the authorization; a crash before that commit is
/// `after_acquirer`'s case (the same authorization again, above).
#[test]
fn a_sale_records_its_authorization_with_the_charge_not_before() {
    let dir = TempDir::new("after-recovery");
    let db = dir.db();
    let server = ChildServer::start(
        &db,
        &["--inflight-timeout", INFLIGHT],
        &[("IDEM_FAULT", "charge:after_recovery_point")],
    );
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let sale = client.charge("no-recovery-point", &charge_body(4200));
    assert_eq!(sale.status, 201, "no fault fired: the server is alive");
    let hold = client.charge(
        "hold-too",
        &serde_json::json!({"amount": 100, "currency": "BRL", "source": "card",
                            "destination": "shop", "capture": false}),
    );
    assert_eq!(hold.status, 201);
    let conn = Connection::open(&db).unwrap();
    let rows: Vec<(String, String, Option<String>)> = conn
        .prepare("SELECT state, recovery_point, authorization FROM idempotency_keys ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    // Completed from `reserved`: the authorization went to the charge row.
    for row in &rows {
        assert_eq!(
            (row.0.as_str(), row.1.as_str(), &row.2),
            ("completed", "reserved", &None)
        );
    }
    let made = journal(&db);
    assert_eq!(authorizations_made(&made).len(), 2);
    let in_db: Vec<String> = charges_in_db(&db).into_iter().map(|(_, a)| a).collect();
    for call in authorizations_made(&made) {
        assert!(in_db.contains(&call.authorization), "{call:?} in {in_db:?}");
    }
    drop(server);
    support::assert_verified(&db);
}

/// Committed but never answered: the retry replays the committed charge.
#[test]
fn crash_after_commit_before_response() {
    let dir = TempDir::new("after-commit");
    let db = dir.db();
    let mut client = crash_during_charge(&db, "after_commit");
    let _server = restart(&db, &mut client, &[]);
    let retry = client.charge("crash-key", &charge_body(4200));
    assert_eq!(retry.status, 201);
    assert!(
        retry.replayed(),
        "the effect was committed before the crash"
    );
    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(client.balance("shop"), 4200);
    assert_eq!(journal(&db).len(), 1, "the replay called nobody");
    support::assert_verified(&db);
}

/// A real SIGKILL (not an abort at a fault point) while the acquirer call
/// is in flight: the reservation survives, retries get 409 until the
/// in-flight timeout, then one takeover charges once. (The kill may land
/// before or after the simulator journals the call: either way there is one
/// authorization; `crash_after_acquirer_before_recovery_point` is the test
/// that a journaled authorization is given again, never repeated.)
#[test]
fn sigkill_during_acquirer_call() {
    let dir = TempDir::new("sigkill");
    let db = dir.db();
    let server = ChildServer::start(
        &db,
        &["--inflight-timeout", INFLIGHT, "--acquirer-latency", "3s"],
        &[],
    );
    let mut client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let c = client.clone();
    let pending = std::thread::spawn(move || {
        c.try_request(
            "POST",
            "/v1/charges",
            &[("Idempotency-Key", "k9")],
            &charge_body(99).to_string(),
        )
    });
    support::wait_for_key(&db, "k9");
    server.kill();
    let killed_at = Instant::now();
    assert!(
        pending.join().unwrap().is_err(),
        "no answer from a killed server"
    );
    after_crash_one_charge(
        &db,
        &mut client,
        "k9",
        99,
        killed_at,
        &["--acquirer-latency", "0ms"],
    );
}

/// An orphan nobody retries is completed by the reaper; a late retry then
/// replays the reaper's answer.
#[test]
fn reaper_completes_an_orphan_nobody_retries() {
    let dir = TempDir::new("reaper");
    let db = dir.db();
    let mut client = crash_during_charge(&db, "after_reserve");
    let _server = restart(&db, &mut client, &["--reaper-interval", "200ms"]);
    let charges = support::eventually(Duration::from_secs(10), || {
        let charges = client.all_charges();
        (!charges.is_empty()).then_some(charges)
    });
    assert_eq!(charges.len(), 1);
    let late = client.charge("crash-key", &charge_body(4200));
    assert_eq!(late.status, 201);
    assert!(late.replayed(), "the reaper completed the key");
    assert_eq!(late.json()["id"], charges[0]["id"]);
    let metrics = String::from_utf8(
        support::send(client.addr, "GET", "/metrics", &[], b"")
            .unwrap()
            .body,
    )
    .unwrap();
    assert!(
        metrics.contains("idem_orphans_taken_over_total 1"),
        "{metrics}"
    );
    support::assert_verified(&db);
}

/// An acquirer whose first call blocks until released, ignoring its
/// deadline: the first owner is truly stuck inside it past the in-flight
/// timeout (what the deadline cannot prevent, fencing makes harmless).
struct StuckFirstCall {
    calls: std::sync::atomic::AtomicUsize,
    /// Told when the first call is inside the acquirer.
    entered: crossbeam_channel::Sender<()>,
    release: crossbeam_channel::Receiver<()>,
    inner: idem::acquirer::Simulator,
}

impl Acquirer for StuckFirstCall {
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        deadline: std::time::Instant,
    ) -> Result<AuthorizeOutcome, Unavailable> {
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            let _ = self.entered.send(());
            let _ = self.release.recv_timeout(Duration::from_secs(20));
        }
        self.inner
            .authorize(key, amount, currency, capture, deadline)
    }

    crate::settle_through_inner!();
}

/// Owner A sends `key` and stalls (it signals `stalled`); once its lock is
/// older than the 300 ms in-flight timeout, B sends the same request and
/// takes over, finishing with a fresh 201; then A is released, finds itself
/// fenced off, and answers B's stored bytes as a replay.
fn stuck_owner_loses_to_takeover(
    client: &Client,
    key: &'static str,
    amount: i64,
    stalled: &crossbeam_channel::Receiver<()>,
    release: &crossbeam_channel::Sender<()>,
) {
    let c = client.clone();
    let owner_a = std::thread::spawn(move || c.charge(key, &charge_body(amount)));
    stalled
        .recv_timeout(Duration::from_secs(20))
        .expect("A stalled where the test holds it");
    std::thread::sleep(Duration::from_millis(600));
    let b = client.charge(key, &charge_body(amount));
    assert_eq!(
        b.status,
        201,
        "B took the orphan over: {}",
        String::from_utf8_lossy(&b.body)
    );
    assert!(!b.replayed());
    release.send(()).unwrap();
    let a = owner_a.join().unwrap();
    assert_eq!(a.status, 201);
    assert!(a.replayed(), "A lost its key and answers like a duplicate");
    assert_eq!(a.body, b.body);
}

/// Fencing: owner A is stuck past the in-flight timeout; B takes the key
/// over and finishes; when A wakes up its commit is refused (stale fencing
/// token) and it answers like a later duplicate. One charge, one authorization.
#[test]
fn stuck_owner_is_fenced_off_after_takeover() {
    let (release_tx, release_rx) = crossbeam_channel::bounded(1);
    let dir = TempDir::new("fence");
    let (entered_tx, entered_rx) = crossbeam_channel::bounded(1);
    let acquirer = Arc::new(StuckFirstCall {
        calls: Default::default(),
        entered: entered_tx,
        release: release_rx,
        inner: idem::acquirer::Simulator::new(Duration::ZERO),
    });
    let (server, client) = support::server_with_acquirer(&dir, acquirer.clone(), |c| {
        c.inflight_timeout = Duration::from_millis(300);
    });

    // A's lock (taken at reservation) goes stale while it waits in the acquirer.
    stuck_owner_loses_to_takeover(&client, "fenced", 500, &entered_rx, &release_tx);
    assert_eq!(acquirer.calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(client.balance("shop"), 500);
    support::assert_verified(server.db_path());
}

/// Fencing at the ledger commit: owner A has its authorization and is stuck
/// just before its ledger phase past the in-flight timeout; B takes over,
/// asks the acquirer again under the same key (a charge's authorization is
/// recorded with its ledger phase, so B resumes from `reserved`: the same
/// authorization, not a second) and commits. When A wakes, its commit is
/// refused and it answers B's stored answer, byte for byte.
#[test]
fn owner_stuck_before_its_ledger_commit_is_fenced_off() {
    let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(1);
    let stalls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let dir = TempDir::new("fence-ledger");
    let hook_stalls = Arc::clone(&stalls);
    let (at_hook_tx, at_hook_rx) = crossbeam_channel::bounded(1);
    let acquirer = support::CountingAcquirer::new();
    let (server, client) = support::server_with_acquirer(&dir, acquirer.clone(), |c| {
        c.inflight_timeout = Duration::from_millis(300);
        c.hooks.before_ledger_phase = Some(Arc::new(move |_op: &str| {
            if hook_stalls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                let _ = at_hook_tx.send(());
                let _ = release_rx.recv_timeout(Duration::from_secs(20));
            }
        }));
    });

    // A's lock goes stale at its ledger phase.
    stuck_owner_loses_to_takeover(&client, "stuck", 800, &at_hook_rx, &release_tx);
    assert_eq!(
        acquirer.calls(),
        2,
        "B asked again under A's key (the simulator answers it once)"
    );
    assert_eq!(stalls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(client.balance("shop"), 800);
    support::assert_verified(server.db_path());
}
