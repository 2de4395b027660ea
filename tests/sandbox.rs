//! The sandbox (`--sandbox`, `Config::sandbox`): every `Idem-Simulate`
//! directive through HTTP against an embedded server, each followed by a
//! look at the ledger (balances, charges, the key row, the acquirer's
//! journal, `idem verify`) and by the retry that a client would send; the
//! header outside sandbox mode and malformed; scripted faults from Rust,
//! consumed by concurrent requests; crashes finished by a retry after the
//! in-flight timeout and, separately, by the reaper alone.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use idem::acquirer::{CallKind, Simulator};
use idem::sandbox::{Directive, Simulation};
use serde_json::{json, Value};
use support::{assert_verified, charge_body, eventually, Client, Resp};

const AMOUNT: i64 = 1_000;
/// The in-flight timeout of the crash tests.
const STALE: Duration = Duration::from_secs(2);

/// A sandbox server with `card` and `shop`.
fn sandbox(configure: impl FnOnce(&mut idem::Config)) -> (idem::Server, Client) {
    support::server(|c| {
        c.sandbox = true;
        configure(c);
    })
}

/// A sandbox server whose owners go stale after `STALE`; the reaper runs every
/// `reaper` (an hour: never, unless a test wants it).
fn crashable(reaper: Duration) -> (idem::Server, Client) {
    sandbox(|c| {
        c.inflight_timeout = STALE;
        c.reaper_interval = reaper;
    })
}

fn charge_with(client: &Client, key: &str, simulate: &str) -> std::io::Result<Resp> {
    client.try_request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", key), ("Idem-Simulate", simulate)],
        &charge_body(AMOUNT).to_string(),
    )
}

/// The key row of `key`: (state, recovery point, authorization, generation).
fn key_row(db: &Path, key: &str) -> (String, String, Option<String>, i64) {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    conn.query_row(
        "SELECT state, recovery_point, authorization, generation FROM idempotency_keys \
         WHERE key = ?1",
        [key],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    )
    .unwrap_or_else(|e| panic!("key row {key}: {e}"))
}

fn op_id(db: &Path, key: &str) -> String {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    conn.query_row(
        "SELECT op_id FROM idempotency_keys WHERE key = ?1",
        [key],
        |r| r.get(0),
    )
    .unwrap()
}

/// The simulator's calls of `kind` under the acquirer-side key `op`.
fn calls(db: &Path, kind: CallKind, op: &str) -> Vec<idem::acquirer::Call> {
    support::journal(db)
        .unwrap()
        .into_iter()
        .filter(|c| c.kind == kind && c.key == op)
        .collect()
}

/// Balances of card and shop after `n` charges of AMOUNT.
fn assert_charged(client: &Client, n: i64) {
    assert_eq!(client.balance("card"), -n * AMOUNT);
    assert_eq!(client.balance("shop"), n * AMOUNT);
    assert_eq!(client.all_charges().len() as i64, n);
}

/// A retry without the header answers `first` again, byte for byte, as a
/// replay.
fn assert_replays(client: &Client, key: &str, first: &Resp) {
    let again = client.charge(key, &charge_body(AMOUNT));
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body);
    assert!(again.replayed());
}

fn metric(server: &idem::Server, directive: &str) -> u64 {
    let text = support::send(server.addr(), "GET", "/metrics", &[], b"").unwrap();
    let line = format!("idem_simulated_faults_total{{directive=\"{directive}\"}} ");
    String::from_utf8(text.body)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(&line).map(|n| n.parse().unwrap()))
        .unwrap_or_else(|| panic!("no metric for {directive}"))
}

#[test]
fn healthz_says_sandbox_only_in_sandbox_mode() {
    let (server, _) = sandbox(|_| {});
    let health = support::send(server.addr(), "GET", "/healthz", &[], b"").unwrap();
    assert_eq!(health.body, br#"{"status":"ok","sandbox":true}"#);
    let (plain, _) = support::server(|_| {});
    let health = support::send(plain.addr(), "GET", "/healthz", &[], b"").unwrap();
    assert_eq!(health.body, br#"{"status":"ok"}"#);
}

#[test]
fn outside_sandbox_the_header_is_refused_and_nothing_is_stored() {
    let (server, client) = support::server(|_| {});
    for simulate in ["response=drop", "nonsense"] {
        let refused = charge_with(&client, "k-1", simulate).unwrap();
        assert_eq!(refused.status, 400);
        assert_eq!(refused.slug(), "simulation-disabled");
    }
    // On a GET too, and after the checks the contract orders first.
    let get = client.request(
        "GET",
        "/v1/charges",
        &[("Idem-Simulate", "response=drop")],
        "",
    );
    assert_eq!(get.slug(), "simulation-disabled");
    let no_key = client.request(
        "POST",
        "/v1/charges",
        &[("Idem-Simulate", "response=drop")],
        &charge_body(AMOUNT).to_string(),
    );
    assert_eq!(no_key.slug(), "idempotency-key-missing");
    // The key stayed free: the same key is a new charge.
    let created = client.charge("k-1", &charge_body(AMOUNT));
    assert_eq!(created.status, 201);
    assert!(!created.replayed());
    assert_charged(&client, 1);
    assert!(server
        .simulate(Simulation::new().fault(Directive::Response503))
        .is_err());
    assert_verified(server.db_path());
}

#[test]
fn bad_directives_are_refused_naming_them_and_store_nothing() {
    let (server, client) = sandbox(|_| {});
    let long = format!("response=503,{}", "x".repeat(300));
    #[rustfmt::skip]
    let cases: &[(&str, &str)] = &[
        ("", "empty directive"),
        ("crash", "unknown directive 'crash'"),
        ("crash=later", "unknown directive 'crash=later'"),
        ("Response=drop", "unknown directive 'Response=drop'"),
        ("response=drop,", "empty directive"),
        ("response=delay:5", "no unit"),
        ("response=delay:1.5s", "response=delay"),
        ("response=delay:61s", "longer than 60s"),
        ("acquirer-latency=2m", "longer than 60s"),
        ("acquirer=decline,acquirer=unavailable", "acquirer= given twice"),
        ("response=drop,response=503", "response= given twice"),
        ("crash=after-commit,response=drop", "cannot be combined with response="),
        ("crash=after-reserve,acquirer-latency=1s", "before the acquirer is called"),
        ("crash=after-acquirer,acquirer=unavailable", "acquirer=unavailable ends the attempt"),
        ("crash=after-acquirer,acquirer=decline", "use crash=after-commit"),
        (&long, "longer than 256 bytes"),
    ];
    for (simulate, named) in cases {
        let refused = charge_with(&client, "k-bad", simulate).unwrap();
        assert_eq!(refused.status, 400, "{simulate}");
        assert_eq!(refused.slug(), "invalid-request", "{simulate}");
        let detail = refused.json()["detail"].as_str().unwrap().to_string();
        assert!(detail.contains(named), "{simulate}: {detail}");
    }
    // Sent twice; on a GET; asking a route for what it cannot do.
    let twice = client.request(
        "POST",
        "/v1/charges",
        &[
            ("Idempotency-Key", "k-bad"),
            ("Idem-Simulate", "response=503"),
            ("Idem-Simulate", "response=drop"),
        ],
        &charge_body(AMOUNT).to_string(),
    );
    assert_eq!(twice.slug(), "invalid-request");
    let get = client.request(
        "GET",
        "/v1/charges",
        &[("Idem-Simulate", "response=drop")],
        "",
    );
    assert_eq!(get.slug(), "invalid-request");
    let account = client.request(
        "POST",
        "/v1/accounts",
        &[("Idem-Simulate", "crash=after-commit")],
        r#"{"id":"x","currency":"BRL"}"#,
    );
    assert_eq!(account.slug(), "invalid-request");
    assert_eq!(client.get("/v1/accounts/x").status, 404);
    // Nothing was reserved: the key is a new charge.
    let created = client.charge("k-bad", &charge_body(AMOUNT));
    assert_eq!(created.status, 201);
    assert!(!created.replayed());
    assert_charged(&client, 1);
    assert_verified(server.db_path());
}

#[test]
fn acquirer_decline_is_a_stored_402_without_an_authorization() {
    let (server, client) = sandbox(|_| {});
    let declined = charge_with(&client, "k-decline", "acquirer=decline").unwrap();
    assert_eq!(declined.status, 402);
    assert_eq!(declined.slug(), "card-declined");
    assert_charged(&client, 0);
    let db = server.db_path();
    let op = op_id(db, "k-decline");
    assert!(calls(db, CallKind::Authorize, &op).is_empty());
    // The directive is no part of the fingerprint: the retry without it,
    // and one with another directive, are the same request.
    assert_replays(&client, "k-decline", &declined);
    let other = charge_with(&client, "k-decline", "response=delay:10ms").unwrap();
    assert_eq!((other.status, &other.body), (402, &declined.body));
    assert!(other.replayed());
    assert_eq!(metric(&server, "acquirer=decline"), 1);
    assert_verified(db);
}

#[test]
fn acquirer_unavailable_is_a_503_and_unlocks_the_key() {
    let (server, client) = sandbox(|_| {});
    let failed = charge_with(&client, "k-down", "acquirer=unavailable").unwrap();
    assert_eq!(failed.status, 503);
    assert_eq!(failed.slug(), "temporarily-unavailable");
    assert!(failed.header("retry-after").is_some());
    let db = server.db_path();
    let (state, point, _, _) = key_row(db, "k-down");
    assert_eq!(
        (state.as_str(), point.as_str()),
        ("in_progress", "reserved")
    );
    assert!(calls(db, CallKind::Authorize, &op_id(db, "k-down")).is_empty());
    assert_charged(&client, 0);
    // Unlocked: the retry resumes at once, no in-flight timeout to wait.
    let created = client.charge("k-down", &charge_body(AMOUNT));
    assert_eq!(created.status, 201);
    assert_charged(&client, 1);
    assert_replays(&client, "k-down", &created);
    assert_verified(db);
}

#[test]
fn acquirer_latency_slows_this_attempt_and_times_out_past_the_deadline() {
    let (server, client) = sandbox(|c| {
        c.inflight_timeout = Duration::from_secs(2);
        c.acquirer_timeout = Some(Duration::from_millis(600));
    });
    let started = Instant::now();
    let slow = charge_with(&client, "k-slow", "acquirer-latency=300ms").unwrap();
    assert_eq!(slow.status, 201);
    assert!(started.elapsed() >= Duration::from_millis(300));
    // Past the acquirer deadline: a timeout, 503 at the deadline, unlocked.
    let started = Instant::now();
    let late = charge_with(&client, "k-late", "acquirer-latency=5s").unwrap();
    assert_eq!(late.status, 503);
    assert!(started.elapsed() < Duration::from_secs(3));
    let created = client.charge("k-late", &charge_body(AMOUNT));
    assert_eq!(created.status, 201);
    assert_charged(&client, 2);
    assert_replays(&client, "k-slow", &slow);
    assert_verified(server.db_path());
}

/// Sends a charge on a raw connection and reads until the server closes it.
fn raw_charge(client: &Client, key: &str, simulate: &str) -> Vec<u8> {
    let body = charge_body(AMOUNT).to_string();
    let mut stream = TcpStream::connect(client.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let head = format!(
        "POST /v1/charges HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: {key}\r\nIdem-Simulate: {simulate}\r\nContent-Length: {}\r\n\r\n",
        client.key,
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    raw
}

#[test]
fn response_drop_commits_and_closes_the_connection_unanswered() {
    let (server, client) = sandbox(|_| {});
    // A keep-alive request, yet the server closes: EOF, not one byte.
    assert_eq!(raw_charge(&client, "k-drop", "response=drop"), b"");
    let db = server.db_path();
    let (state, ..) = key_row(db, "k-drop");
    assert_eq!(state, "completed");
    assert_charged(&client, 1);
    let replay = client.charge("k-drop", &charge_body(AMOUNT));
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(client.all_charges()[0]["id"], replay.json()["id"]);
    assert_eq!(metric(&server, "response=drop"), 1);
    assert_verified(db);
}

/// The seed's story, scaled down: the client gives up after 300 ms (its
/// 30 s), the answer comes after 1.5 s (the 34 s charge). The retry gets
/// the one charge, as a replay.
#[test]
fn response_delay_outlasts_the_client_and_the_retry_gets_the_one_charge() {
    let (server, client) = sandbox(|c| c.workers = 1);
    let body = charge_body(AMOUNT).to_string();
    let mut stream = TcpStream::connect(client.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let head = format!(
        "POST /v1/charges HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: k-story\r\nIdem-Simulate: response=delay:1500ms\r\n\
         Content-Length: {}\r\n\r\n{body}",
        client.key,
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    let mut buf = [0u8; 64];
    let timed_out = stream.read(&mut buf).unwrap_err();
    assert!(matches!(
        timed_out.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    ));
    drop(stream);
    // The delay holds no worker: the only one answers at once.
    let started = Instant::now();
    assert_eq!(client.get("/v1/accounts/card").status, 200);
    assert!(started.elapsed() < Duration::from_secs(1));
    let retry = client.charge("k-story", &charge_body(AMOUNT));
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_charged(&client, 1);
    // A client that waits gets the very answer, late.
    let started = Instant::now();
    let late = charge_with(&client, "k-wait", "response=delay:400ms").unwrap();
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(late.status, 201);
    assert_replays(&client, "k-wait", &late);
    assert_charged(&client, 2);
    assert_verified(server.db_path());
}

#[test]
fn response_503_after_the_effect_then_a_replay() {
    let (server, client) = sandbox(|_| {});
    let failed = charge_with(&client, "k-proxy", "response=503").unwrap();
    assert_eq!(failed.status, 503);
    assert_eq!(failed.slug(), "temporarily-unavailable");
    assert_charged(&client, 1);
    let retry = client.charge("k-proxy", &charge_body(AMOUNT));
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(client.all_charges()[0]["id"], retry.json()["id"]);
    // With another directive, still the same request.
    let again = charge_with(&client, "k-proxy", "acquirer=decline").unwrap();
    assert_eq!((again.status, &again.body), (201, &retry.body));
    assert_charged(&client, 1);
    assert_verified(server.db_path());
}

/// `crash=POINT` leaves no answer and the key as a crash there would; a
/// retry inside the in-flight timeout is 409, one after it takes the key
/// over and finishes with the one charge.
fn crash_then_retry(point: &str, want_point: &str, authorized: bool) {
    let (server, client) = crashable(Duration::from_secs(3600));
    let db = server.db_path().to_path_buf();
    let key = format!("k-{point}");
    let lost = charge_with(&client, &key, &format!("crash={point}"));
    assert!(lost.is_err(), "{point}: answered {lost:?}");
    let (state, recovery, authorization, generation) = key_row(&db, &key);
    assert_eq!(state, "in_progress", "{point}");
    assert_eq!(recovery, want_point, "{point}");
    assert_eq!((authorization, generation), (None, 1), "{point}");
    let op = op_id(&db, &key);
    let journal = calls(&db, CallKind::Authorize, &op);
    assert_eq!(journal.len(), usize::from(authorized), "{point}");
    assert_charged(&client, 0);
    // The owner is "dead" but its lock is fresh.
    let busy = client.charge(&key, &charge_body(AMOUNT));
    assert_eq!(busy.slug(), "idempotency-key-in-use", "{point}");
    std::thread::sleep(STALE + Duration::from_millis(100));
    let finished = client.charge(&key, &charge_body(AMOUNT));
    assert_eq!(finished.status, 201, "{point}");
    assert_charged(&client, 1);
    let (state, _, _, generation) = key_row(&db, &key);
    assert_eq!((state.as_str(), generation), ("completed", 2));
    // One authorization at the acquirer, the one the charge records.
    let journal = calls(&db, CallKind::Authorize, &op);
    assert_eq!(journal.iter().filter(|c| c.created).count(), 1);
    assert_eq!(
        finished.json()["authorization"],
        json!(journal[0].authorization)
    );
    assert_replays(&client, &key, &finished);
    assert_verified(&db);
}

#[test]
fn crash_after_reserve_is_finished_by_a_retry_after_the_inflight_timeout() {
    crash_then_retry("after-reserve", "reserved", false);
}

#[test]
fn crash_after_acquirer_is_finished_by_a_retry_with_the_same_authorization() {
    crash_then_retry("after-acquirer", "reserved", true);
}

#[test]
fn crash_after_commit_leaves_the_charge_and_the_retry_replays() {
    let (server, client) = crashable(Duration::from_secs(3600));
    let db = server.db_path();
    assert!(charge_with(&client, "k-commit", "crash=after-commit").is_err());
    let (state, ..) = key_row(db, "k-commit");
    assert_eq!(state, "completed");
    assert_charged(&client, 1);
    let replay = client.charge("k-commit", &charge_body(AMOUNT));
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(metric(&server, "crash=after-commit"), 1);
    assert_verified(db);
}

/// Nobody retries: the reaper alone finishes each crashed attempt.
#[test]
fn crashes_are_finished_by_the_reaper_alone() {
    let (server, client) = crashable(Duration::from_millis(200));
    let db = server.db_path();
    for point in ["after-reserve", "after-acquirer"] {
        let key = format!("k-reaped-{point}");
        assert!(charge_with(&client, &key, &format!("crash={point}")).is_err());
    }
    for point in ["after-reserve", "after-acquirer"] {
        let key = format!("k-reaped-{point}");
        eventually(Duration::from_secs(10), || {
            (key_row(db, &key).0 == "completed").then_some(())
        });
        let op = op_id(db, &key);
        let created = calls(db, CallKind::Authorize, &op);
        assert_eq!(created.iter().filter(|c| c.created).count(), 1, "{point}");
        let replay = client.charge(&key, &charge_body(AMOUNT));
        assert_eq!(replay.status, 201);
        assert!(replay.replayed());
    }
    assert_charged(&client, 2);
    assert_verified(db);
}

/// Async mode: the 202 was sent before the crash point; the operation
/// stays in progress until the reaper finishes it.
#[test]
fn an_async_crash_after_the_acquirer_is_finished_by_the_reaper() {
    let (server, client) = crashable(Duration::from_millis(200));
    let accepted = client.request(
        "POST",
        "/v1/charges",
        &[
            ("Idempotency-Key", "k-async"),
            ("Prefer", "respond-async"),
            ("Idem-Simulate", "crash=after-acquirer"),
        ],
        &charge_body(AMOUNT).to_string(),
    );
    assert_eq!(accepted.status, 202);
    let location = accepted.header("location").unwrap().to_string();
    let done: Value = eventually(Duration::from_secs(10), || {
        let op = client.get(&location).json();
        (op["status"] == "completed").then_some(op)
    });
    assert_eq!(done["response"]["status"], 201);
    let (_, _, _, generation) = key_row(server.db_path(), "k-async");
    assert_eq!(generation, 2);
    assert_charged(&client, 1);
    assert_verified(server.db_path());
}

/// Captures and refunds take the acquirer and crash directives too; each
/// ends with one capture and one refund at the acquirer.
#[test]
fn settlements_take_acquirer_and_crash_faults() {
    let (server, client) = crashable(Duration::from_secs(3600));
    let db = server.db_path().to_path_buf();
    let mut hold = charge_body(AMOUNT);
    hold["capture"] = json!(false);
    let held = client.charge("k-hold", &hold).json();
    let charge = held["id"].as_str().unwrap().to_string();
    let capture_path = format!("/v1/charges/{charge}/capture");
    let capture = |key: &str, simulate: Option<&str>| {
        let mut headers = vec![("Idempotency-Key", key)];
        headers.extend(simulate.map(|s| ("Idem-Simulate", s)));
        client.try_request("POST", &capture_path, &headers, "{}")
    };
    let declined = capture("k-cap", Some("acquirer=decline")).unwrap();
    assert_eq!(declined.slug(), "invalid-request");
    assert!(capture("k-cap", Some("crash=after-acquirer")).is_err());
    std::thread::sleep(STALE + Duration::from_millis(100));
    let captured = capture("k-cap", None).unwrap();
    assert_eq!(captured.status, 200);
    assert_eq!(captured.json()["status"], "succeeded");
    let op = op_id(&db, "k-cap");
    let captures = calls(&db, CallKind::Capture, &op);
    assert_eq!(captures.iter().filter(|c| c.created).count(), 1);
    // A refund whose acquirer is down: 503, key unlocked, the retry refunds once.
    let refund_path = format!("/v1/charges/{charge}/refunds");
    let refund = |simulate: Option<&str>| {
        let mut headers = vec![("Idempotency-Key", "k-refund")];
        headers.extend(simulate.map(|s| ("Idem-Simulate", s)));
        client.request("POST", &refund_path, &headers, "{}")
    };
    assert_eq!(refund(Some("acquirer=unavailable")).status, 503);
    let refunded = refund(None);
    assert_eq!(refunded.status, 201);
    let refunds = calls(&db, CallKind::Refund, &op_id(&db, "k-refund"));
    assert_eq!(refunds.iter().filter(|c| c.created).count(), 1);
    assert_eq!(client.balance("card"), 0);
    assert_eq!(client.balance("shop"), 0);
    assert_verified(&db);
}

/// Scripted faults, no header: the next N matching requests get them,
/// then requests are normal again; requests that do not match (another
/// route, a route that cannot take the fault) leave the script alone.
#[test]
fn scripted_faults_apply_to_the_next_n_matching_requests() {
    let (server, client) = crashable(Duration::from_secs(3600));
    server
        .simulate(
            Simulation::new()
                .matching("/v1/charges")
                .times(2)
                .fault(Directive::Response503),
        )
        .unwrap();
    server
        .simulate(Simulation::new().fault(Directive::CrashAfterAcquirer))
        .unwrap();
    assert_eq!(server.pending_simulations(), 3);
    // An account matches neither script (the crash cannot apply to it).
    client.account("other", false);
    assert_eq!(server.pending_simulations(), 3);
    for key in ["k-s1", "k-s2"] {
        let r = client.charge(key, &charge_body(AMOUNT));
        assert_eq!(r.slug(), "temporarily-unavailable");
    }
    assert!(client
        .try_request(
            "POST",
            "/v1/charges",
            &[("Idempotency-Key", "k-s3")],
            &charge_body(AMOUNT).to_string(),
        )
        .is_err());
    assert_eq!(server.pending_simulations(), 0);
    let normal = client.charge("k-s4", &charge_body(AMOUNT));
    assert_eq!(normal.status, 201);
    assert!(!normal.replayed());
    for key in ["k-s1", "k-s2"] {
        assert!(client.charge(key, &charge_body(AMOUNT)).replayed());
    }
    std::thread::sleep(STALE + Duration::from_millis(100));
    assert_eq!(client.charge("k-s3", &charge_body(AMOUNT)).status, 201);
    assert_charged(&client, 4);
    // Refused: contradictions, routes that cannot take the fault, no fault.
    let bad = [
        Simulation::new()
            .fault(Directive::CrashAfterCommit)
            .fault(Directive::ResponseDrop),
        Simulation::new()
            .matching("/v1/accounts")
            .fault(Directive::CrashAfterReserve),
        Simulation::new()
            .matching("/v1/charges/{id}/capture")
            .fault(Directive::AcquirerDecline),
        Simulation::new()
            .matching("/v1/nowhere")
            .fault(Directive::Response503),
        Simulation::new().fault(Directive::Response503).times(0),
    ];
    for simulation in bad {
        assert!(
            server.simulate(simulation.clone()).is_err(),
            "{simulation:?}"
        );
    }
    server
        .simulate(Simulation::new().fault(Directive::Response503))
        .unwrap();
    server.clear_simulations();
    assert_eq!(server.pending_simulations(), 0);
    assert_verified(server.db_path());
}

/// 8 threads race charges while a script holds 3 faults: exactly 3
/// requests get one (each use is taken atomically), and the retries leave
/// 8 charges.
#[test]
fn concurrent_requests_share_no_scripted_fault() {
    let (server, client) = sandbox(|_| {});
    server
        .simulate(
            Simulation::new()
                .matching("/v1/charges")
                .times(3)
                .fault(Directive::Response503),
        )
        .unwrap();
    let barrier = Arc::new(Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let (client, barrier) = (client.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                client
                    .charge(&format!("k-race-{i}"), &charge_body(AMOUNT))
                    .status
            })
        })
        .collect();
    let statuses: Vec<u16> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 503).count(),
        3,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 201).count(),
        5,
        "{statuses:?}"
    );
    for i in 0..8 {
        let r = client.charge(&format!("k-race-{i}"), &charge_body(AMOUNT));
        assert_eq!(r.status, 201);
        assert!(r.replayed());
    }
    assert_charged(&client, 8);
    assert_eq!(metric(&server, "response=503"), 3);
    assert_verified(server.db_path());
}

/// `idem serve --sandbox` (or `IDEM_SANDBOX`) warns before it listens and
/// says so in /healthz.
#[test]
fn the_cli_switch_warns_and_turns_the_sandbox_on() {
    use std::io::BufRead;
    let dir = support::TempDir::new("sandbox-cli");
    for (args, env) in [(&["--sandbox"][..], None), (&[][..], Some("true"))] {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(["serve", "--addr", "127.0.0.1:0", "--db"])
            .arg(dir.db())
            .args(args)
            .env_remove("IDEM_SANDBOX")
            .stderr(std::process::Stdio::piped());
        if let Some(value) = env {
            cmd.env("IDEM_SANDBOX", value);
        }
        cmd.stdout(std::process::Stdio::null());
        let mut child = Killed(cmd.spawn().unwrap());
        let child = &mut child.0;
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut before = Vec::new();
        let addr = loop {
            let mut line = String::new();
            assert!(stderr.read_line(&mut line).unwrap() > 0, "{before:?}");
            if let Some(url) = line.trim().strip_prefix("listening on http://") {
                break url.parse().unwrap();
            }
            before.push(line);
        };
        assert!(
            before.iter().any(|l| l.contains("sandbox mode")),
            "{before:?}"
        );
        let health = support::send(addr, "GET", "/healthz", &[], b"").unwrap();
        assert_eq!(health.body, br#"{"status":"ok","sandbox":true}"#);
    }
}

/// A child process killed (and reaped) when dropped, even by a panic.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
