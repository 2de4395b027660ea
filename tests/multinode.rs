//! Several `idem serve` nodes on one PostgreSQL database (issue 13): real
//! child processes sharing one database and one acquirer simulator file.
//! One key sent by 32 threads across three nodes moves money once; a key in
//! flight on one node is 409 on another and replayed there afterwards; an
//! owner SIGKILLed on one node is taken over on another and fenced; a
//! consumer created while the nodes run authenticates on all of them; and
//! the background work every node runs (webhook delivery, hold expiry) is
//! never done twice.
//!
//! Each test needs PostgreSQL (`IDEM_TEST_POSTGRES`): on SQLite two servers
//! cannot share a database, so without it each one says so and passes.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use idem::acquirer::{Call, CallKind, Simulator};
use serde_json::{json, Value};
use support::{charge_body, ChildServer, Client, Resp, TempDir};

/// True, after saying so, when this run is not on PostgreSQL: the test has
/// no shared database to run its nodes on.
fn without_postgres() -> bool {
    if !support::on_postgres() {
        eprintln!("skipped: needs IDEM_TEST_POSTGRES");
    }
    !support::on_postgres()
}

/// Starts one node per entry of `args` on `db`, one after the other (the
/// first creates the schema and the `default` consumer); returns them with
/// that consumer's key.
fn start_nodes(db: &Path, args: &[&[&str]]) -> (Vec<ChildServer>, String) {
    let nodes: Vec<ChildServer> = args
        .iter()
        .map(|a| ChildServer::start(db, a, &[]))
        .collect();
    let key = nodes[0]
        .initial_key
        .clone()
        .expect("the first node creates the default consumer");
    assert!(
        nodes[1..].iter().all(|n| n.initial_key.is_none()),
        "the other nodes found the consumer the first created"
    );
    (nodes, key)
}

fn clients(nodes: &[ChildServer], key: &str) -> Vec<Client> {
    nodes.iter().map(|n| Client::new(n.addr, key)).collect()
}

/// Every call the shared acquirer simulator of `db` journaled.
fn journal(db: &Path) -> Vec<Call> {
    Simulator::journal_of_file(&support::acquirer_store(db).expect("a PostgreSQL database"))
        .expect("read the acquirer simulator's journal")
}

fn text(r: &Resp) -> String {
    String::from_utf8_lossy(&r.body).into_owned()
}

fn count(db: &Path, sql: &str) -> i64 {
    support::inspect(db, |c| c.query_value(sql, &[]))
}

/// `threads` threads released together, each sending `per_thread` charges
/// of `body` (keys `{tag}-{thread}-{n}`), the n-th of thread t to node
/// (t + n) % nodes, each until its final answer; every final answer.
fn charges_from_threads(
    clients: &[Client],
    threads: usize,
    per_thread: usize,
    tag: &str,
    body: &Value,
) -> Vec<(Resp, Retried)> {
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (clients, barrier) = (clients.to_vec(), Arc::clone(&barrier));
            let (tag, body) = (tag.to_string(), body.clone());
            std::thread::spawn(move || {
                barrier.wait();
                (0..per_thread)
                    .map(|n| {
                        let client = &clients[(t + n) % clients.len()];
                        charge_until_final(client, &format!("{tag}-{t}-{n}"), &body)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect()
}

/// The answers a client that follows the contract retried before its
/// final one.
#[derive(Debug, Default, Clone, Copy)]
struct Retried {
    /// 409 `idempotency-key-in-use`: the key is in flight elsewhere.
    in_use: usize,
    /// 503 `temporarily-unavailable`: a transient failure (on PostgreSQL,
    /// a write that lost its serialization race too many times in a row).
    unavailable: usize,
}

/// Sends `body` to `/v1/charges` with `key` until a final answer, as the
/// contract asks of a client: the same request again after a 409
/// `idempotency-key-in-use` or a 503, once `Retry-After` has passed.
fn charge_until_final(client: &Client, key: &str, body: &Value) -> (Resp, Retried) {
    let mut retried = Retried::default();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = client.charge(key, body);
        match r.status {
            409 => {
                assert_eq!(r.slug(), "idempotency-key-in-use");
                retried.in_use += 1;
            }
            503 => {
                assert_eq!(r.slug(), "temporarily-unavailable");
                retried.unavailable += 1;
            }
            _ => return (r, retried),
        }
        assert!(
            Instant::now() < deadline,
            "{key}: no final answer after a minute ({retried:?}): {}",
            text(&r)
        );
        let wait = r
            .header("retry-after")
            .and_then(|s| s.parse::<u64>().ok())
            .map(Duration::from_secs)
            .unwrap_or(Duration::from_millis(100));
        std::thread::sleep(wait);
    }
}

/// A counter from a node's `/metrics`.
fn metric(client: &Client, name: &str) -> u64 {
    let text = String::from_utf8(client.get("/metrics").body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name}"))
}

/// Asserts that every node is still running (none died along the way, so
/// all of them took part).
fn all_alive(nodes: &mut [ChildServer]) {
    for (i, n) in nodes.iter_mut().enumerate() {
        assert!(
            n.child.try_wait().expect("try_wait").is_none(),
            "node {i} exited: {:?}",
            n.stderr_lines()
        );
    }
}

/// 32 threads released together send one charge (one key, one body) spread
/// over three nodes, each retrying on 409 as `Retry-After` asks: every one
/// ends with the same 201, byte for byte; one charge, one authorization,
/// balances moved once; and nodes other than the winner's answered 409, so
/// the race crossed nodes.
#[test]
fn one_key_from_32_threads_on_three_nodes_moves_money_once() {
    if without_postgres() {
        return;
    }
    let dir = TempDir::new("mn-race");
    let db = dir.db();
    let latency: &[&str] = &["--acquirer-latency", "300ms"];
    let (nodes, key) = start_nodes(&db, &[latency, latency, latency]);
    let clients = clients(&nodes, &key);
    clients[0].card_and_shop();

    const THREADS: usize = 32;
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let node = i % 3;
            let client = clients[node].clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let (r, retried) = charge_until_final(&client, "one-key", &charge_body(4200));
                (node, retried, r)
            })
        })
        .collect();
    let answers: Vec<(usize, Retried, Resp)> =
        handles.into_iter().map(|h| h.join().unwrap()).collect();

    for (node, _, r) in &answers {
        assert_eq!(r.status, 201, "node {node}: {}", text(r));
        assert_eq!(r.body, answers[0].2.body, "one answer, byte for byte");
    }
    let fresh: Vec<&(usize, Retried, Resp)> =
        answers.iter().filter(|(_, _, r)| !r.replayed()).collect();
    assert_eq!(fresh.len(), 1, "exactly one request ran the charge");
    let owner = fresh[0].0;
    let conflicts_by_node: Vec<usize> = (0..3)
        .map(|n| {
            answers
                .iter()
                .filter(|(node, _, _)| *node == n)
                .map(|(_, retried, _)| retried.in_use)
                .sum()
        })
        .collect();
    let unavailable: usize = answers.iter().map(|(_, r, _)| r.unavailable).sum();
    eprintln!("owner: node {owner}; 409s by node: {conflicts_by_node:?}; 503s: {unavailable}");
    assert!(
        (0..3).any(|n| n != owner && conflicts_by_node[n] > 0),
        "a node other than the owner's ({owner}) answered 409: {conflicts_by_node:?}"
    );

    for client in &clients {
        assert_eq!(client.all_charges().len(), 1, "every node sees one charge");
    }
    assert_eq!(clients[1].balance("shop"), 4200);
    assert_eq!(clients[2].balance("card"), -4200);
    assert_eq!(count(&db, "SELECT count(*) FROM charges"), 1);
    assert_authorizations_and_verified(&db, 1);
}

/// A key reserved on node A (its acquirer call slow) is 409 on node B while
/// A works on it; afterwards B replays A's answer byte for byte.
#[test]
fn a_key_in_flight_on_one_node_is_409_on_another_then_replayed_there() {
    if without_postgres() {
        return;
    }
    let dir = TempDir::new("mn-inflight");
    let db = dir.db();
    let (nodes, key) = start_nodes(
        &db,
        &[
            &["--acquirer-latency", "3s"],
            &["--acquirer-latency", "0ms"],
        ],
    );
    let clients = clients(&nodes, &key);
    clients[0].card_and_shop();

    let a = clients[0].clone();
    let on_a = std::thread::spawn(move || a.charge("shared-key", &charge_body(700)));
    support::wait_for_key(&db, "shared-key");
    let on_b = clients[1].charge("shared-key", &charge_body(700));
    assert_eq!(on_b.status, 409, "{}", text(&on_b));
    assert_eq!(on_b.slug(), "idempotency-key-in-use");
    assert!(on_b.header("retry-after").is_some());
    assert!(
        !on_a.is_finished(),
        "A's request was still in flight when B answered 409"
    );

    let first = on_a.join().unwrap();
    assert_eq!(first.status, 201, "{}", text(&first));
    assert!(!first.replayed());
    let again = clients[1].charge("shared-key", &charge_body(700));
    assert_eq!(again.status, 201, "{}", text(&again));
    assert!(again.replayed(), "B replays A's stored answer");
    assert_eq!(again.body, first.body, "byte for byte");
    assert_eq!(clients[1].all_charges().len(), 1);
    assert_eq!(clients[1].balance("shop"), 700);
    support::assert_verified(&db);
}

/// Node A is SIGKILLed with a charge in flight; a retry on node B is 409
/// until B's `--inflight-timeout`, then B takes the key over and charges
/// once. The takeover bumped the key's generation, so A's ownership is
/// fenced off.
#[test]
fn an_owner_killed_on_one_node_is_taken_over_on_another_and_fenced() {
    if without_postgres() {
        return;
    }
    // Long enough for the kill and the early retry to fit inside it on a
    // loaded 2-core CI machine (as in tests/crash.rs).
    const TIMEOUT: Duration = Duration::from_secs(3);
    let dir = TempDir::new("mn-takeover");
    let db = dir.db();
    // A's authorization (if the kill lets it reach the simulator) is ready
    // before B's timeout: B's takeover then finds it instead of waiting.
    let (mut nodes, key) = start_nodes(
        &db,
        &[
            &["--acquirer-latency", "3s", "--reaper-interval", "1h"],
            &[
                "--inflight-timeout",
                "3s",
                "--acquirer-latency",
                "0ms",
                // The retry takes over, not B's reaper.
                "--reaper-interval",
                "1h",
            ],
        ],
    );
    let mut clients = clients(&nodes, &key);
    clients[0].card_and_shop();

    let a = clients[0].clone();
    let sent = Instant::now();
    let lost = std::thread::spawn(move || {
        a.try_request(
            "POST",
            "/v1/charges",
            &[("Idempotency-Key", "killed")],
            &charge_body(900).to_string(),
        )
    });
    support::wait_for_key(&db, "killed");
    // The key was locked no earlier than `sent` and no later than now.
    let locked_by = Instant::now();
    nodes.remove(0).kill();
    assert!(
        lost.join().unwrap().is_err(),
        "no answer from a killed node"
    );
    let b = clients.remove(1);

    let early = b.charge("killed", &charge_body(900));
    assert!(
        sent.elapsed() < TIMEOUT,
        "the early retry came too late for this test"
    );
    assert_eq!(early.status, 409, "{}", text(&early));
    assert_eq!(early.slug(), "idempotency-key-in-use");

    std::thread::sleep((TIMEOUT + Duration::from_millis(300)).saturating_sub(locked_by.elapsed()));
    let taken_over = b.charge("killed", &charge_body(900));
    assert_eq!(taken_over.status, 201, "{}", text(&taken_over));
    assert!(!taken_over.replayed(), "B ran the operation");
    let late = b.charge("killed", &charge_body(900));
    assert!(late.replayed());
    assert_eq!(late.body, taken_over.body);

    let generation: i64 = support::inspect(&db, |c| {
        c.query_value(
            "SELECT generation FROM idempotency_keys WHERE key = ?1",
            &[&"killed" as &dyn idem::store::Arg],
        )
    });
    assert_eq!(generation, 2, "the takeover fenced A's generation 1 off");
    assert_eq!(b.all_charges().len(), 1);
    assert_eq!(b.balance("shop"), 900);
    assert_eq!(b.balance("card"), -900);
    assert_authorizations_and_verified(&db, 1);
}

/// Orphans nobody retries: node A is SIGKILLed with charges in flight,
/// and the reapers of nodes B and C (both passing every 100 ms) find them
/// all once they are past the in-flight timeout. Each is taken over once
/// (generation 2, the nodes' takeover counts add up), one charge each.
#[test]
fn orphans_of_a_killed_node_are_completed_once_by_the_other_nodes_reapers() {
    if without_postgres() {
        return;
    }
    const ORPHANS: usize = 6;
    let dir = TempDir::new("mn-orphans");
    let db = dir.db();
    let reaper: &[&str] = &["--inflight-timeout", "2s", "--reaper-interval", "100ms"];
    let (mut nodes, key) = start_nodes(
        &db,
        &[
            &["--acquirer-latency", "2s", "--reaper-interval", "1h"],
            reaper,
            reaper,
        ],
    );
    let clients = clients(&nodes, &key);
    clients[0].card_and_shop();

    let pending: Vec<_> = (0..ORPHANS)
        .map(|i| {
            let a = clients[0].clone();
            std::thread::spawn(move || {
                a.try_request(
                    "POST",
                    "/v1/charges",
                    &[("Idempotency-Key", &format!("orphan-{i}"))],
                    &charge_body(100).to_string(),
                )
            })
        })
        .collect();
    for i in 0..ORPHANS {
        support::wait_for_key(&db, &format!("orphan-{i}"));
    }
    nodes.remove(0).kill();
    for p in pending {
        assert!(p.join().unwrap().is_err(), "no answer from a killed node");
    }

    support::eventually(Duration::from_secs(60), || {
        (count(
            &db,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'completed' \
             AND key LIKE 'orphan-%'",
        ) == ORPHANS as i64)
            .then_some(())
    });
    // More passes on both nodes: none may take a completed key over.
    std::thread::sleep(Duration::from_millis(500));
    let generations: Vec<(String, i64)> = support::inspect(&db, |c| {
        c.query_all(
            "SELECT key, generation FROM idempotency_keys WHERE key LIKE 'orphan-%' ORDER BY key",
            &[],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
    });
    assert!(
        generations.iter().all(|(_, g)| *g == 2),
        "each orphan taken over once: {generations:?}"
    );
    let taken_over: Vec<u64> = clients[1..]
        .iter()
        .map(|c| metric(c, "idem_orphans_taken_over_total"))
        .collect();
    eprintln!("orphans taken over by node: {taken_over:?}");
    assert_eq!(taken_over.iter().sum::<u64>(), ORPHANS as u64);

    let late = clients[2].charge("orphan-0", &charge_body(100));
    assert_eq!(late.status, 201, "{}", text(&late));
    assert!(late.replayed(), "a reaper completed the key");
    assert_eq!(clients[1].all_charges().len(), ORPHANS);
    assert_eq!(clients[2].balance("shop"), 100 * ORPHANS as i64);
    assert_authorizations_and_verified(&db, ORPHANS);
}

/// A consumer created with `idem consumers create` while three nodes run
/// is unknown to none of them: a made-up key is 401 on all three before,
/// the new key works on all three after.
#[test]
fn a_consumer_created_while_nodes_run_authenticates_on_all() {
    if without_postgres() {
        return;
    }
    let dir = TempDir::new("mn-consumers");
    let db = dir.db();
    let (mut nodes, key) = start_nodes(&db, &[&[], &[], &[]]);
    let made_up = format!("sk_test_{}", uuid::Uuid::new_v4().simple());
    for (i, n) in nodes.iter().enumerate() {
        let r = Client::new(n.addr, &made_up).post(
            "/v1/accounts",
            None,
            &json!({"id": "nope", "currency": "BRL"}),
        );
        assert_eq!(r.status, 401, "node {i}: {}", text(&r));
        assert_eq!(r.slug(), "unauthorized");
    }

    let new_key = support::create_consumer_cli(&db, "back-office");
    assert!(new_key.starts_with("sk_"), "{new_key}");
    let news = clients(&nodes, &new_key);
    for (i, c) in news.iter().enumerate() {
        c.account(&format!("till-{i}"), false);
    }
    // Each node reads what the others wrote for this consumer, and only
    // this consumer sees it.
    let olds = clients(&nodes, &key);
    for i in 0..3 {
        let account = format!("till-{}", (i + 1) % 3);
        let r = news[i].get(&format!("/v1/accounts/{account}"));
        assert_eq!(r.status, 200, "node {i}: {}", text(&r));
        let r = olds[i].get(&format!("/v1/accounts/{account}"));
        assert_eq!(r.status, 404, "node {i}: {}", text(&r));
    }
    // The made-up key is still nobody's.
    for (i, n) in nodes.iter().enumerate() {
        let r = Client::new(n.addr, &made_up).get("/v1/accounts/till-0");
        assert_eq!(r.status, 401, "node {i}: {}", text(&r));
    }
    all_alive(&mut nodes);
    support::assert_verified(&db);
}

/// One request the receiver got: its `webhook-id`, when it arrived and
/// when the receiver answered.
#[derive(Clone, Debug)]
struct Arrival {
    id: String,
    at: Instant,
    answered: Instant,
}

/// A local HTTP receiver that records each request's `webhook-id` and
/// answers 200 after a short wait (so that a delivery is on the wire a
/// while: two nodes sending it at once would overlap).
struct Receiver {
    addr: SocketAddr,
    got: Arc<Mutex<Vec<Arrival>>>,
    stop: Arc<AtomicBool>,
}

impl Receiver {
    fn start(answer_after: Duration) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind receiver");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (g, s) = (Arc::clone(&got), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let g = Arc::clone(&g);
                        std::thread::spawn(move || serve_one(stream, &g, answer_after));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Receiver { addr, got, stop }
    }

    fn got(&self) -> Vec<Arrival> {
        self.got.lock().unwrap().clone()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn serve_one(mut stream: TcpStream, got: &Mutex<Vec<Arrival>>, answer_after: Duration) {
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    };
    let at = Instant::now();
    let head = String::from_utf8_lossy(&raw[..head_end]).to_string();
    let header = |name: &str| {
        head.split("\r\n")
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .find(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
    };
    let len: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body_len = raw.len() - (head_end + 4);
    while body_len < len {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => body_len += n,
        }
    }
    let id = header("webhook-id").unwrap_or_default();
    std::thread::sleep(answer_after);
    got.lock().unwrap().push(Arrival {
        id,
        at,
        answered: Instant::now(),
    });
    let _ =
        stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
}

/// Three nodes deliver webhooks from one database: ~60 charges made across
/// them, one endpoint, a receiver that takes 50 ms per request and never
/// fails. Every event's delivery arrives exactly once (a repeat, with no
/// failure to retry, is two nodes sending it), and every node sent some.
#[test]
fn webhook_delivery_runs_on_every_node_and_sends_each_delivery_once() {
    if without_postgres() {
        return;
    }
    let receiver = Receiver::start(Duration::from_millis(50));
    let dir = TempDir::new("mn-webhooks");
    let db = dir.db();
    let (mut nodes, key) = start_nodes(&db, &[&[], &[], &[]]);
    let clients = clients(&nodes, &key);
    clients[0].card_and_shop();
    let r = clients[0].post(
        "/v1/webhook_endpoints",
        None,
        &json!({"url": format!("http://{}/hook", receiver.addr),
                "enabled_events": ["charge.succeeded"]}),
    );
    assert_eq!(r.status, 201, "{}", text(&r));

    const THREADS: usize = 6;
    const PER_THREAD: usize = 10;
    let answers = charges_from_threads(&clients, THREADS, PER_THREAD, "wh", &charge_body(10));
    let mut unavailable = 0;
    for (r, retried) in &answers {
        assert_eq!(r.status, 201, "{}", text(r));
        unavailable += retried.unavailable;
    }
    eprintln!("503s retried: {unavailable}");
    let total = (THREADS * PER_THREAD) as i64;
    assert_eq!(clients[1].all_charges().len() as i64, total);
    assert_eq!(
        clients[2].balance("shop"),
        10 * total,
        "each charge moved money once"
    );
    assert_eq!(count(&db, "SELECT count(*) FROM deliveries"), total);
    support::eventually(Duration::from_secs(60), || {
        (count(
            &db,
            "SELECT count(*) FROM deliveries WHERE status = 'pending'",
        ) == 0)
            .then_some(())
    });
    // A second send by another node would be on the wire after the first's
    // record: give it time to arrive.
    std::thread::sleep(Duration::from_secs(1));

    let events: BTreeSet<String> = support::inspect(&db, |c| {
        c.query_all(
            "SELECT ev.public_id FROM deliveries d JOIN events ev ON ev.id = d.event_id \
             WHERE d.status = 'succeeded' AND d.attempts = 1",
            &[],
            |r| r.get::<String>(0),
        )
    })
    .into_iter()
    .collect();
    assert_eq!(
        events.len() as i64,
        total,
        "each succeeded at its first attempt"
    );

    let got = receiver.got();
    let mut by_id: BTreeMap<&str, Vec<&Arrival>> = BTreeMap::new();
    for a in &got {
        by_id.entry(a.id.as_str()).or_default().push(a);
    }
    let repeated: Vec<String> = by_id
        .iter()
        .filter(|(_, arrivals)| arrivals.len() > 1)
        .map(|(id, arrivals)| {
            let overlapping = arrivals
                .windows(2)
                .any(|w| w[1].at < w[0].answered && w[0].at < w[1].answered);
            format!("{id} x{} (at once: {overlapping})", arrivals.len())
        })
        .collect();
    assert!(repeated.is_empty(), "sent more than once: {repeated:?}");
    assert_eq!(
        by_id.keys().map(|s| s.to_string()).collect::<BTreeSet<_>>(),
        events,
        "the receiver got every event, and nothing else"
    );

    // Which node sent each delivery: its lease stays on the row.
    let by_node: Vec<(String, i64)> = support::inspect(&db, |c| {
        c.query_all(
            "SELECT leased_by, count(*) FROM deliveries GROUP BY leased_by ORDER BY leased_by",
            &[],
            |r| Ok((r.get::<Option<String>>(0)?.unwrap_or_default(), r.get(1)?)),
        )
    });
    eprintln!("deliveries by node: {by_node:?}");
    assert_eq!(
        by_node.len(),
        3,
        "every node's dispatcher sent some: {by_node:?}"
    );
    all_alive(&mut nodes);
    support::assert_verified(&db);
}

/// Three nodes with a 1 s `--authorization-ttl` and a reaper every 100 ms:
/// 30 holds made across them all expire, each voided at the acquirer once
/// (the simulator journals repeated calls too) and released once.
#[test]
fn hold_expiry_runs_on_every_node_and_voids_each_hold_once() {
    if without_postgres() {
        return;
    }
    let dir = TempDir::new("mn-expiry");
    let db = dir.db();
    let args: &[&str] = &["--authorization-ttl", "1s", "--reaper-interval", "100ms"];
    let (mut nodes, key) = start_nodes(&db, &[args, args, args]);
    let clients = clients(&nodes, &key);
    clients[0].card_and_shop();

    const THREADS: usize = 3;
    const PER_THREAD: usize = 10;
    let body = json!({"amount": 100, "currency": "BRL", "source": "card",
                      "destination": "shop", "capture": false});
    let holds: BTreeSet<String> =
        charges_from_threads(&clients, THREADS, PER_THREAD, "hold", &body)
            .iter()
            .map(|(r, _)| {
                assert_eq!(r.status, 201, "{}", text(r));
                assert_eq!(r.json()["status"], json!("requires_capture"));
                r.json()["id"].as_str().unwrap().to_string()
            })
            .collect();
    assert_eq!(holds.len(), THREADS * PER_THREAD);

    support::eventually(Duration::from_secs(60), || {
        (count(
            &db,
            "SELECT count(*) FROM charges WHERE status = 'canceled' \
             AND cancellation_reason = 'expired'",
        ) == holds.len() as i64)
            .then_some(())
    });
    // More passes on every node: none may void an expired hold again.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        count(&db, "SELECT count(*) FROM charges"),
        holds.len() as i64
    );

    let mut voids: BTreeMap<String, usize> = BTreeMap::new();
    for call in journal(&db) {
        if call.kind == CallKind::Void {
            *voids.entry(call.key).or_default() += 1;
        }
    }
    let expected: BTreeMap<String, usize> =
        holds.iter().map(|id| (format!("expire:{id}"), 1)).collect();
    assert_eq!(
        voids, expected,
        "each hold voided once, under its expiry key"
    );

    let released: Vec<u64> = clients
        .iter()
        .map(|c| metric(c, "idem_authorizations_expired_total"))
        .collect();
    eprintln!("holds released by node: {released:?}");
    assert_eq!(
        released.iter().sum::<u64>(),
        holds.len() as u64,
        "each hold released by one node: {released:?}"
    );
    for (i, c) in clients.iter().enumerate() {
        assert_eq!(c.balance("card"), 0, "node {i}");
        assert_eq!(c.balance("shop"), 0, "node {i}");
    }
    all_alive(&mut nodes);
    support::assert_verified(&db);
}

/// The acquirer made exactly `n` authorizations (one per charge: none twice
/// across nodes), and `idem verify` passes.
fn assert_authorizations_and_verified(db: &Path, n: usize) {
    let made: Vec<Call> = journal(db)
        .into_iter()
        .filter(|c| c.kind == CallKind::Authorize && c.created)
        .collect();
    assert_eq!(made.len(), n, "one authorization per charge: {made:?}");
    support::assert_verified(db);
}

/// An idle node keeps its background work to a trickle of transactions
/// (the dispatcher's 50 ms poll, the reaper), not a loop: its own delivery
/// claims once woke its dispatcher to claim again, about 2,500 commits a
/// second on an empty database.
#[test]
fn an_idle_node_commits_a_trickle_not_a_loop() {
    if without_postgres() {
        return;
    }
    let dir = TempDir::new("mn-idle");
    let db = dir.db();
    let (_nodes, _key) = start_nodes(&db, &[&[]]);
    let commits = || {
        count(
            &db,
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
        )
    };
    std::thread::sleep(Duration::from_secs(1));
    let before = commits();
    std::thread::sleep(Duration::from_secs(5));
    let after = commits();
    // About 20 polls a second and the gauge: ~200 in 5 s. The loop made
    // ~12,000.
    assert!(
        after - before < 1_000,
        "{} commits in 5 s on an idle node",
        after - before
    );
}
