//! The client against a sandbox server (`Config::sandbox`) under every
//! `Idem-Simulate` directive of the contract: each intent, retried by the
//! client, moves the money exactly once (checked through the HTTP API), and
//! the seed's story — a 30 s client timeout, a charge done at 34 s — plays
//! out in well under a second.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{accounts, assert_one_charge_per_intent, charge, client, fast_policy};
use idem::sandbox::{Directive, Simulation};
use idem_client::{Capture, Client, Error, NewRefund, RetryPolicy, slug};

fn sandbox() -> idem::Server {
    common::server(|config| config.sandbox = true)
}

#[test]
fn the_seeds_timeout_and_late_charge_in_under_a_second() {
    // The terminal gives up on an attempt after 100 ms (the seed's 30 s);
    // the server commits the charge and answers only after 300 ms (34 s).
    let server = sandbox();
    let client = client(
        server.url(),
        &server,
        RetryPolicy {
            per_request_timeout: Duration::from_millis(100),
            ..fast_policy()
        },
    );
    accounts(&client);
    let started = Instant::now();
    let intent = client.intent().simulate("response=delay:300ms");
    let reply = intent.create_charge(&charge(4990, intent.key())).unwrap();
    let elapsed = started.elapsed();
    assert_eq!(
        (reply.attempts, reply.replayed, reply.status),
        (2, true, 201)
    );
    assert!(elapsed < Duration::from_millis(500), "{elapsed:?}");
    assert_one_charge_per_intent(&client, &[intent.key().to_string()], 4990);
}

/// What the client's call on an intent must end in under a directive.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// One charge, from the first attempt's effect, answered by a replay.
    Replayed,
    /// One charge, whoever made it (the retry, a takeover or the reaper).
    Charged,
    /// A final 402 `card-declined`, and no charge.
    Declined,
}

fn intents_under(directive: &str, threads: usize, expect: Expect) {
    let server = sandbox();
    let client = client(server.url(), &server, fast_policy());
    accounts(&client);
    let directive = directive.to_string();
    let runs: Vec<_> = (0..threads)
        .map(|_| {
            let (client, directive) = (client.clone(), directive.clone());
            std::thread::spawn(move || {
                let intent = client.intent().simulate(&directive);
                let result = intent.create_charge(&charge(100, intent.key()));
                // The same intent again, after the fact: the same outcome,
                // never a second effect.
                let again = intent.create_charge(&charge(100, intent.key()));
                (intent.key().to_string(), result, again)
            })
        })
        .collect();
    let mut intents = Vec::new();
    for run in runs {
        let (key, result, again) = run.join().unwrap();
        match expect {
            Expect::Declined => {
                for r in [&result, &again] {
                    let e = r.as_ref().unwrap_err();
                    assert!(
                        matches!(e, Error::Problem(p) if p.is(slug::CARD_DECLINED) && p.status == 402),
                        "{directive}: {e}"
                    );
                }
            }
            Expect::Replayed | Expect::Charged => {
                let reply = result.unwrap_or_else(|e| panic!("{directive}: {e}"));
                if let Expect::Replayed = expect {
                    assert!(
                        reply.replayed && reply.attempts >= 2,
                        "{directive}: {reply:?}"
                    );
                }
                let again = again.unwrap();
                assert!(again.replayed);
                assert_eq!(again.value.id, reply.value.id);
                intents.push(key);
            }
        }
    }
    assert_one_charge_per_intent(&client, &intents, 100);
    server.shutdown();
}

#[test]
fn acquirer_decline_is_final_and_charges_nothing() {
    intents_under("acquirer=decline", 8, Expect::Declined);
}

#[test]
fn acquirer_unavailable_is_retried_and_charges_once() {
    intents_under("acquirer=unavailable", 8, Expect::Charged);
}

#[test]
fn a_slow_acquirer_charges_once() {
    intents_under("acquirer-latency=50ms", 8, Expect::Charged);
}

#[test]
fn thirty_two_dropped_answers_charge_once_each() {
    intents_under("response=drop", 32, Expect::Replayed);
}

#[test]
fn delayed_answers_past_the_timeout_charge_once_each() {
    // fast_policy: 200 ms per attempt.
    intents_under("response=delay:400ms", 8, Expect::Replayed);
}

#[test]
fn a_503_after_the_effect_charges_once() {
    intents_under("response=503", 8, Expect::Replayed);
}

#[test]
fn a_crash_after_reserve_charges_once() {
    intents_under("crash=after-reserve", 8, Expect::Charged);
}

#[test]
fn a_crash_after_the_acquirer_charges_once() {
    intents_under("crash=after-acquirer", 8, Expect::Charged);
}

#[test]
fn thirty_two_crashes_after_commit_charge_once_each() {
    intents_under("crash=after-commit", 32, Expect::Replayed);
}

#[test]
fn an_acquirer_always_unavailable_ends_at_the_deadline_and_the_intent_resumes() {
    // No reaper pass during the test: the reaper would finish the unlocked
    // charge from its recovery point on its own (the ledger converges
    // without the client), and this test is about the client alone.
    let server = common::server(|config| {
        config.sandbox = true;
        config.reaper_interval = Duration::from_secs(600);
    });
    server
        .simulate(
            Simulation::new()
                .matching("/v1/charges")
                .times(1000)
                .fault(Directive::AcquirerUnavailable),
        )
        .unwrap();
    let waits = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&waits);
    let client = Client::builder(server.url(), server.initial_key().unwrap())
        .policy(RetryPolicy {
            deadline: Duration::from_millis(1500),
            ..fast_policy()
        })
        .on_retry(move |r| log.lock().unwrap().push((r.cause.status(), r.delay)))
        .build()
        .unwrap();
    accounts(&client);
    let intent = client.intent();
    let started = Instant::now();
    let e = intent
        .create_charge(&charge(300, intent.key()))
        .unwrap_err();
    let elapsed = started.elapsed();
    let Error::GaveUp { attempts, last, .. } = &e else {
        panic!("{e}")
    };
    let p = last.problem().unwrap();
    assert_eq!(
        (p.status, p.slug.as_str()),
        (503, slug::TEMPORARILY_UNAVAILABLE)
    );
    assert_eq!(p.retry_after, Some(Duration::from_secs(1)));
    // Retry-After 1 s honoured: one wait of at least 1 s, then a second
    // 503 whose Retry-After would end past the deadline, so it stops there.
    assert_eq!(*attempts, 2, "{e}");
    assert!(
        waits
            .lock()
            .unwrap()
            .iter()
            .all(|(s, d)| *s == Some(503) && *d >= Duration::from_secs(1))
    );
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_millis(1500),
        "{elapsed:?}"
    );
    assert!(
        client.all_charges().unwrap().is_empty(),
        "a 503 stores nothing"
    );
    // The outage ends; the same intent, retried later, charges once.
    server.clear_simulations();
    let reply = intent.create_charge(&charge(300, intent.key())).unwrap();
    assert_eq!((reply.status, reply.replayed), (201, false));
    assert_one_charge_per_intent(&client, &[intent.key().to_string()], 300);
}

#[test]
fn captures_and_refunds_survive_lost_answers_once() {
    let server = sandbox();
    let client = client(server.url(), &server, fast_policy());
    accounts(&client);
    let hold = client
        .create_charge(&charge(1000, "hold").capture(false))
        .unwrap()
        .value;
    let capture = client.intent().simulate("response=drop");
    let captured = capture.capture(&hold.id, &Capture::amount(800)).unwrap();
    assert!(captured.replayed);
    assert_eq!(captured.value.amount_captured, 800);
    let refund = client.intent().simulate("crash=after-commit");
    let refunded = refund.refund(&hold.id, &NewRefund::amount(300)).unwrap();
    assert_eq!(refunded.value.amount, 300);
    let charge = client.get_charge(&hold.id).unwrap().value;
    assert_eq!((charge.amount_captured, charge.amount_refunded), (800, 300));
    assert_eq!(client.get_account("shop").unwrap().value.balance, 500);
    assert_eq!(client.get_account("card").unwrap().value.balance, -500);
}

#[test]
fn a_server_without_sandbox_refuses_the_header() {
    let server = common::server(|_| {});
    let client = client(server.url(), &server, fast_policy());
    accounts(&client);
    let intent = client.intent().simulate("response=drop");
    let e = intent.create_charge(&charge(1, intent.key())).unwrap_err();
    assert!(
        matches!(&e, Error::Problem(p) if p.status == 400 && p.is("simulation-disabled")),
        "{e}"
    );
    assert!(client.all_charges().unwrap().is_empty());
}
