//! The transactional outbox through HTTP against real servers: one event
//! per state change, with the resource as it was right after the change; no
//! event from a replay, a 409, a 422, a 402 or bad input; exactly one from
//! concurrent duplicates; the stored bytes served by GET and in lists;
//! paging, the type filter and other consumers' events; retention by the
//! reaper; and `idem verify` catching a missing or a doubled event.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use serde_json::{json, Value};
use support::{Client, CountingAcquirer, TempDir};

fn setup(dir: &TempDir, configure: impl FnOnce(&mut idem::Config)) -> (idem::Server, Client) {
    let (server, client) = support::server_with_acquirer(dir, CountingAcquirer::new(), configure);
    (server, client)
}

/// Every event of the client's consumer, newest first, following pages.
fn all_events(client: &Client, filter: &str) -> Vec<Value> {
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut path = format!("/v1/events?limit=7{filter}");
        if let Some(id) = &after {
            path.push_str(&format!("&starting_after={id}"));
        }
        let r = client.get(&path);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let page = r.json();
        let data = page["data"].as_array().unwrap().clone();
        after = data.last().map(|e| e["id"].as_str().unwrap().to_string());
        all.extend(data);
        if page["has_more"] != json!(true) {
            return all;
        }
    }
}

fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .rev()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect()
}

/// Changes the ledger behind idem's back, on either backend, to show that
/// `idem verify` notices: `sql` is written once with `?N` placeholders.
fn tamper(db: &Path, sql: &str, args: &[&str]) -> usize {
    if support::on_postgres() {
        let url = db.to_str().expect("a PostgreSQL URL");
        let mut client = postgres::Client::connect(url, postgres::NoTls).expect("connect");
        let args: Vec<&(dyn postgres::types::ToSql + Sync)> = args
            .iter()
            .map(|a| a as &(dyn postgres::types::ToSql + Sync))
            .collect();
        client
            .execute(sql.replace('?', "$").as_str(), &args)
            .unwrap_or_else(|e| panic!("{sql}: {e}")) as usize
    } else {
        rusqlite::Connection::open(db)
            .unwrap()
            .execute(sql, rusqlite::params_from_iter(args))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

#[test]
fn every_state_change_writes_one_event_with_the_resource_after_it() {
    let dir = TempDir::new("events-each");
    let (_server, client) = setup(&dir, |_| {});
    // card and shop were created by the setup.
    client.account("wallet", false);
    let fund = client.charge(
        "fund",
        &json!({"amount": 10_000, "currency": "BRL",
        "source": "card", "destination": "wallet"}),
    );
    assert_eq!(fund.status, 201);
    let hold = |key: &str, amount: i64| {
        let r = client.charge(
            key,
            &json!({"amount": amount, "currency": "BRL",
            "source": "wallet", "destination": "shop", "capture": false}),
        );
        assert_eq!(r.status, 201);
        r.json()
    };
    let h1 = hold("hold-1", 3000);
    let captured = client.post(
        &format!("/v1/charges/{}/capture", h1["id"].as_str().unwrap()),
        Some("cap-1"),
        &json!({"amount": 2500}),
    );
    assert_eq!(captured.status, 200);
    let h2 = hold("hold-2", 1000);
    let canceled = client.post(
        &format!("/v1/charges/{}/cancel", h2["id"].as_str().unwrap()),
        Some("cancel-2"),
        &json!({}),
    );
    assert_eq!(canceled.status, 200);
    let refund = client.post(
        &format!(
            "/v1/charges/{}/refunds",
            fund.json()["id"].as_str().unwrap()
        ),
        Some("refund-1"),
        &json!({"amount": 100}),
    );
    assert_eq!(refund.status, 201);

    let events = all_events(&client, "");
    assert_eq!(
        types(&events),
        [
            "account.created",
            "account.created",
            "account.created",
            "charge.succeeded",
            "charge.authorized",
            "charge.captured",
            "charge.authorized",
            "charge.canceled",
            "refund.created",
        ]
    );
    // Each event carries the resource exactly as its change answered it.
    let by_type = |t: &str| -> Vec<Value> {
        events
            .iter()
            .filter(|e| e["type"] == t)
            .map(|e| e["data"]["object"].clone())
            .collect()
    };
    assert_eq!(by_type("charge.succeeded"), [fund.json()]);
    assert_eq!(by_type("charge.captured"), [captured.json()]);
    assert_eq!(by_type("charge.canceled"), [canceled.json()]);
    assert_eq!(by_type("refund.created"), [refund.json()]);
    let authorized = by_type("charge.authorized");
    assert!(authorized.contains(&h1) && authorized.contains(&h2));
    assert_eq!(
        by_type("charge.canceled")[0]["cancellation_reason"],
        "requested"
    );
    for e in &events {
        assert_eq!(e["object"], "event");
        assert!(e["id"].as_str().unwrap().starts_with("evt_"));
        assert!(e["created_at"].as_str().unwrap().ends_with('Z'));
        // GET /v1/events/{id} serves the very bytes stored, equal to the
        // list's member.
        let one = client.get(&format!("/v1/events/{}", e["id"].as_str().unwrap()));
        assert_eq!(one.status, 200);
        assert_eq!(one.header("content-type"), Some("application/json"));
        assert_eq!(&one.json(), e);
        let public_id = e["id"].as_str().unwrap();
        let stored: Vec<u8> = support::inspect(&dir.db(), |c| {
            c.query_value(
                "SELECT body FROM events WHERE public_id = ?1",
                &[&public_id as &dyn idem::store::Arg],
            )
        });
        assert_eq!(one.body, stored);
    }
    // New entries take ent_.
    let entries = client.get("/v1/accounts/wallet/entries").json();
    assert!(entries["data"][0]["id"]
        .as_str()
        .unwrap()
        .starts_with("ent_"));
    support::assert_verified(&dir.db());
}

#[test]
fn replays_conflicts_refusals_and_bad_input_write_no_event() {
    let dir = TempDir::new("events-none");
    let (_server, client) = setup(&dir, |_| {});
    client.account("wallet", false);
    let body = json!({"amount": 500, "currency": "BRL", "source": "card", "destination": "wallet"});
    assert_eq!(client.charge("k1", &body).status, 201);
    let hold = client.charge(
        "h1",
        &json!({"amount": 100, "currency": "BRL",
        "source": "wallet", "destination": "shop", "capture": false}),
    );
    let hold_id = hold.json()["id"].as_str().unwrap().to_string();
    let cancel = format!("/v1/charges/{hold_id}/cancel");
    assert_eq!(client.post(&cancel, Some("c1"), &json!({})).status, 200);
    let before = all_events(&client, "").len();

    // A replay of each kind of write.
    assert!(client.charge("k1", &body).replayed());
    assert!(client.post(&cancel, Some("c1"), &json!({})).replayed());
    let again = client.post(
        "/v1/accounts",
        None,
        &json!({"id": "wallet", "currency": "BRL", "allow_negative": false}),
    );
    assert!(again.replayed());
    // 422: a key reused with another body; a natural id with other fields.
    assert_eq!(
        client
            .charge(
                "k1",
                &json!({"amount": 501, "currency": "BRL",
        "source": "card", "destination": "wallet"})
            )
            .status,
        422
    );
    assert_eq!(
        client
            .post(
                "/v1/accounts",
                None,
                &json!({"id": "wallet", "currency": "USD"})
            )
            .status,
        422
    );
    // 409: a cancel of a canceled hold.
    let conflict = client.post(&cancel, Some("c2"), &json!({}));
    assert_eq!(
        (conflict.status, conflict.slug().as_str()),
        (409, "invalid-charge-state")
    );
    // 402: not enough in the wallet.
    let poor = client.charge(
        "k2",
        &json!({"amount": 1_000_000, "currency": "BRL",
        "source": "wallet", "destination": "shop"}),
    );
    assert_eq!(poor.status, 402);
    // 404 and 400.
    assert_eq!(
        client
            .charge(
                "k3",
                &json!({"amount": 1, "currency": "BRL",
        "source": "nobody", "destination": "shop"})
            )
            .status,
        404
    );
    assert_eq!(
        client
            .charge(
                "k4",
                &json!({"amount": 1.5, "currency": "BRL",
        "source": "card", "destination": "shop"})
            )
            .status,
        400
    );
    assert_eq!(all_events(&client, "").len(), before);
    support::assert_verified(&dir.db());
}

#[test]
fn concurrent_duplicates_write_one_event() {
    let dir = TempDir::new("events-race");
    let (_server, client) = setup(&dir, |_| {});
    let threads = 32;
    for round in 0..5 {
        let barrier = Arc::new(Barrier::new(threads));
        let key = format!("race-{round}");
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (client, barrier, key) = (client.clone(), barrier.clone(), key.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    client.charge(&key, &support::charge_body(100)).status
                })
            })
            .collect();
        let statuses: Vec<u16> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            statuses.iter().all(|s| [201, 409].contains(s)),
            "{statuses:?}"
        );
    }
    // Every key settles (409s were answered while the owner ran).
    for round in 0..5 {
        let r = support::eventually(Duration::from_secs(10), || {
            let r = client.charge(&format!("race-{round}"), &support::charge_body(100));
            (r.status == 201).then_some(r)
        });
        assert!(r.replayed());
    }
    let succeeded = all_events(&client, "&type=charge.succeeded");
    assert_eq!(succeeded.len(), 5);
    let mut per_charge = BTreeMap::new();
    for e in &succeeded {
        *per_charge
            .entry(e["data"]["object"]["id"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    assert!(per_charge.values().all(|n| *n == 1), "{per_charge:?}");
    support::assert_verified(&dir.db());
}

#[test]
fn lists_page_newest_first_filter_by_type_and_stay_per_consumer() {
    let dir = TempDir::new("events-list");
    let (server, client) = setup(&dir, |_| {});
    for i in 0..12 {
        assert_eq!(
            client
                .charge(&format!("k{i}"), &support::charge_body(10 + i))
                .status,
            201
        );
    }
    let all = all_events(&client, "");
    assert_eq!(all.len(), 14);
    let ids: Vec<&str> = all.iter().map(|e| e["id"].as_str().unwrap()).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    assert_eq!(ids, sorted, "newest first");
    let charges = all_events(&client, "&type=charge.succeeded");
    assert_eq!(charges.len(), 12);
    assert_eq!(charges[0]["data"]["object"]["amount"], 21);
    assert_eq!(all_events(&client, "&type=account.created").len(), 2);
    assert_eq!(all_events(&client, "&type=refund.created").len(), 0);
    let first = client.get("/v1/events?limit=1").json();
    assert_eq!(first["has_more"], true);
    assert_eq!(first["data"][0], all[0]);

    for (query, field) in [
        ("type=charge.refunded", "type"),
        ("type=", "type"),
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("starting_after=evt_nope", "starting_after"),
        ("status=applied", "status"),
    ] {
        let r = client.get(&format!("/v1/events?{query}"));
        assert_eq!(r.status, 400, "{query}");
        assert_eq!(r.slug(), "invalid-request");
        assert!(
            r.json()["detail"].as_str().unwrap().contains(field),
            "{query}"
        );
    }
    assert_eq!(client.get("/v1/events/evt_0000").slug(), "not-found");
    let post = client.post("/v1/events", None, &json!({}));
    assert_eq!(post.status, 405);
    assert_eq!(post.header("allow"), Some("GET, HEAD"));

    // Another consumer sees none of them, and cannot read one by id.
    let other = Client::new(server.addr(), &server.create_consumer("other").unwrap());
    assert_eq!(all_events(&other, "").len(), 0);
    let r = other.get(&format!("/v1/events/{}", ids[0]));
    assert_eq!((r.status, r.slug().as_str()), (404, "not-found"));
    let unauth = support::send(server.addr(), "GET", "/v1/events", &[], b"").unwrap();
    assert_eq!(unauth.status, 401);
}

#[test]
fn the_reaper_deletes_events_past_retention_and_verify_still_holds() {
    let dir = TempDir::new("events-retention");
    // The reaper runs when the test says (`reap_now`), so nothing is
    // deleted before the events are counted, however slow the machine.
    let (server, client) = setup(&dir, |c| {
        c.event_retention = Duration::from_millis(300);
    });
    for i in 0..5 {
        assert_eq!(
            client
                .charge(&format!("k{i}"), &support::charge_body(10))
                .status,
            201
        );
    }
    assert_eq!(all_events(&client, "").len(), 7);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(client.charge("late", &support::charge_body(10)).status, 201);
    server.reap_now();
    // Past retention: gone; the late charge's event stays.
    let left = all_events(&client, "");
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0]["type"], "charge.succeeded");
    // The charges stay; verify knows their events are gone to retention.
    assert_eq!(client.all_charges().len(), 6);
    server.shutdown();
    support::assert_verified(&dir.db());
}

#[test]
fn verify_finds_a_missing_a_doubled_and_a_stray_event() {
    let dir = TempDir::new("events-verify");
    let (server, client) = setup(&dir, |_| {});
    let charge = client.charge("k1", &support::charge_body(10)).json();
    let id = charge["id"].as_str().unwrap().to_string();
    server.shutdown();
    support::assert_verified(&dir.db());
    let db = dir.db();

    // Doubled.
    tamper(
        &db,
        "INSERT INTO events (consumer_id, public_id, type, object_id, body, created_at) \
         SELECT consumer_id, public_id || 'x', type, object_id, body, created_at FROM events \
         WHERE object_id = ?1",
        &[&id],
    );
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1);
    assert!(report.contains("has 2 charge.succeeded events"), "{report}");

    // Missing.
    tamper(&db, "DELETE FROM events WHERE object_id = ?1", &[&id]);
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1);
    assert!(
        report.contains(&format!("{id} has no charge.succeeded event")),
        "{report}"
    );

    // Stray: a charge.captured for a charge that was captured at once.
    tamper(
        &db,
        "INSERT INTO events (consumer_id, public_id, type, object_id, body, created_at) \
         SELECT consumer_id, 'evt_stray', 'charge.captured', ?1, '{}', 0 FROM charges \
         WHERE public_id = ?1",
        &[&id],
    );
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1);
    assert!(report.contains("which is not in that state"), "{report}");
}

#[test]
fn an_expired_hold_writes_charge_canceled_with_its_reason() {
    let dir = TempDir::new("events-expiry");
    let (_server, client) = setup(&dir, |c| {
        c.authorization_ttl = Duration::from_millis(200);
        c.reaper_interval = Duration::from_millis(100);
    });
    let hold = client.charge(
        "h",
        &json!({"amount": 100, "currency": "BRL",
        "source": "card", "destination": "shop", "capture": false}),
    );
    assert_eq!(hold.status, 201);
    let canceled = support::eventually(Duration::from_secs(10), || {
        all_events(&client, "&type=charge.canceled").pop()
    });
    assert_eq!(canceled["data"]["object"]["id"], hold.json()["id"]);
    assert_eq!(canceled["data"]["object"]["status"], "canceled");
    assert_eq!(canceled["data"]["object"]["cancellation_reason"], "expired");
    support::assert_verified(&dir.db());
}
