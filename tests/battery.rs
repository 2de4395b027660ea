//! The seed's five-case battery (cases 1, 2, 3 and 5; case 4, the crash in
//! the middle, is in `crash.rs`), through HTTP against a real server.

mod support;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::json;
use support::{charge_body, server};

/// Case 1: same key, same body, sequential — identical status and body, one effect.
#[test]
fn same_key_same_body_sequential_replays_byte_for_byte() {
    let (_server, client) = server(|_| {});
    let first = client.charge("order-1", &charge_body(2500));
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    for _ in 0..3 {
        let again = client.charge("order-1", &charge_body(2500));
        assert_eq!(again.status, first.status);
        assert_eq!(again.body, first.body, "replay must be byte-identical");
        assert!(again.replayed());
        assert_eq!(again.header("content-type"), Some("application/json"));
    }
    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(client.balance("shop"), 2500);
    assert_eq!(client.balance("card"), -2500);
}

/// Case 2: same key, same body, 32 threads released together while the
/// acquirer takes 500 ms — exactly one effect; every other answer is a 409
/// given at once (long before the owner finishes) or the stored replay.
#[test]
fn same_key_same_body_concurrent_executes_once() {
    const THREADS: usize = 32;
    const ACQUIRER: Duration = Duration::from_millis(500);
    let (_server, client) = server(|c| c.acquirer_latency = ACQUIRER);
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let client = client.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let started = Instant::now();
                let r = client.charge("hot-key", &charge_body(700));
                (r, started.elapsed())
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();

    let fresh: Vec<_> = results
        .iter()
        .filter(|(r, _)| r.status == 201 && !r.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one request executes");
    let (owner, owner_took) = fresh[0];
    assert!(*owner_took >= ACQUIRER, "the owner waited for the acquirer");
    let mut conflicts = 0;
    for (r, took) in &results {
        match r.status {
            201 => assert_eq!(r.body, owner.body, "a replay is the owner's answer"),
            409 => {
                conflicts += 1;
                assert_eq!(r.slug(), "idempotency-key-in-use");
                assert_eq!(r.header("retry-after"), Some("1"));
                assert!(
                    *took < ACQUIRER,
                    "a 409 is answered at once, not after the owner: took {took:?}"
                );
            }
            other => panic!(
                "unexpected status {other}: {}",
                String::from_utf8_lossy(&r.body)
            ),
        }
    }
    assert!(
        conflicts > 0,
        "some duplicates arrived while the owner was in flight"
    );
    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(client.balance("shop"), 700);
}

/// Case 3: same key, different body — 422, and nothing executes, whether the
/// first request is still in flight or completed.
#[test]
fn same_key_different_body_is_rejected_and_executes_nothing() {
    let (server, client) = server(|c| c.acquirer_latency = Duration::from_millis(1000));
    let c2 = client.clone();
    let first = std::thread::spawn(move || c2.charge("k", &charge_body(100)));
    support::wait_for_key(server.db_path(), "k");
    let in_flight = client.charge("k", &charge_body(999));
    assert_eq!(in_flight.status, 422);
    assert_eq!(in_flight.slug(), "idempotency-key-reused");
    assert_eq!(first.join().unwrap().status, 201);
    let after = client.charge("k", &charge_body(101));
    assert_eq!(after.status, 422);
    assert_eq!(after.slug(), "idempotency-key-reused");
    let other_account = client.charge(
        "k",
        &json!({"amount": 100, "currency": "BRL", "source": "shop", "destination": "card"}),
    );
    assert_eq!(other_account.status, 422);
    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(client.balance("shop"), 100);
}

/// Case 5: past `--key-retention` the same key is a new request — both when
/// the row is still there (it counts as absent) and after the reaper deleted it.
#[test]
fn expired_key_is_a_new_request() {
    let (server, client) = server(|c| {
        c.key_retention = Duration::from_millis(500);
        c.reaper_interval = Duration::from_secs(3600);
    });
    let first = client.charge("daily", &charge_body(10));
    assert_eq!(first.status, 201);
    let replay = client.charge("daily", &charge_body(10));
    assert!(replay.replayed());
    std::thread::sleep(Duration::from_millis(700));

    // The expired row still exists; it counts as absent, whatever the body.
    let second = client.charge("daily", &charge_body(20));
    assert_eq!(second.status, 201);
    assert!(!second.replayed());
    assert_ne!(second.json()["id"], first.json()["id"]);

    std::thread::sleep(Duration::from_millis(700));
    server.reap_now();
    let third = client.charge("daily", &charge_body(20));
    assert_eq!(third.status, 201);
    assert!(!third.replayed());
    assert_ne!(third.json()["id"], second.json()["id"]);

    assert_eq!(client.all_charges().len(), 3);
    assert_eq!(client.balance("shop"), 50);
    support::assert_verified(server.db_path());
}
