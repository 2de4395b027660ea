//! The client against a real embedded server, with no sandbox directive: a
//! lost answer (a proxy that drops it), a slow acquirer holding the key
//! (409 and `Retry-After`), one intent on many threads, a key reused, and
//! the business answers that are final.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{LossyProxy, accounts, assert_one_charge_per_intent, charge, client, fast_policy};
use idem_client::{Capture, Client, Error, NewCharge, RetryPolicy, slug};

#[test]
fn a_lost_answer_is_retried_under_the_same_key_and_replayed() {
    let server = common::server(|_| {});
    let direct = client(server.url(), &server, fast_policy());
    accounts(&direct);
    let proxy = LossyProxy::start(server.addr(), 1);
    let lossy = client(&proxy.url, &server, fast_policy());
    let intent = lossy.intent();
    let reply = intent.create_charge(&charge(4990, intent.key())).unwrap();
    assert_eq!(proxy.dropped.load(Ordering::SeqCst), 1);
    // The first attempt committed and its answer was lost; the second got
    // the stored answer, not a second charge.
    assert_eq!(
        (reply.attempts, reply.replayed, reply.status),
        (2, true, 201)
    );
    assert_one_charge_per_intent(&direct, &[intent.key().to_string()], 4990);
}

#[test]
fn threads_that_each_lose_an_answer_charge_once_per_intent() {
    const THREADS: usize = 16;
    let server = common::server(|_| {});
    let direct = client(server.url(), &server, fast_policy());
    accounts(&direct);
    let proxy = LossyProxy::start(server.addr(), THREADS as u32);
    let lossy = client(&proxy.url, &server, fast_policy());
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let lossy = lossy.clone();
            std::thread::spawn(move || {
                let intent = lossy.intent();
                let reply = intent.create_charge(&charge(100, intent.key())).unwrap();
                (intent.key().to_string(), reply)
            })
        })
        .collect();
    let mut intents = Vec::new();
    let mut retries = 0;
    for t in threads {
        let (key, reply) = t.join().unwrap();
        // The proxy drops the first THREADS answers whoever they belong
        // to, so one intent may lose two and another none: an intent that
        // lost an answer gets the stored one back, one that lost none got
        // its first.
        assert_eq!(
            reply.replayed,
            reply.attempts > 1,
            "{key}: {} attempt(s)",
            reply.attempts
        );
        retries += reply.attempts - 1;
        intents.push(key);
    }
    let dropped = proxy.dropped.load(Ordering::SeqCst);
    assert_eq!(dropped, THREADS as u32);
    assert_eq!(retries, dropped, "each lost answer cost one retry");
    assert_one_charge_per_intent(&direct, &intents, 100);
}

#[test]
fn one_intent_retried_from_many_threads_charges_once() {
    const THREADS: usize = 8;
    let server = common::server(|config| slow_acquirer(config, 300));
    let in_use = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&in_use);
    let client = Client::builder(server.url(), server.initial_key().unwrap())
        .policy(RetryPolicy {
            per_request_timeout: Duration::from_secs(2),
            ..fast_policy()
        })
        .on_retry(move |r| {
            if r.cause
                .problem()
                .is_some_and(|p| p.is(slug::IDEMPOTENCY_KEY_IN_USE))
            {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        })
        .build()
        .unwrap();
    accounts(&client);
    let key = client.intent().key().to_string();
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let (client, key) = (client.clone(), key.clone());
            std::thread::spawn(move || {
                let intent = client.intent_with_key(&key).unwrap();
                intent.create_charge(&charge(250, &key)).unwrap()
            })
        })
        .collect();
    let replies: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let id = &replies[0].value.id;
    assert!(
        replies.iter().all(|r| &r.value.id == id),
        "one charge for all"
    );
    assert_eq!(replies.iter().filter(|r| !r.replayed).count(), 1);
    assert!(
        in_use.load(Ordering::SeqCst) >= THREADS - 1,
        "the others met 409 and waited"
    );
    assert_one_charge_per_intent(&client, &[key], 250);
}

/// An acquirer that takes `ms`, and an in-flight timeout long enough for
/// it (the acquirer's own timeout is half of it).
fn slow_acquirer(config: &mut idem::Config, ms: u64) {
    config.acquirer_latency = Duration::from_millis(ms);
    config.inflight_timeout = Duration::from_secs(10);
}

/// Arrival times of `POST /v1/charges` at the server's handler.
fn arrivals(config: &mut idem::Config) -> Arc<Mutex<Vec<Instant>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    config.hooks.before_handler = Some(Arc::new(move |method: &str, path: &str| {
        if method == "POST" && path == "/v1/charges" {
            log.lock().unwrap().push(Instant::now());
        }
    }));
    seen
}

#[test]
fn a_409_is_retried_no_sooner_than_its_retry_after() {
    // The seed's story with a slow acquirer: the first attempt outlives the
    // client's per-request timeout and is still running when the retry
    // comes; the retry is told 409 with `Retry-After: 1`, waits that long
    // (measured at the server), and gets the one charge.
    let mut seen = None;
    let server = common::server(|config| {
        slow_acquirer(config, 1200);
        seen = Some(arrivals(config));
    });
    let seen = seen.unwrap();
    let causes = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&causes);
    let client = Client::builder(server.url(), server.initial_key().unwrap())
        .policy(RetryPolicy {
            per_request_timeout: Duration::from_millis(150),
            ..fast_policy()
        })
        .on_retry(move |r| {
            log.lock()
                .unwrap()
                .push((r.attempt, r.cause.status(), r.delay))
        })
        .build()
        .unwrap();
    accounts(&client);
    let intent = client.intent();
    let reply = intent.create_charge(&charge(4990, intent.key())).unwrap();
    assert!(reply.replayed, "the first attempt's charge, replayed");
    let causes = causes.lock().unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len() as u32, reply.attempts);
    assert_eq!(causes[0].1, None, "the first attempt timed out");
    let conflicts: Vec<_> = causes.iter().filter(|c| c.1 == Some(409)).collect();
    assert!(!conflicts.is_empty(), "{causes:?}");
    for (attempt, _, delay) in conflicts {
        assert!(*delay >= Duration::from_secs(1), "{delay:?}");
        let gap = seen[*attempt as usize] - seen[*attempt as usize - 1];
        assert!(gap >= Duration::from_secs(1), "attempt {attempt}: {gap:?}");
    }
    assert_one_charge_per_intent(&client, &[intent.key().to_string()], 4990);
}

#[test]
fn a_retry_after_beyond_the_deadline_ends_the_call_at_once() {
    let server = common::server(|config| slow_acquirer(config, 1500));
    let owner = client(server.url(), &server, RetryPolicy::default());
    accounts(&owner);
    let intent = owner.intent();
    let key = intent.key().to_string();
    let first = std::thread::spawn({
        let owner = owner.clone();
        let key = key.clone();
        move || {
            owner
                .intent_with_key(&key)
                .unwrap()
                .create_charge(&charge(700, &key))
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let hurried = client(
        server.url(),
        &server,
        RetryPolicy {
            deadline: Duration::from_millis(800),
            ..fast_policy()
        },
    );
    let started = Instant::now();
    let e = hurried
        .intent_with_key(&key)
        .unwrap()
        .create_charge(&charge(700, &key))
        .unwrap_err();
    let Error::GaveUp { attempts, last, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!(*attempts, 1, "{e}");
    assert!(last.problem().unwrap().is(slug::IDEMPOTENCY_KEY_IN_USE));
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "no sleep to the deadline"
    );
    // The owner finishes; the intent moved the money once.
    assert!(!first.join().unwrap().unwrap().replayed);
    assert_one_charge_per_intent(&owner, &[key], 700);
}

#[test]
fn a_reused_key_is_the_callers_bug_and_is_not_retried() {
    let mut seen = None;
    let server = common::server(|config| seen = Some(arrivals(config)));
    let seen = seen.unwrap();
    let client = client(server.url(), &server, fast_policy());
    accounts(&client);
    let intent = client.intent();
    intent.create_charge(&charge(4990, intent.key())).unwrap();
    let e = intent
        .create_charge(&charge(5990, intent.key()))
        .unwrap_err();
    let Error::KeyReused(p) = &e else {
        panic!("{e}")
    };
    assert_eq!(
        (p.status, p.slug.as_str()),
        (422, slug::IDEMPOTENCY_KEY_REUSED)
    );
    assert!(e.to_string().contains("bug"), "{e}");
    assert_eq!(seen.lock().unwrap().len(), 2, "one attempt each, no retry");
    assert_one_charge_per_intent(&client, &[intent.key().to_string()], 4990);
}

#[test]
fn business_answers_are_typed_and_final() {
    let mut seen = None;
    let server = common::server(|config| seen = Some(arrivals(config)));
    let seen = seen.unwrap();
    let client = client(server.url(), &server, fast_policy());
    accounts(&client);
    client
        .create_account(&idem_client::NewAccount::new("USD").id("usd"))
        .unwrap();
    let cases = [
        (
            NewCharge::new(1, "BRL", "shop", "card"),
            402,
            slug::INSUFFICIENT_FUNDS,
        ),
        (
            NewCharge::new(1, "BRL", "card", "nobody"),
            404,
            slug::ACCOUNT_NOT_FOUND,
        ),
        (
            NewCharge::new(1, "BRL", "card", "usd"),
            422,
            slug::CURRENCY_MISMATCH,
        ),
        (
            NewCharge::new(0, "BRL", "card", "shop"),
            400,
            slug::INVALID_REQUEST,
        ),
    ];
    for (body, status, slug) in &cases {
        let e = client.create_charge(body).unwrap_err();
        let Error::Problem(p) = &e else { panic!("{e}") };
        assert_eq!((p.status, p.slug.as_str()), (*status, *slug), "{p}");
        assert!(!p.title.is_empty());
        assert_eq!(p.retry_after, None);
    }
    assert_eq!(seen.lock().unwrap().len(), cases.len(), "none retried");
    // A 409 that is not about a key in use is a business answer too.
    let sale = client.create_charge(&charge(10, "sale")).unwrap().value;
    let e = client.capture(&sale.id, &Capture::default()).unwrap_err();
    assert!(e.problem().unwrap().is(slug::INVALID_CHARGE_STATE), "{e}");
    // A wrong key: 401, final.
    let stranger = Client::builder(server.url(), "sk_nobody")
        .policy(fast_policy())
        .build()
        .unwrap();
    let e = stranger.get_account("shop").unwrap_err();
    assert_eq!(
        (e.status(), e.problem().unwrap().slug.as_str()),
        (Some(401), slug::UNAUTHORIZED)
    );
}

#[test]
fn replays_are_flagged_on_every_route() {
    let server = common::server(|_| {});
    let client = client(server.url(), &server, fast_policy());
    accounts(&client);
    let hold = client.intent();
    let first = hold
        .create_charge(&charge(1000, "hold").capture(false))
        .unwrap();
    let again = hold
        .create_charge(&charge(1000, "hold").capture(false))
        .unwrap();
    assert_eq!((first.replayed, again.replayed), (false, true));
    assert_eq!(first.value, again.value);
    let capture = client.intent();
    let captured = capture
        .capture(&first.value.id, &Capture::amount(600))
        .unwrap();
    let replay = capture
        .capture(&first.value.id, &Capture::amount(600))
        .unwrap();
    assert_eq!((captured.status, captured.replayed), (200, false));
    assert_eq!((replay.status, replay.replayed), (200, true));
    assert_eq!(replay.value.amount_captured, 600);
    let refund = client.intent();
    let r1 = refund
        .refund(&first.value.id, &idem_client::NewRefund::amount(100))
        .unwrap();
    let r2 = refund
        .refund(&first.value.id, &idem_client::NewRefund::amount(100))
        .unwrap();
    assert_eq!(
        (r1.replayed, r2.replayed, r1.value.id == r2.value.id),
        (false, true, true)
    );
    assert_eq!(client.get_account("shop").unwrap().value.balance, 500);
    let entries = client
        .list_entries("shop", &idem_client::Page::default())
        .unwrap()
        .value;
    assert_eq!(entries.data.iter().map(|e| e.amount).sum::<i64>(), 500);
}
