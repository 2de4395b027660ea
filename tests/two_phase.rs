//! Two-phase charges through HTTP against real servers: holds and
//! `available`, full and partial captures, cancels, replays of each, the
//! capture/cancel race (threads released by a barrier, acquirer calls
//! counted), expiry by the reaper, the void of an authorization the ledger
//! declined, refunds limited to captured money, and bad input.

mod support;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use idem::acquirer::{Acquirer, AuthorizeOutcome, Simulator, Unavailable};
use serde_json::{json, Value};
use support::{Client, CountingAcquirer, Resp, TempDir};

/// A server with the counting acquirer, a `wallet` (may not go negative)
/// funded with `funds` from `card`, and `shop`.
fn setup(
    dir: &TempDir,
    funds: i64,
    configure: impl FnOnce(&mut idem::Config),
) -> (idem::Server, Client, Arc<CountingAcquirer>) {
    let acquirer = CountingAcquirer::new();
    let (server, client) = support::server_with_acquirer(dir, acquirer.clone(), configure);
    client.account("wallet", false);
    let funded = client.charge(
        "fund-wallet",
        &json!({"amount": funds, "currency": "BRL", "source": "card", "destination": "wallet"}),
    );
    assert_eq!(funded.status, 201);
    (server, client, acquirer)
}

fn hold_body(amount: i64) -> Value {
    json!({"amount": amount, "currency": "BRL", "source": "wallet", "destination": "shop",
           "capture": false})
}

fn hold(client: &Client, key: &str, amount: i64) -> Value {
    let r = client.charge(key, &hold_body(amount));
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn account(client: &Client, id: &str) -> Value {
    let r = client.get(&format!("/v1/accounts/{id}"));
    assert_eq!(r.status, 200);
    r.json()
}

/// (balance, held, available).
fn funds(client: &Client, id: &str) -> (i64, i64, i64) {
    let a = account(client, id);
    (
        a["balance"].as_i64().unwrap(),
        a["held"].as_i64().unwrap(),
        a["available"].as_i64().unwrap(),
    )
}

fn capture(client: &Client, charge: &str, key: &str, body: &Value) -> Resp {
    client.post(&format!("/v1/charges/{charge}/capture"), Some(key), body)
}

fn cancel(client: &Client, charge: &str, key: &str) -> Resp {
    client.post(
        &format!("/v1/charges/{charge}/cancel"),
        Some(key),
        &json!({}),
    )
}

fn charge(client: &Client, id: &str) -> Value {
    let r = client.get(&format!("/v1/charges/{id}"));
    assert_eq!(r.status, 200);
    r.json()
}

fn entries(client: &Client, account: &str) -> Vec<Value> {
    client
        .get(&format!("/v1/accounts/{account}/entries?limit=100"))
        .json()["data"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn a_hold_reserves_funds_and_a_partial_capture_moves_only_what_it_captures() {
    let dir = TempDir::new("2p-partial");
    let (server, client, acquirer) = setup(&dir, 10_000, |_| {});
    let held = hold(&client, "hold-1", 6_000);
    assert_eq!(held["status"], "requires_capture");
    assert_eq!(held["amount_captured"], 0);
    assert_eq!(held["amount_capturable"], 6_000);
    assert!(held["expires_at"].is_string() && held["canceled_at"].is_null());
    assert!(held["authorization"].as_str().unwrap().starts_with("auth_"));
    let id = held["id"].as_str().unwrap().to_string();
    assert_eq!(funds(&client, "wallet"), (10_000, 6_000, 4_000));
    assert_eq!(funds(&client, "shop"), (0, 0, 0));
    assert_eq!(
        entries(&client, "wallet").len(),
        1,
        "a hold writes no entry"
    );

    // What is held cannot be spent twice.
    let over = client.charge(
        "spend",
        &json!({"amount": 4_001, "currency": "BRL", "source": "wallet", "destination": "shop"}),
    );
    assert_eq!(over.slug(), "insufficient-funds");
    assert_eq!(
        client.charge("hold-2", &hold_body(4_001)).slug(),
        "insufficient-funds"
    );

    // A partial capture: the rest of the hold is released.
    let captured = capture(&client, &id, "capture-1", &json!({"amount": 4_500}));
    assert_eq!(
        captured.status,
        200,
        "{}",
        String::from_utf8_lossy(&captured.body)
    );
    assert!(!captured.replayed(), "a first capture is not a replay");
    let c = captured.json();
    assert_eq!(
        (
            c["status"].as_str(),
            c["amount_captured"].as_i64(),
            c["amount_capturable"].as_i64()
        ),
        (Some("succeeded"), Some(4_500), Some(0))
    );
    assert!(c["expires_at"].is_null());
    assert_eq!(funds(&client, "wallet"), (5_500, 0, 5_500));
    assert_eq!(funds(&client, "shop"), (4_500, 0, 4_500));
    assert_eq!(entries(&client, "wallet")[0]["amount"], -4_500);
    assert_eq!(entries(&client, "wallet")[0]["charge"], id.as_str());

    // The replay is the same bytes; a second capture or a cancel is 409.
    let again = capture(&client, &id, "capture-1", &json!({"amount": 4_500}));
    assert!(again.replayed());
    assert_eq!(again.body, captured.body);
    let second = capture(&client, &id, "capture-2", &json!({}));
    assert_eq!(
        (second.status, second.slug().as_str()),
        (409, "invalid-charge-state")
    );
    assert_eq!(
        cancel(&client, &id, "cancel-1").slug(),
        "invalid-charge-state"
    );
    assert_eq!((acquirer.captures(), acquirer.voids()), (1, 0));

    // Refunds reach the captured money only.
    let path = format!("/v1/charges/{id}/refunds");
    let too_much = client.post(&path, Some("refund-1"), &json!({"amount": 4_501}));
    assert_eq!(too_much.slug(), "refund-exceeds-charge");
    let refund = client.post(&path, Some("refund-2"), &json!({}));
    assert_eq!(refund.status, 201);
    assert_eq!(refund.json()["amount"], 4_500);
    assert_eq!(acquirer.refunds(), 1);
    assert_eq!(funds(&client, "wallet"), (10_000, 0, 10_000));
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn a_full_capture_and_a_cancel_each_replay_byte_for_byte() {
    let dir = TempDir::new("2p-cancel");
    let (server, client, acquirer) = setup(&dir, 5_000, |_| {});
    let a = hold(&client, "hold-a", 2_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let b = hold(&client, "hold-b", 3_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(funds(&client, "wallet"), (5_000, 5_000, 0));

    let full = capture(&client, &a, "cap-a", &json!({}));
    assert_eq!(full.json()["amount_captured"], 2_000);
    let canceled = cancel(&client, &b, "cancel-b");
    assert_eq!(
        canceled.status,
        200,
        "{}",
        String::from_utf8_lossy(&canceled.body)
    );
    let c = canceled.json();
    assert_eq!(c["status"], "canceled");
    assert_eq!(c["cancellation_reason"], "requested");
    assert!(c["canceled_at"].is_string() && c["expires_at"].is_null());
    assert_eq!(
        (
            c["amount_captured"].as_i64(),
            c["amount_capturable"].as_i64()
        ),
        (Some(0), Some(0))
    );
    assert_eq!(funds(&client, "wallet"), (3_000, 0, 3_000));

    for (resp, path, key, body) in [
        (
            &full,
            format!("/v1/charges/{a}/capture"),
            "cap-a",
            json!({}),
        ),
        (
            &canceled,
            format!("/v1/charges/{b}/cancel"),
            "cancel-b",
            json!({}),
        ),
    ] {
        let again = client.post(&path, Some(key), &body);
        assert!(again.replayed());
        assert_eq!(again.body, resp.body, "{path}");
        // An empty body is `{}`: the same request.
        let empty = client.request("POST", &path, &[("Idempotency-Key", key)], "");
        assert_eq!(empty.body, resp.body, "{path}");
    }
    // A canceled charge cannot be refunded or captured.
    let refund = client.post(
        &format!("/v1/charges/{b}/refunds"),
        Some("re-b"),
        &json!({}),
    );
    assert_eq!(
        (refund.status, refund.slug().as_str()),
        (409, "invalid-charge-state")
    );
    assert_eq!(
        capture(&client, &b, "cap-b", &json!({})).slug(),
        "invalid-charge-state"
    );
    assert_eq!((acquirer.captures(), acquirer.voids()), (1, 1));
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn uncaptured_money_cannot_be_refunded_and_a_capture_over_the_hold_is_422() {
    let dir = TempDir::new("2p-rules");
    let (server, client, acquirer) = setup(&dir, 5_000, |_| {});
    let id = hold(&client, "hold", 1_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let refund = client.post(&format!("/v1/charges/{id}/refunds"), Some("re"), &json!({}));
    assert_eq!(
        (refund.status, refund.slug().as_str()),
        (409, "invalid-charge-state")
    );
    let over = capture(&client, &id, "cap-over", &json!({"amount": 1_001}));
    assert_eq!(
        (over.status, over.slug().as_str()),
        (422, "capture-exceeds-authorization")
    );
    // Stored for its key, and the hold is still there for a capture.
    let again = capture(&client, &id, "cap-over", &json!({"amount": 1_001}));
    assert!(again.replayed() && again.body == over.body);
    assert_eq!(charge(&client, &id)["status"], "requires_capture");
    assert_eq!(acquirer.captures(), 0, "refused before the acquirer");
    assert_eq!(
        capture(&client, &id, "cap", &json!({"amount": 1_000})).status,
        200
    );
    // Unknown charge: 404, stored like any outcome.
    let missing = capture(&client, "ch_nope", "cap-missing", &json!({}));
    assert_eq!(missing.slug(), "not-found");
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn capture_and_cancel_race_the_first_to_reserve_wins_and_the_other_never_calls_the_acquirer() {
    const ROUNDS: usize = 40;
    const CONTENDERS: usize = 6;
    let dir = TempDir::new("2p-race");
    let (server, client, acquirer) = setup(&dir, 1_000_000, |_| {});
    let mut captured = 0;
    for round in 0..ROUNDS {
        let id = hold(&client, &format!("hold-{round}"), 100)["id"]
            .as_str()
            .unwrap()
            .to_string();
        let barrier = Arc::new(Barrier::new(CONTENDERS));
        let answers: Vec<(bool, Resp)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..CONTENDERS)
                .map(|i| {
                    let (client, barrier, id) = (client.clone(), barrier.clone(), id.clone());
                    s.spawn(move || {
                        let key = format!("r{round}-{i}");
                        let is_capture = i % 2 == 0;
                        barrier.wait();
                        let r = if is_capture {
                            capture(&client, &id, &key, &json!({}))
                        } else {
                            cancel(&client, &id, &key)
                        };
                        (is_capture, r)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let winners: Vec<&(bool, Resp)> = answers.iter().filter(|(_, r)| r.status == 200).collect();
        assert_eq!(winners.len(), 1, "round {round}: exactly one wins");
        for (_, r) in answers.iter().filter(|(_, r)| r.status != 200) {
            assert_eq!(r.slug(), "invalid-charge-state", "round {round}");
        }
        let (won_by_capture, resp) = winners[0];
        let status = resp.json()["status"].as_str().unwrap().to_string();
        assert_eq!(
            status,
            if *won_by_capture {
                "succeeded"
            } else {
                "canceled"
            }
        );
        assert_eq!(charge(&client, &id)["status"], status.as_str());
        captured += usize::from(*won_by_capture);
    }
    assert_eq!(
        (acquirer.captures(), acquirer.voids()),
        (captured, ROUNDS - captured),
        "one acquirer call per round, by the winner"
    );
    assert_eq!(funds(&client, "wallet").1, 0, "no hold left");
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn the_reaper_voids_and_releases_holds_past_the_authorization_ttl() {
    let dir = TempDir::new("2p-expiry");
    let (server, client, acquirer) = setup(&dir, 5_000, |c| {
        c.authorization_ttl = Duration::from_millis(300);
    });
    let expiring = hold(&client, "hold-1", 1_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let claimed = hold(&client, "hold-2", 2_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(funds(&client, "wallet"), (5_000, 3_000, 2_000));
    // A capture in time wins over the expiry.
    assert_eq!(capture(&client, &claimed, "cap-2", &json!({})).status, 200);
    std::thread::sleep(Duration::from_millis(400));
    // Past its expiry a capture is refused, even before the reaper runs.
    let late = capture(&client, &expiring, "cap-1", &json!({}));
    assert_eq!(
        (late.status, late.slug().as_str()),
        (409, "invalid-charge-state")
    );
    assert!(late.json()["detail"].as_str().unwrap().contains("expired"));
    server.reap_now();
    let c = charge(&client, &expiring);
    assert_eq!(
        (c["status"].as_str(), c["cancellation_reason"].as_str()),
        (Some("canceled"), Some("expired"))
    );
    assert_eq!(funds(&client, "wallet"), (3_000, 0, 3_000));
    assert_eq!((acquirer.captures(), acquirer.voids()), (1, 1));
    let metrics = String::from_utf8(client.get("/metrics").body).unwrap();
    assert!(
        metrics.contains("idem_authorizations_expired_total 1"),
        "{metrics}"
    );
    server.reap_now();
    assert_eq!(acquirer.voids(), 1, "a second pass has nothing to do");
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn a_decline_after_authorization_voids_the_authorization_before_the_402_is_stored() {
    let dir = TempDir::new("2p-decline");
    let spender: Arc<Mutex<Option<Client>>> = Arc::new(Mutex::new(None));
    let first = Arc::new(AtomicBool::new(true));
    let hook_spender = spender.clone();
    let (server, client, acquirer) = setup(&dir, 1_000, move |c| {
        c.hooks.before_ledger_phase = Some(Arc::new(move |_op: &str| {
            // Once, between the pre-check and the ledger phase of the first
            // charge that gets here, another charge spends the funds.
            let client = hook_spender.lock().unwrap().clone();
            if let Some(client) = client.filter(|_| first.swap(false, Ordering::SeqCst)) {
                {
                    let r = client.charge(
                        "spend-it",
                        &json!({"amount": 900, "currency": "BRL", "source": "wallet",
                                "destination": "shop"}),
                    );
                    assert_eq!(r.status, 201);
                }
            }
        }));
    });
    *spender.lock().unwrap() = Some(client.clone());
    let before_auths = acquirer.calls();
    let r = client.charge("too-late", &hold_body(800));
    assert_eq!((r.status, r.slug().as_str()), (402, "insufficient-funds"));
    assert_eq!(
        acquirer.calls() - before_auths,
        2,
        "both charges were authorised"
    );
    assert_eq!(
        acquirer.voids(),
        1,
        "the declined one's authorization was voided"
    );
    let again = client.charge("too-late", &hold_body(800));
    assert!(again.replayed() && again.body == r.body);
    assert_eq!(acquirer.voids(), 1);
    assert_eq!(funds(&client, "wallet"), (100, 0, 100));
    drop(server);
    support::assert_verified(&dir.db());
}

/// Fails its first `failures` captures, like an acquirer outage.
struct FlakyCaptures {
    failures: usize,
    captures: AtomicUsize,
    inner: Simulator,
}

impl Acquirer for FlakyCaptures {
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        deadline: Instant,
    ) -> Result<AuthorizeOutcome, Unavailable> {
        self.inner
            .authorize(key, amount, currency, capture, deadline)
    }
    fn capture(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: std::time::Instant,
    ) -> Result<(), Unavailable> {
        if self.captures.fetch_add(1, Ordering::SeqCst) < self.failures {
            return Err(Unavailable("connection reset".into()));
        }
        self.inner.capture(key, authorization, amount, deadline)
    }
    fn void(
        &self,
        key: &str,
        authorization: &str,
        deadline: std::time::Instant,
    ) -> Result<(), Unavailable> {
        self.inner.void(key, authorization, deadline)
    }
    fn refund(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: std::time::Instant,
    ) -> Result<(), Unavailable> {
        self.inner.refund(key, authorization, amount, deadline)
    }
}

#[test]
fn a_capture_the_acquirer_cannot_take_answers_503_keeps_its_claim_and_resumes() {
    let dir = TempDir::new("2p-flaky");
    let acquirer = Arc::new(FlakyCaptures {
        failures: 2,
        captures: AtomicUsize::new(0),
        inner: Simulator::new(Duration::ZERO),
    });
    let (server, client) = support::server_with_acquirer(&dir, acquirer.clone(), |_| {});
    client.account("wallet", true);
    let id = hold(&client, "hold", 700)["id"]
        .as_str()
        .unwrap()
        .to_string();
    for _ in 0..2 {
        let r = capture(&client, &id, "cap", &json!({}));
        assert_eq!(
            (r.status, r.slug().as_str()),
            (503, "temporarily-unavailable")
        );
        assert_eq!(r.header("retry-after"), Some("1"));
        // The claim stays with the capture: a cancel meanwhile is refused.
        assert_eq!(
            cancel(&client, &id, "cancel").slug(),
            "invalid-charge-state"
        );
        assert_eq!(charge(&client, &id)["status"], "requires_capture");
    }
    let r = capture(&client, &id, "cap", &json!({}));
    assert_eq!(
        r.status, 200,
        "the retry resumes at once from its recovery point"
    );
    assert_eq!(r.json()["status"], "succeeded");
    assert_eq!(acquirer.captures.load(Ordering::SeqCst), 3);
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn async_capture_answers_202_then_the_operation_holds_the_charge() {
    let dir = TempDir::new("2p-async");
    let (server, client, _) = setup(&dir, 5_000, |_| {});
    let id = hold(&client, "hold", 1_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = client.request(
        "POST",
        &format!("/v1/charges/{id}/capture"),
        &[("Idempotency-Key", "cap"), ("Prefer", "respond-async")],
        "{}",
    );
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    let location = r.header("location").unwrap().to_string();
    let done = support::eventually(Duration::from_secs(10), || {
        let op = client.get(&location).json();
        (op["status"] == "completed").then_some(op)
    });
    assert_eq!(done["response"]["status"], 200);
    assert_eq!(done["response"]["body"]["status"], "succeeded");
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn bad_input_on_capture_and_cancel_is_400_and_changes_nothing() {
    let dir = TempDir::new("2p-bad");
    let (server, client, acquirer) = setup(&dir, 5_000, |_| {});
    let id = hold(&client, "hold", 1_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let capture_path = format!("/v1/charges/{id}/capture");
    let cancel_path = format!("/v1/charges/{id}/cancel");
    let before = (
        charge(&client, &id),
        funds(&client, "wallet"),
        funds(&client, "shop"),
    );
    let key = [("Idempotency-Key", "bad")];
    /// (method, path, headers, body, status, slug).
    type Case<'a> = (
        &'a str,
        &'a str,
        &'a [(&'a str, &'a str)],
        &'a str,
        u16,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        (
            "POST",
            &capture_path,
            &[],
            "{}",
            400,
            "idempotency-key-missing",
        ),
        (
            "POST",
            &cancel_path,
            &[],
            "{}",
            400,
            "idempotency-key-missing",
        ),
        (
            "POST",
            &capture_path,
            &[("Idempotency-Key", "a b")],
            "{}",
            400,
            "idempotency-key-invalid",
        ),
        (
            "POST",
            &capture_path,
            &key,
            r#"{"amount":0}"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &capture_path,
            &key,
            r#"{"amount":-5}"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &capture_path,
            &key,
            r#"{"amount":1.5}"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &capture_path,
            &key,
            r#"{"amount":"10"}"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &capture_path,
            &key,
            r#"{"amount":1000000000000001}"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &capture_path,
            &key,
            r#"{"amount":10,"tip":5}"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &capture_path,
            &key,
            r#"[10]"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &capture_path,
            &key,
            r#"{"amount":"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &cancel_path,
            &key,
            r#"{"amount":10}"#,
            400,
            "invalid-request",
        ),
        (
            "POST",
            &cancel_path,
            &key,
            r#"{"reason":"requested"}"#,
            400,
            "invalid-request",
        ),
        ("GET", &capture_path, &[], "", 405, "method-not-allowed"),
        ("PUT", &cancel_path, &key, "{}", 405, "method-not-allowed"),
    ];
    for (method, path, headers, body, status, slug) in cases {
        let r = client.request(method, path, headers, body);
        assert_eq!(
            (r.status, r.slug().as_str()),
            (status, slug),
            "{method} {path} {body}"
        );
        if status == 405 {
            assert_eq!(r.header("allow"), Some("POST"));
        }
    }
    // Another consumer's charge is absent.
    let other = Client::new(server.addr(), &server.create_consumer("other").unwrap());
    assert_eq!(
        other.post(&capture_path, Some("theirs"), &json!({})).slug(),
        "not-found"
    );
    assert_eq!(
        (
            charge(&client, &id),
            funds(&client, "wallet"),
            funds(&client, "shop")
        ),
        before
    );
    assert_eq!((acquirer.captures(), acquirer.voids()), (0, 0));
    // The key used by the refused requests stays free.
    assert_eq!(
        capture(&client, &id, "bad", &json!({"amount": 10})).status,
        200
    );
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn verify_catches_each_broken_two_phase_invariant() {
    let dir = TempDir::new("2p-verify");
    let (server, client, _) = setup(&dir, 10_000, |_| {});
    let held = hold(&client, "hold", 1_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let captured = hold(&client, "to-capture", 2_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        capture(&client, &captured, "cap", &json!({"amount": 1_500})).status,
        200
    );
    let canceled = hold(&client, "to-cancel", 500)["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(cancel(&client, &canceled, "can").status, 200);
    drop(server);
    support::assert_verified(&dir.db());

    let cases: Vec<(&str, String, &str)> = vec![
        (
            "held",
            "UPDATE accounts SET held = held + 1 WHERE public_id = 'wallet'".into(),
            "held and pending_credit are the sums",
        ),
        (
            "pending",
            "UPDATE accounts SET pending_credit = 0 WHERE public_id = 'shop'".into(),
            "held and pending_credit are the sums",
        ),
        (
            "available",
            "UPDATE accounts SET held = balance + 1, pending_credit = pending_credit \
             WHERE public_id = 'wallet'"
                .into(),
            "less available than 0",
        ),
        (
            "claim",
            format!("UPDATE charges SET claimed_by = 'op_gone' WHERE public_id = '{held}'"),
            "which is not in progress",
        ),
        (
            "entries-on-hold",
            format!(
                "INSERT INTO entries (public_id, account_id, amount, charge_id, created_at) \
                 SELECT 'ent_x', source_id, -1, id, 0 FROM charges WHERE public_id = '{held}'"
            ),
            "has no entries and no refunds",
        ),
        (
            "captured-amount",
            format!("UPDATE charges SET amount_captured = 1400 WHERE public_id = '{captured}'"),
            "has wrong entries",
        ),
        (
            "canceled-status",
            format!(
                "UPDATE charges SET status = 'succeeded', canceled_at = NULL, \
                 cancellation_reason = NULL, amount_captured = 500 WHERE public_id = '{canceled}'"
            ),
            "has wrong entries",
        ),
        (
            "capture-answer",
            format!(
                "UPDATE idempotency_keys SET path = '/v1/charges/{canceled}/capture' \
                 WHERE key = 'cap'"
            ),
            "which it did not produce",
        ),
    ];
    for (name, sql, says) in cases {
        let copy = copy_of(&dir.db(), name);
        tamper(&copy.db(), &sql);
        let (code, report) = support::verify_cli(&copy.db());
        assert_eq!(code, 1, "{name}: verify must fail:\n{report}");
        assert!(
            report.contains(says),
            "{name}: expected '{says}' in:\n{report}"
        );
    }
}

/// A copy of the ledger `db` in a fresh `TempDir`, to tamper with: SQLite's
/// `VACUUM INTO` its file, or on PostgreSQL the copy's database made anew
/// with `db` as its template (no one may be connected to `db` meanwhile).
fn copy_of(db: &Path, tag: &str) -> TempDir {
    let copy = TempDir::new(tag);
    match (
        idem::store::postgres_url(db),
        idem::store::postgres_url(&copy.db()),
    ) {
        (Some(source), Some(target)) => {
            let name = |url: &str| url.rsplit('/').next().unwrap().to_string();
            let admin = support::postgres_admin().expect("IDEM_TEST_POSTGRES");
            let mut pg = postgres::Client::connect(&admin, postgres::NoTls).unwrap();
            pg.batch_execute(&format!("DROP DATABASE {}", name(target)))
                .unwrap();
            pg.batch_execute(&format!(
                "CREATE DATABASE {} TEMPLATE {}",
                name(target),
                name(source)
            ))
            .unwrap();
        }
        _ => {
            rusqlite::Connection::open(db)
                .unwrap()
                .execute("VACUUM INTO ?1", [copy.db().to_str().unwrap()])
                .unwrap();
        }
    }
    copy
}

/// Runs `sql` on the database `db` as a hand edit beside idem would, CHECK
/// constraints off (some tampering breaks one on purpose: that is what a
/// hand edit with checks off, or a bug, would leave): through rusqlite with
/// `ignore_check_constraints` on SQLite; on PostgreSQL through the postgres
/// crate, after dropping the CHECK constraints of `db` (a copy).
fn tamper(db: &Path, sql: &str) {
    match idem::store::postgres_url(db) {
        Some(url) => {
            let mut pg = postgres::Client::connect(url, postgres::NoTls).unwrap();
            pg.batch_execute(
                "DO $$ DECLARE c record; BEGIN \
                   FOR c IN SELECT conrelid::regclass AS t, conname FROM pg_constraint \
                            WHERE contype = 'c' \
                              AND connamespace = current_schema()::regnamespace LOOP \
                     EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', c.t, c.conname); \
                   END LOOP; \
                 END $$",
            )
            .unwrap();
            pg.batch_execute(sql)
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
        None => {
            let conn = rusqlite::Connection::open(db).unwrap();
            conn.execute_batch("PRAGMA ignore_check_constraints = ON")
                .unwrap();
            conn.execute_batch(sql)
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
    }
}

/// The simulator, recording which authorizations it made and voided; the
/// first `authorize` after `stall` is set makes its authorization, then
/// stalls (an owner that is slow past the in-flight timeout).
struct Recording {
    inner: Simulator,
    stall: AtomicBool,
    stalled: AtomicBool,
    authorized: Mutex<Vec<String>>,
    voided: Mutex<Vec<String>>,
}

impl Acquirer for Recording {
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
        capture: bool,
        deadline: Instant,
    ) -> Result<AuthorizeOutcome, Unavailable> {
        let auth = self
            .inner
            .authorize(key, amount, currency, capture, deadline)?;
        if let AuthorizeOutcome::Approved(a) = &auth {
            self.authorized.lock().unwrap().push(a.id.clone());
        }
        if self.stall.swap(false, Ordering::SeqCst) {
            self.stalled.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(1_500));
        }
        Ok(auth)
    }
    fn capture(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: std::time::Instant,
    ) -> Result<(), Unavailable> {
        self.inner.capture(key, authorization, amount, deadline)
    }
    fn void(
        &self,
        key: &str,
        authorization: &str,
        deadline: std::time::Instant,
    ) -> Result<(), Unavailable> {
        self.voided.lock().unwrap().push(authorization.to_string());
        self.inner.void(key, authorization, deadline)
    }
    fn refund(
        &self,
        key: &str,
        authorization: &str,
        amount: i64,
        deadline: std::time::Instant,
    ) -> Result<(), Unavailable> {
        self.inner.refund(key, authorization, amount, deadline)
    }
}

/// An owner authorised, then stalled past the in-flight timeout while the
/// funds were spent; the retry that takes the key over must not answer the
/// pre-check's 402 and leave that authorization open: it asks the acquirer
/// (the same authorization comes back) and the ledger's decline voids it.
#[test]
fn a_takeover_never_leaves_its_predecessors_authorization_dangling() {
    let dir = TempDir::new("2p-dangling");
    let acquirer = Arc::new(Recording {
        inner: Simulator::new(Duration::ZERO),
        stall: AtomicBool::new(false),
        stalled: AtomicBool::new(false),
        authorized: Mutex::new(Vec::new()),
        voided: Mutex::new(Vec::new()),
    });
    let (server, client) = support::server_with_acquirer(&dir, acquirer.clone(), |c| {
        c.inflight_timeout = Duration::from_millis(300);
    });
    client.account("wallet", false);
    let fund =
        json!({"amount": 10_000, "currency": "BRL", "source": "card", "destination": "wallet"});
    assert_eq!(client.charge("fund", &fund).status, 201);
    acquirer.stall.store(true, Ordering::SeqCst);
    let first = {
        let client = client.clone();
        std::thread::spawn(move || client.charge("k1", &hold_body(8_000)))
    };
    support::eventually(Duration::from_secs(10), || {
        acquirer.stalled.load(Ordering::SeqCst).then_some(())
    });
    let spend =
        json!({"amount": 5_000, "currency": "BRL", "source": "wallet", "destination": "shop"});
    assert_eq!(client.charge("spend", &spend).status, 201);
    std::thread::sleep(Duration::from_millis(400));
    let retry = client.charge("k1", &hold_body(8_000));
    assert_eq!(
        (retry.status, retry.slug().as_str()),
        (402, "insufficient-funds")
    );
    let late = first.join().unwrap();
    assert_eq!(late.status, 402, "the stalled owner was fenced off");
    assert!(late.body == retry.body);

    let charged: Vec<String> = client
        .all_charges()
        .iter()
        .map(|c| c["authorization"].as_str().unwrap().to_string())
        .collect();
    let voided = acquirer.voided.lock().unwrap().clone();
    let dangling: Vec<String> = acquirer
        .authorized
        .lock()
        .unwrap()
        .iter()
        .filter(|a| !charged.contains(a) && !voided.contains(a))
        .cloned()
        .collect();
    assert!(
        dangling.is_empty(),
        "neither charged nor voided: {dangling:?}"
    );
    assert_eq!(funds(&client, "wallet"), (5_000, 0, 5_000));
    drop(server);
    support::assert_verified(&dir.db());
}

#[test]
fn the_authorization_ttl_is_bounded_so_a_hold_is_never_born_expired() {
    let dir = TempDir::new("2p-ttl");
    let db = dir.db();
    for ttl in ["366d", "10000000000000000000ms", "0s"] {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args([
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--authorization-ttl",
            ttl,
            "--db",
        ])
        .arg(&db);
        if let Some(store) = support::acquirer_store(&db) {
            cmd.arg("--acquirer-store").arg(store);
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{ttl}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--authorization-ttl"), "{ttl}: {err}");
    }
    if support::on_postgres() {
        let tables: i64 = support::inspect(&db, |c| {
            c.query_value(
                "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()",
                &[],
            )
        });
        assert_eq!(tables, 0, "a refused flag creates nothing");
    } else {
        assert!(!db.exists(), "a refused flag creates nothing");
    }
    let err = idem::Server::start_temporary(|c| {
        c.authorization_ttl = Duration::from_secs(u64::MAX);
    })
    .err()
    .expect("an embedder's endless TTL is refused too");
    assert!(err.to_string().contains("365d"), "{err}");

    // The longest TTL works: a hold a year out, capturable now.
    let (server, client, _) = setup(&dir, 5_000, |c| {
        c.authorization_ttl = idem::config::AUTHORIZATION_TTL_MAX;
    });
    let held = hold(&client, "h", 1_000);
    assert!(
        held["expires_at"].as_str().unwrap() > "2027-",
        "{}",
        held["expires_at"]
    );
    let id = held["id"].as_str().unwrap();
    assert_eq!(capture(&client, id, "cap", &json!({})).status, 200);
    drop(server);
}

/// `idem verify` holds the ledger against the acquirer simulator's own
/// books: after a real server's holds, captures, cancels, sales, refunds and
/// a void after a decline, they agree; each kind of disagreement, written
/// into a copy of the simulator's file, is reported.
#[test]
fn verify_holds_the_ledger_against_the_acquirers_books() {
    let dir = TempDir::new("2p-agreement");
    let db = dir.db();
    let server = support::ChildServer::start(&db, &[], &[]);
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    client.account("wallet", false);
    let fund =
        json!({"amount": 10_000, "currency": "BRL", "source": "card", "destination": "wallet"});
    assert_eq!(client.charge("fund", &fund).status, 201);
    let held = hold(&client, "held", 1_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    let captured = hold(&client, "to-capture", 2_000)["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        capture(&client, &captured, "cap", &json!({"amount": 1_500})).status,
        200
    );
    let canceled = hold(&client, "to-cancel", 500)["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(cancel(&client, &canceled, "can").status, 200);
    let refund = client.post(
        &format!("/v1/charges/{captured}/refunds"),
        Some("re"),
        &json!({"amount": 300}),
    );
    assert_eq!(refund.status, 201);
    let sale = client.charge(
        "sale",
        &json!({"amount": 700, "currency": "BRL", "source": "wallet", "destination": "shop"}),
    );
    let sale_auth = sale.json()["authorization"].as_str().unwrap().to_string();
    server.kill();
    support::assert_verified(&db);
    // Fold the simulator's WAL into its file, so that a copy of the file is
    // whole.
    let simulator = support::simulator_file(&db);
    rusqlite::Connection::open(&simulator)
        .unwrap()
        .execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
        .unwrap();

    let auth_of = |charge: &str| -> String {
        support::inspect(&db, |c| {
            c.query_value(
                "SELECT authorization_id FROM charges WHERE public_id = ?1",
                &[&charge as &dyn idem::store::Arg],
            )
        })
    };
    let cases = [
        ("open", format!("UPDATE authorizations SET state = 'authorized', captured = 0 WHERE authorization_id = '{sale_auth}'"), "is open at the acquirer"),
        ("captured", format!("UPDATE authorizations SET captured = 1400 WHERE authorization_id = '{}'", auth_of(&captured)), "captured 1400 at the acquirer"),
        ("voided", format!("UPDATE authorizations SET state = 'voided' WHERE authorization_id = '{}'", auth_of(&held)), "was voided at the acquirer"),
        ("refunded", format!("UPDATE authorizations SET refunded = 0 WHERE authorization_id = '{}'", auth_of(&captured)), "refunded 300 in the ledger, 0 at the acquirer"),
        ("not-voided", format!("UPDATE authorizations SET state = 'authorized' WHERE authorization_id = '{}'", auth_of(&canceled)), "its charge"),
    ];
    // The ledger stays as it is; each case is a tampered copy of the
    // simulator's file (SQLite on either backend), named to `idem verify`.
    for (name, sql, says) in cases {
        let copy = dir.0.join(format!("{name}.acquirer.sqlite"));
        std::fs::copy(&simulator, &copy).unwrap();
        rusqlite::Connection::open(&copy)
            .unwrap()
            .execute_batch(&sql)
            .unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["verify", "--db"])
            .arg(&db)
            .arg("--acquirer-store")
            .arg(&copy)
            .output()
            .unwrap();
        let code = out.status.code().unwrap_or(-1);
        let report = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(code, 1, "{name}: verify must fail:\n{report}");
        assert!(
            report.contains(says),
            "{name}: expected '{says}' in:\n{report}"
        );
    }
}
