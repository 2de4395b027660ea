//! The idempotency protocol through HTTP: scope, fingerprint, key syntax,
//! what stores nothing, async mode, transient failures and natural ids.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem::acquirer::{Acquirer, AuthorizeOutcome, Simulator, Unavailable};
use serde_json::json;
use support::{charge_body, server, Client};

#[test]
fn same_key_from_two_consumers_names_two_requests() {
    let (server, alice) = server(|_| {});
    let bob = Client::new(server.addr(), &server.create_consumer("bob").unwrap());
    bob.card_and_shop();
    let a = alice.charge("shared-key", &charge_body(100));
    let b = bob.charge("shared-key", &charge_body(100));
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed());
    assert_ne!(a.json()["id"], b.json()["id"]);
    assert_eq!(alice.all_charges().len(), 1);
    assert_eq!(bob.all_charges().len(), 1);
}

#[test]
fn same_key_on_two_routes_names_two_requests() {
    let (_server, client) = server(|_| {});
    let charge = client.charge("k", &charge_body(1000)).json();
    let id = charge["id"].as_str().unwrap();
    let refund = client.post(
        &format!("/v1/charges/{id}/refunds"),
        Some("k"),
        &json!({"amount": 10}),
    );
    assert_eq!(
        refund.status,
        201,
        "{}",
        String::from_utf8_lossy(&refund.body)
    );
    let account = client.post("/v1/accounts", Some("k"), &json!({"currency": "BRL"}));
    assert_eq!(account.status, 201);
    // Two refund routes are two concrete paths.
    let other = client.charge("k2", &charge_body(1000)).json();
    let other_id = other["id"].as_str().unwrap();
    let refund2 = client.post(
        &format!("/v1/charges/{other_id}/refunds"),
        Some("k"),
        &json!({"amount": 10}),
    );
    assert_eq!(refund2.status, 201);
    assert!(!refund2.replayed());
}

#[test]
fn fingerprint_is_canonical_json() {
    let (_server, client) = server(|_| {});
    let first = client.request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "canon")],
        r#"{"amount":300,"currency":"BRL","source":"card","destination":"shop","metadata":{"a":"1","b":"2"}}"#,
    );
    assert_eq!(first.status, 201);
    let reordered = client.request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "canon")],
        "{\n  \"metadata\": {\"b\": \"2\", \"a\": \"1\"},\n  \"destination\": \"shop\",\n  \"source\": \"card\",\n  \"currency\": \"BRL\",\n  \"amount\": 300\n}",
    );
    assert_eq!(reordered.status, 201);
    assert!(reordered.replayed());
    assert_eq!(reordered.body, first.body);
    // Same body, different key: a second, legitimate, identical payment.
    let twin = client.charge("canon-2", &charge_body(300));
    assert_eq!(twin.status, 201);
    assert!(!twin.replayed());
}

#[test]
fn rejected_requests_store_nothing_and_leave_the_key_free() {
    let (_server, client) = server(|_| {});
    let cases: &[(&str, u16, &str)] = &[
        (
            r#"{"amount":1.5,"currency":"BRL","source":"card","destination":"shop"}"#,
            400,
            "invalid-request",
        ),
        (r#"{"amount":100}"#, 400, "invalid-request"),
        ("{not json", 400, "invalid-request"),
    ];
    for (body, status, slug) in cases {
        let r = client.request(
            "POST",
            "/v1/charges",
            &[("Idempotency-Key", "free-key")],
            body,
        );
        assert_eq!((r.status, r.slug().as_str()), (*status, *slug), "{body}");
    }
    let ok = client.charge("free-key", &charge_body(100));
    assert_eq!(ok.status, 201, "a 400 did not consume the key");
    assert!(!ok.replayed());
}

#[test]
fn idempotency_key_header_syntax() {
    let (_server, client) = server(|_| {});
    let body = charge_body(10).to_string();
    let post = |headers: &[(&str, &str)]| client.request("POST", "/v1/charges", headers, &body);
    let missing = post(&[]);
    assert_eq!(
        (missing.status, missing.slug().as_str()),
        (400, "idempotency-key-missing")
    );
    let long = "x".repeat(256);
    for bad in ["", "has space", "\"unterminated", "\"a\"b\"", long.as_str()] {
        let r = post(&[("Idempotency-Key", bad)]);
        assert_eq!(
            (r.status, r.slug().as_str()),
            (400, "idempotency-key-invalid"),
            "{bad:?}"
        );
    }
    let two = client.request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "a"), ("Idempotency-Key", "b")],
        &body,
    );
    assert_eq!(two.slug(), "idempotency-key-invalid");
    // A structured-field string is unquoted: "abc" and abc are one key.
    let quoted = post(&[("Idempotency-Key", "\"sf-key\"")]);
    assert_eq!(quoted.status, 201);
    let bare = post(&[("Idempotency-Key", "sf-key")]);
    assert!(bare.replayed());
    assert_eq!(bare.body, quoted.body);
    assert_eq!(client.all_charges().len(), 1);
    // The key is never reflected into a header.
    assert!(bare.headers.iter().all(|(_, v)| !v.contains("sf-key")));
}

#[test]
fn async_mode_answers_202_and_the_operation_completes() {
    let (_server, client) = server(|c| c.acquirer_latency = Duration::from_millis(600));
    let prefer = [("Idempotency-Key", "async-1"), ("Prefer", "respond-async")];
    let body = charge_body(250).to_string();
    let accepted = client.request("POST", "/v1/charges", &prefer, &body);
    assert_eq!(accepted.status, 202);
    let op = accepted.json();
    let op_id = op["id"].as_str().unwrap().to_string();
    assert!(op_id.starts_with("op_"));
    assert_eq!(op["status"], "in_progress");
    let location = accepted.header("location").unwrap().to_string();
    assert_eq!(location, format!("/v1/operations/{op_id}"));

    let again = client.request("POST", "/v1/charges", &prefer, &body);
    assert_eq!(
        again.status, 202,
        "a retry while in progress answers the same operation"
    );
    assert_eq!(again.json()["id"], op_id.as_str());
    let sync_dup = client.request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "async-1")],
        &body,
    );
    assert_eq!(sync_dup.status, 409);
    assert_eq!(client.get(&location).json()["status"], "in_progress");

    let done = support::eventually(Duration::from_secs(10), || {
        let op = client.get(&location).json();
        (op["status"] == "completed").then_some(op)
    });
    assert_eq!(done["response"]["status"], 201);
    let charge = &done["response"]["body"];
    assert_eq!(charge["object"], "charge");
    let after = client.request("POST", "/v1/charges", &prefer, &body);
    assert_eq!(
        after.status, 201,
        "after completion: the stored final response"
    );
    assert!(after.replayed());
    assert_eq!(after.json(), *charge);
    let op_raw = String::from_utf8(client.get(&location).body).unwrap();
    let stored = String::from_utf8(after.body.clone()).unwrap();
    assert!(
        op_raw.contains(&stored),
        "the operation embeds the stored bytes"
    );
    assert_eq!(client.all_charges().len(), 1);
}

/// Fails its first `failures` calls, like an acquirer outage.
struct Flaky {
    failures: usize,
    calls: AtomicUsize,
    inner: Simulator,
}

impl Acquirer for Flaky {
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        deadline: std::time::Instant,
    ) -> Result<AuthorizeOutcome, Unavailable> {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
            return Err(Unavailable("connection reset".into()));
        }
        self.inner
            .authorize(key, amount, currency, capture, deadline)
    }

    crate::settle_through_inner!();
}

#[test]
fn transient_failure_answers_503_and_unlocks_the_key() {
    let dir = support::TempDir::new("flaky");
    let flaky = Arc::new(Flaky {
        failures: 2,
        calls: AtomicUsize::new(0),
        inner: Simulator::new(Duration::ZERO),
    });
    let (server, client) = support::server_with_acquirer(&dir, flaky.clone(), |_| {});
    for _ in 0..2 {
        let r = client.charge("flaky", &charge_body(80));
        assert_eq!(
            (r.status, r.slug().as_str()),
            (503, "temporarily-unavailable")
        );
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    assert!(
        client.all_charges().is_empty(),
        "no final answer, no effect"
    );
    // The key was unlocked: the retry resumes at once instead of a 409.
    let ok = client.charge("flaky", &charge_body(80));
    assert_eq!(ok.status, 201);
    assert!(!ok.replayed());
    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(flaky.calls.load(Ordering::SeqCst), 3);
    support::assert_verified(server.db_path());
}

#[test]
fn accounts_natural_id_and_key() {
    let (_server, client) = server(|_| {});
    let body = json!({"id": "till-1", "currency": "BRL", "metadata": {"store": "7"}});
    let first = client.post("/v1/accounts", None, &body);
    assert_eq!(first.status, 201);
    // The same id with the same fields: 200, the existing account, replayed.
    let same = client.post("/v1/accounts", None, &json!({"currency": "BRL", "id": "till-1", "allow_negative": false, "metadata": {"store": "7"}}));
    assert_eq!(same.status, 200);
    assert!(same.replayed());
    assert_eq!(same.json()["id"], "till-1");
    // The same id with other fields: 422 resource-mismatch.
    let other = client.post(
        "/v1/accounts",
        None,
        &json!({"id": "till-1", "currency": "USD"}),
    );
    assert_eq!(
        (other.status, other.slug().as_str()),
        (422, "resource-mismatch")
    );

    // Without an id, a key makes the generated account idempotent.
    let keyed = client.post(
        "/v1/accounts",
        Some("acct-key"),
        &json!({"currency": "BRL"}),
    );
    assert_eq!(keyed.status, 201);
    assert!(keyed.json()["id"].as_str().unwrap().starts_with("acct_"));
    let keyed_again = client.post(
        "/v1/accounts",
        Some("acct-key"),
        &json!({"currency": "BRL"}),
    );
    assert!(keyed_again.replayed());
    assert_eq!(keyed_again.body, keyed.body);
    // Both an id and a key: the key is decided first.
    let both = client.post(
        "/v1/accounts",
        Some("acct-key"),
        &json!({"id": "till-1", "currency": "BRL", "metadata": {"store": "7"}}),
    );
    assert_eq!(
        (both.status, both.slug().as_str()),
        (422, "idempotency-key-reused")
    );
}

#[test]
fn metrics_expose_the_contract_names() {
    let (server, client) = server(|_| {});
    client.charge("m", &charge_body(1));
    client.charge("m", &charge_body(1));
    client.charge("m", &charge_body(2));
    let r = support::send(server.addr(), "GET", "/metrics", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    let text = String::from_utf8(r.body).unwrap();
    for name in [
        "idem_http_requests_total{route=\"/v1/charges\",status=\"201\"} 2",
        "idem_http_request_duration_seconds_bucket",
        "idem_idempotent_replays_total 1",
        "idem_idempotency_conflicts_total{kind=\"in_use\"} 0",
        "idem_idempotency_conflicts_total{kind=\"reference_in_use\"} 0",
        "idem_idempotency_conflicts_total{kind=\"reused\"} 1",
        "idem_orphans_taken_over_total 0",
        "idem_keys_reaped_total 0",
        "idem_commit_batch_size_bucket",
        "idem_commit_duration_seconds_count",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
}

fn commits(server: &idem::Server) -> u64 {
    let r = support::send(server.addr(), "GET", "/metrics", &[], b"").unwrap();
    let text = String::from_utf8(r.body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("idem_commit_duration_seconds_count "))
        .and_then(|n| n.parse().ok())
        .expect("commit counter")
}

/// Replays, 409s and 422s are answered from a reader: they never queue
/// behind writes (the writer commits nothing for them).
#[test]
fn duplicates_are_answered_without_the_writer() {
    let (server, client) = server(|c| {
        c.acquirer_latency = Duration::from_millis(2000);
        c.reaper_interval = Duration::from_secs(3600);
    });
    let done = client.charge("done", &charge_body(5));
    assert_eq!(done.status, 201);
    let c = client.clone();
    let in_flight = std::thread::spawn(move || c.charge("busy", &charge_body(6)));
    support::wait_for_key(server.db_path(), "busy");
    let before = commits(&server);
    for _ in 0..5 {
        assert!(client.charge("done", &charge_body(5)).replayed());
        assert_eq!(client.charge("done", &charge_body(7)).status, 422);
        assert_eq!(client.charge("busy", &charge_body(6)).status, 409);
    }
    assert_eq!(commits(&server), before, "no write for a duplicate");
    assert_eq!(in_flight.join().unwrap().status, 201);
}

/// More slow charges in flight than there are HTTP workers: a duplicate of
/// one of them, a GET and /healthz are still answered at once, because an
/// owned charge waits for its acquirer on the operation pool, not on a worker.
#[test]
fn slow_owners_do_not_hold_http_workers() {
    const WORKERS: usize = 2;
    const ACQUIRER: Duration = Duration::from_millis(3000);
    let (server, client) = server(|c| {
        c.workers = WORKERS;
        c.acquirer_latency = ACQUIRER;
    });
    let barrier = Arc::new(std::sync::Barrier::new(WORKERS * 3 + 1));
    let owners: Vec<_> = (0..WORKERS * 3)
        .map(|i| {
            let (c, barrier) = (client.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                c.charge(&format!("slow-{i}"), &charge_body(10))
            })
        })
        .collect();
    barrier.wait();
    for i in 0..WORKERS * 3 {
        support::wait_for_key(server.db_path(), &format!("slow-{i}"));
    }
    let started = std::time::Instant::now();
    let dup = client.charge("slow-0", &charge_body(10));
    assert_eq!(dup.status, 409);
    assert_eq!(client.get("/v1/accounts/shop").status, 200);
    let health = support::send(server.addr(), "GET", "/healthz", &[], b"").unwrap();
    assert_eq!(health.status, 200);
    let took = started.elapsed();
    assert!(
        took < ACQUIRER / 3,
        "answered while the owners wait: {took:?}"
    );
    for owner in owners {
        assert_eq!(owner.join().unwrap().status, 201);
    }
    assert_eq!(client.all_charges().len(), WORKERS * 3);
}

/// More slow async charges than operation threads: every one still gets its
/// 202 at once (reservations have their own pool), the surplus waits in the
/// operation queue, and all of them complete.
#[test]
fn async_202_stays_immediate_when_every_operation_thread_is_busy() {
    const REQUESTS: usize = idem::config::OPERATION_THREADS + 24;
    const ACQUIRER: Duration = Duration::from_millis(2500);
    let (_server, client) = server(|c| c.acquirer_latency = ACQUIRER);
    let barrier = Arc::new(std::sync::Barrier::new(REQUESTS));
    let senders: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let (c, barrier) = (client.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let started = std::time::Instant::now();
                let key = format!("async-{i}");
                let headers = [
                    ("Idempotency-Key", key.as_str()),
                    ("Prefer", "respond-async"),
                ];
                let r = c.request("POST", "/v1/charges", &headers, &charge_body(1).to_string());
                (r, started.elapsed())
            })
        })
        .collect();
    let mut locations = Vec::new();
    for sender in senders {
        let (r, took) = sender.join().unwrap();
        assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
        assert!(
            took < ACQUIRER / 2,
            "202 at once, not after an acquirer call: {took:?}"
        );
        locations.push(r.header("location").unwrap().to_string());
    }
    for location in locations {
        support::eventually(Duration::from_secs(30), || {
            (client.get(&location).json()["status"] == "completed").then_some(())
        });
    }
    assert_eq!(client.all_charges().len(), REQUESTS);
}

/// The value of one metrics line (`name{labels}`).
fn metric(server: &idem::Server, line: &str) -> u64 {
    let r = support::send(server.addr(), "GET", "/metrics", &[], b"").unwrap();
    let text = String::from_utf8(r.body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {line} in\n{text}"))
}

/// A 409 `reference-in-use` (another key's charge with that `reference` in
/// progress) and a 409 `idempotency-key-in-use` (this key in progress) are
/// two different conflicts: each is counted under its own kind of
/// `idem_idempotency_conflicts_total`, never the one under the other.
#[test]
fn reference_in_use_and_key_in_use_are_counted_apart() {
    // While `held` is true a charge waits before its ledger phase, its key
    // and its reference in progress: no race with a timer.
    let held = Arc::new((std::sync::Mutex::new(true), std::sync::Condvar::new()));
    let gate = Arc::clone(&held);
    let (server, client) = server(|c| {
        c.hooks.before_ledger_phase = Some(Arc::new(move |_op: &str| {
            let (lock, released) = &*gate;
            let mut hold = lock.lock().unwrap();
            while *hold {
                hold = released.wait(hold).unwrap();
            }
        }))
    });
    // Released however the test ends: a failed assertion while the charge
    // is held must fail the test, not hang the server's shutdown.
    struct Release(Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>);
    impl Drop for Release {
        fn drop(&mut self) {
            let (lock, released) = &*self.0;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = false;
            released.notify_all();
        }
    }
    let release = Release(Arc::clone(&held));
    let in_use = "idem_idempotency_conflicts_total{kind=\"in_use\"}";
    let reference_in_use = "idem_idempotency_conflicts_total{kind=\"reference_in_use\"}";
    assert_eq!(metric(&server, in_use), 0);
    let mut body = charge_body(70);
    body["reference"] = json!("order-12");
    let first = {
        let (client, body) = (client.clone(), body.clone());
        std::thread::spawn(move || client.charge("ref-a", &body))
    };
    support::wait_for_key(server.db_path(), "ref-a");

    for _ in 0..2 {
        let other_key = client.charge("ref-b", &body);
        assert_eq!(
            (other_key.status, other_key.slug().as_str()),
            (409, "reference-in-use")
        );
    }
    assert_eq!(
        metric(&server, in_use),
        0,
        "a reference in use is not a key in use"
    );
    assert_eq!(metric(&server, reference_in_use), 2);
    let same_key = client.charge("ref-a", &body);
    assert_eq!(
        (same_key.status, same_key.slug().as_str()),
        (409, "idempotency-key-in-use")
    );
    assert_eq!(
        (metric(&server, in_use), metric(&server, reference_in_use)),
        (1, 2)
    );

    drop(release);
    assert_eq!(first.join().unwrap().status, 201);
    assert_eq!(client.all_charges().len(), 1);
}
