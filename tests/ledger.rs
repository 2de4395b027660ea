//! Ledger behaviour through HTTP: bad input changes nothing, business
//! outcomes are stored and replayed, natural idempotency by `reference`,
//! refunds, lists, tenant isolation on every route, and `idem verify`.

mod support;

use serde_json::{json, Value};
use support::{charge_body, Client, Resp};

fn server() -> (idem::Server, Client) {
    support::server(|_| {})
}

/// Everything a consumer can observe of its ledger.
fn snapshot(client: &Client) -> Value {
    json!({
        "card": client.get("/v1/accounts/card").json(),
        "shop": client.get("/v1/accounts/shop").json(),
        "card_entries": client.get("/v1/accounts/card/entries?limit=100").json(),
        "charges": client.all_charges(),
    })
}

/// (method, path, extra headers, body, expected status, expected slug)
type Case<'a> = (
    &'a str,
    &'a str,
    Vec<(&'a str, &'a str)>,
    String,
    u16,
    &'a str,
);

#[test]
fn bad_input_gets_its_slug_and_changes_nothing() {
    let (server, client) = server();
    client.charge("seed", &charge_body(100));
    let before = snapshot(&client);
    let key = [("Idempotency-Key", "bad-1")];
    let auth = format!("Bearer {}", client.key);
    let big = format!(
        r#"{{"amount":1,"currency":"BRL","source":"card","destination":"shop","description":"{}"}}"#,
        "x".repeat(70_000)
    );
    let fifty_one: serde_json::Map<String, Value> =
        (0..51).map(|i| (format!("k{i}"), json!("v"))).collect();
    let many_keys = json!({"amount": 1, "currency": "BRL", "source": "card", "destination": "shop", "metadata": fifty_one}).to_string();
    #[rustfmt::skip]
    let cases: Vec<Case> = vec![
        ("POST", "/v1/charges", key.to_vec(), "{".into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), "[]".into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":1,"currency":"BRL","source":"card","destination":"shop","tip":1}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":1.0,"currency":"BRL","source":"card","destination":"shop"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":0,"currency":"BRL","source":"card","destination":"shop"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":1000000000000001,"currency":"BRL","source":"card","destination":"shop"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":99999999999999999999,"currency":"BRL","source":"card","destination":"shop"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":"5","currency":"BRL","source":"card","destination":"shop"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":5,"currency":"brl","source":"card","destination":"shop"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":5,"currency":"BRL","source":"card","destination":"card"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":5,"currency":"BRL","source":"card"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), format!(r#"{{"amount":5,"currency":"BRL","source":"card","destination":"shop","reference":"{}"}}"#, "r".repeat(129)), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), format!(r#"{{"amount":5,"currency":"BRL","source":"card","destination":"shop","description":"{}"}}"#, "d".repeat(501)), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), r#"{"amount":5,"currency":"BRL","source":"card","destination":"shop","metadata":{"n":1}}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), many_keys, 400, "invalid-request"),
        ("POST", "/v1/charges", key.to_vec(), big, 413, "body-too-large"),
        ("POST", "/v1/charges", vec![], charge_body(5).to_string(), 400, "idempotency-key-missing"),
        ("POST", "/v1/charges", vec![("Idempotency-Key", "a b")], charge_body(5).to_string(), 400, "idempotency-key-invalid"),
        ("POST", "/v1/accounts", vec![], r#"{"currency":"BRL","id":"bad id"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/accounts", vec![], r#"{"currency":"BRL","allow_negative":"yes"}"#.into(), 400, "invalid-request"),
        ("POST", "/v1/charges/nope/refunds", key.to_vec(), r#"{"amount":-1}"#.into(), 400, "invalid-request"),
        ("DELETE", "/v1/charges", vec![], String::new(), 405, "method-not-allowed"),
        ("GET", "/v1/refunds", vec![], String::new(), 404, "not-found"),
        ("GET", "/v1/charges/ch_missing", vec![], String::new(), 404, "not-found"),
        ("GET", "/v1/charges?limit=0", vec![], String::new(), 400, "invalid-request"),
        ("GET", "/v1/charges?limit=101", vec![], String::new(), 400, "invalid-request"),
        ("GET", "/v1/charges?starting_after=ch_missing", vec![], String::new(), 400, "invalid-request"),
    ];
    for (method, path, extra, body, status, slug) in cases {
        let mut headers = vec![("Authorization", auth.as_str())];
        headers.extend(extra);
        let r = support::send(server.addr(), method, path, &headers, body.as_bytes()).unwrap();
        let shown: String = body.chars().take(80).collect();
        assert_eq!(
            (r.status, r.slug().as_str()),
            (status, slug),
            "{method} {path} {shown}"
        );
        if status == 405 {
            assert_eq!(r.header("allow"), Some("GET, HEAD, POST"));
        }
        assert_eq!(
            snapshot(&client),
            before,
            "{method} {path} {shown} changed the ledger"
        );
    }
    // Unauthenticated requests: 401 before anything else, even unknown routes.
    for (headers, path) in [
        (vec![], "/v1/charges"),
        (vec![("Authorization", "Bearer sk_wrong")], "/v1/charges"),
        (vec![("Authorization", "Basic abc")], "/v1/accounts/card"),
        (vec![], "/v1/nowhere"),
    ] {
        let r = support::send(server.addr(), "GET", path, &headers, b"").unwrap();
        assert_eq!(
            (r.status, r.slug().as_str()),
            (401, "unauthorized"),
            "{path}"
        );
        assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{path}");
    }
    let health = support::send(server.addr(), "GET", "/healthz", &[], b"").unwrap();
    assert_eq!(
        (health.status, health.json()),
        (200, json!({"status": "ok"}))
    );
    // The key of every rejected request above is still free.
    assert_eq!(client.charge("bad-1", &charge_body(5)).status, 201);
}

fn assert_replayed_problem(first: &Resp, again: &Resp, status: u16, slug: &str) {
    assert_eq!((first.status, first.slug().as_str()), (status, slug));
    assert_eq!(again.status, status);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

#[test]
fn business_outcomes_are_stored_and_replayed() {
    let (_server, client) = server();
    client.post(
        "/v1/accounts",
        None,
        &json!({"id": "usd", "currency": "USD"}),
    );
    let broke = json!({"amount": 5, "currency": "BRL", "source": "shop", "destination": "card"});
    let first = client.charge("k402", &broke);
    // Even after the shop has funds, the key's answer stays 402.
    client.charge("fund", &charge_body(100));
    let again = client.charge("k402", &broke);
    assert_replayed_problem(&first, &again, 402, "insufficient-funds");

    let missing = json!({"amount": 5, "currency": "BRL", "source": "card", "destination": "ghost"});
    let first = client.charge("k404", &missing);
    client.post(
        "/v1/accounts",
        None,
        &json!({"id": "ghost", "currency": "BRL"}),
    );
    let again = client.charge("k404", &missing);
    assert_replayed_problem(&first, &again, 404, "account-not-found");

    let mixed = json!({"amount": 5, "currency": "BRL", "source": "card", "destination": "usd"});
    let first = client.charge("k422", &mixed);
    let again = client.charge("k422", &mixed);
    assert_replayed_problem(&first, &again, 422, "currency-mismatch");

    assert_eq!(client.all_charges().len(), 1, "declines create no charge");
    assert_eq!(client.balance("shop"), 100);
    assert_eq!(
        client.get("/v1/accounts/usd/entries").json()["data"],
        json!([])
    );
}

#[test]
fn reference_is_natural_idempotency() {
    let (_server, client) = server();
    let mut body = charge_body(900);
    body["reference"] = json!("invoice-77");
    let first = client.charge("k1", &body);
    assert_eq!(first.status, 201);
    let by_reference = client.charge("k2", &body);
    assert_eq!(by_reference.status, 200);
    assert!(by_reference.replayed());
    assert_eq!(by_reference.json()["id"], first.json()["id"]);
    let k2_again = client.charge("k2", &body);
    assert_eq!((k2_again.status, &k2_again.body), (200, &by_reference.body));
    let mut changed = body.clone();
    changed["amount"] = json!(901);
    let mismatch = client.charge("k3", &changed);
    assert_eq!(
        (mismatch.status, mismatch.slug().as_str()),
        (422, "resource-mismatch")
    );
    assert_eq!(client.all_charges().len(), 1);
    assert_eq!(client.balance("shop"), 900);
}

#[test]
fn refunds_reverse_entries_and_never_exceed_the_charge() {
    let (_server, client) = server();
    let charge = client.charge("c", &charge_body(1000)).json();
    let id = charge["id"].as_str().unwrap();
    let path = format!("/v1/charges/{id}/refunds");
    let part = client.post(&path, Some("r1"), &json!({"amount": 300}));
    assert_eq!(part.status, 201);
    let refund = part.json();
    assert_eq!(
        (
            refund["object"].clone(),
            refund["charge"].clone(),
            refund["amount"].clone()
        ),
        (json!("refund"), json!(id), json!(300))
    );
    assert!(refund["id"].as_str().unwrap().starts_with("re_"));
    let replay = client.post(&path, Some("r1"), &json!({"amount": 300}));
    assert!(replay.replayed());
    assert_eq!(replay.body, part.body);
    let over = client.post(&path, Some("r2"), &json!({"amount": 701}));
    assert_eq!(
        (over.status, over.slug().as_str()),
        (422, "refund-exceeds-charge")
    );
    let rest = client.post(&path, Some("r3"), &json!({}));
    assert_eq!(
        (rest.status, rest.json()["amount"].clone()),
        (201, json!(700))
    );
    let nothing_left = client.post(&path, Some("r4"), &json!({}));
    assert_eq!(nothing_left.slug(), "refund-exceeds-charge");
    assert_eq!(
        client.get(&format!("/v1/charges/{id}")).json()["amount_refunded"],
        1000
    );
    assert_eq!((client.balance("card"), client.balance("shop")), (0, 0));
    let entries = client.get("/v1/accounts/shop/entries").json();
    let data = entries["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert_eq!(data[0]["amount"], -700);
    assert_eq!(data[0]["refund"], rest.json()["id"]);
    assert_eq!(data[0]["charge"], id);
    assert_eq!(data[2]["amount"], 1000);
    assert_eq!(data[2]["refund"], Value::Null);
    let unknown = client.post("/v1/charges/ch_nope/refunds", Some("r5"), &json!({}));
    assert_eq!(
        (unknown.status, unknown.slug().as_str()),
        (404, "not-found")
    );
}

#[test]
fn refund_that_would_overdraw_the_destination_is_402() {
    let (_server, client) = server();
    client.account("payout", false);
    let charge = client.charge("c", &charge_body(1000)).json();
    let pay_out =
        json!({"amount": 900, "currency": "BRL", "source": "shop", "destination": "payout"});
    assert_eq!(client.charge("p", &pay_out).status, 201);
    let path = format!("/v1/charges/{}/refunds", charge["id"].as_str().unwrap());
    let r = client.post(&path, Some("r"), &json!({}));
    assert_eq!((r.status, r.slug().as_str()), (402, "insufficient-funds"));
    assert_eq!(client.balance("shop"), 100);
    assert_eq!(
        client
            .get(&format!("/v1/charges/{}", charge["id"].as_str().unwrap()))
            .json()["amount_refunded"],
        0
    );
}

#[test]
fn lists_page_newest_first() {
    let (_server, client) = server();
    let ids: Vec<String> = (0..25)
        .map(|i| {
            client.charge(&format!("k{i}"), &charge_body(i + 1)).json()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let first = client.get("/v1/charges").json();
    assert_eq!(first["object"], "list");
    assert_eq!(first["data"].as_array().unwrap().len(), 10, "default limit");
    assert_eq!(first["data"][0]["id"], ids[24].as_str());
    assert_eq!(first["has_more"], true);
    let all: Vec<String> = client
        .all_charges()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    let mut newest_first = ids.clone();
    newest_first.reverse();
    assert_eq!(all, newest_first);
    let last = client
        .get(&format!("/v1/charges?limit=5&starting_after={}", ids[4]))
        .json();
    assert_eq!(last["data"].as_array().unwrap().len(), 4);
    assert_eq!(last["has_more"], false);
    let entries = client.get("/v1/accounts/shop/entries?limit=3").json();
    assert_eq!(entries["data"][0]["amount"], 25);
    assert_eq!(entries["data"][0]["object"], "entry");
    assert!(entries["data"][0]["id"]
        .as_str()
        .unwrap()
        .starts_with("ent_"));
}

/// Every route, with another consumer's ids and idempotency keys: 404
/// exactly like ids that do not exist, and nothing changes for the owner.
#[test]
fn tenant_isolation_on_every_route() {
    let (server, alice) = server();
    let charge = alice.charge("a", &charge_body(50)).json();
    let charge_id = charge["id"].as_str().unwrap();
    let op = alice.request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "op"), ("Prefer", "respond-async")],
        &charge_body(1).to_string(),
    );
    let op_path = op.header("location").unwrap().to_string();
    let before = snapshot(&alice);

    let mallory = Client::new(server.addr(), &server.create_consumer("mallory").unwrap());
    let cases: Vec<(&str, String, Option<Value>, &str)> = vec![
        ("GET", "/v1/accounts/card".into(), None, "not-found"),
        ("GET", "/v1/accounts/card/entries".into(), None, "not-found"),
        ("GET", format!("/v1/charges/{charge_id}"), None, "not-found"),
        ("GET", op_path.clone(), None, "not-found"),
        (
            "POST",
            format!("/v1/charges/{charge_id}/refunds"),
            Some(json!({})),
            "not-found",
        ),
        (
            "POST",
            "/v1/charges".into(),
            Some(charge_body(50)),
            "account-not-found",
        ),
    ];
    for (method, path, body, slug) in cases {
        let r = match body {
            // Alice's own idempotency key and body: never her stored answer.
            Some(b) => mallory.post(&path, Some("a"), &b),
            None => mallory.get(&path),
        };
        assert_eq!(
            (r.status, r.slug().as_str()),
            (404, slug),
            "{method} {path}"
        );
    }
    assert_eq!(mallory.get("/v1/charges").json()["data"], json!([]));
    // Mallory's own natural ids do not collide with Alice's.
    assert_eq!(
        mallory
            .post(
                "/v1/accounts",
                None,
                &json!({"id": "card", "currency": "BRL"})
            )
            .status,
        201
    );
    support::eventually(std::time::Duration::from_secs(5), || {
        (alice.get(&op_path).json()["status"] == "completed").then_some(())
    });
    let mut after = snapshot(&alice);
    // The async charge completed meanwhile; compare everything but it.
    after["charges"]
        .as_array_mut()
        .unwrap()
        .retain(|c| c["amount"] != 1);
    let mut before = before;
    before["charges"]
        .as_array_mut()
        .unwrap()
        .retain(|c| c["amount"] != 1);
    assert_eq!(after["charges"], before["charges"]);
    assert_eq!(
        alice.get(&format!("/v1/charges/{charge_id}")).json()["amount_refunded"],
        0
    );
}

/// Runs `sql` on the database `db` behind idem's back, on either backend:
/// how a test shows that `idem verify` notices a tampered ledger. The
/// number of rows changed, or the engine's refusal.
fn tamper(db: &std::path::Path, sql: &str) -> Result<u64, String> {
    if support::on_postgres() {
        let url = db.to_str().expect("a PostgreSQL URL");
        postgres::Client::connect(url, postgres::NoTls)
            .expect("connect")
            .execute(sql, &[])
            .map_err(|e| e.to_string())
    } else {
        rusqlite::Connection::open(db)
            .expect("open")
            .execute(sql, [])
            .map(|n| n as u64)
            .map_err(|e| e.to_string())
    }
}

#[test]
fn verify_passes_on_a_healthy_ledger_and_fails_on_a_tampered_one() {
    let (server, client) = server();
    let charge = client.charge("c", &charge_body(500)).json();
    client.post(
        &format!("/v1/charges/{}/refunds", charge["id"].as_str().unwrap()),
        Some("r"),
        &json!({"amount": 100}),
    );
    let mut with_reference = charge_body(70);
    with_reference["reference"] = json!("inv-1");
    assert_eq!(client.charge("ref-1", &with_reference).status, 201);
    assert_eq!(client.charge("by-ref", &with_reference).status, 200);
    let db = server.db_path().to_path_buf();
    support::assert_verified(&db);

    tamper(
        &db,
        "UPDATE accounts SET balance = balance + 1 WHERE public_id = 'shop'",
    )
    .unwrap();
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1, "{report}");
    assert!(report.contains("balances sum to zero"), "{report}");
    assert!(
        report.contains("balance equals the sum of its entries"),
        "{report}"
    );
    tamper(
        &db,
        "UPDATE accounts SET balance = balance - 1 WHERE public_id = 'shop'",
    )
    .unwrap();
    support::assert_verified(&db);

    // A key whose stored answer names another key's charge.
    tamper(
        &db,
        "UPDATE idempotency_keys SET response_body = (SELECT response_body FROM \
         idempotency_keys WHERE key = 'by-ref') WHERE key = 'c'",
    )
    .unwrap();
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1);
    assert!(report.contains("which it did not produce"), "{report}");

    tamper(&db, "UPDATE charges SET amount_refunded = amount + 1").unwrap_err();
    // A refund's entry filed under another charge.
    tamper(
        &db,
        "UPDATE entries SET charge_id = (SELECT id FROM charges WHERE reference = 'inv-1') \
         WHERE refund_id IS NOT NULL AND amount > 0",
    )
    .unwrap();
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1);
    assert!(report.contains("names another charge"), "{report}");
    tamper(
        &db,
        "DELETE FROM entries WHERE refund_id IS NOT NULL AND amount < 0",
    )
    .unwrap();
    let (code, report) = support::verify_cli(&db);
    assert_eq!(code, 1);
    assert!(report.contains("refund"), "{report}");
}

/// Two keys with one `reference`, the second sent while the first waits for
/// the acquirer: the second is told the reference is in use (its key stays
/// free), the acquirer authorises once, and a later retry is the reference
/// replay.
#[test]
fn one_reference_never_reaches_the_acquirer_twice() {
    let (server, client) = support::server(|c| {
        c.acquirer_latency = std::time::Duration::from_millis(600);
    });
    let mut body = charge_body(300);
    body["reference"] = json!("order-9");
    let c = client.clone();
    let b = body.clone();
    let first = std::thread::spawn(move || c.charge("key-a", &b));
    support::wait_for_key(server.db_path(), "key-a");
    let second = client.charge("key-b", &body);
    assert_eq!(
        (second.status, second.slug().as_str()),
        (409, "reference-in-use")
    );
    assert_eq!(second.header("retry-after"), Some("1"));
    let first = first.join().unwrap();
    assert_eq!(first.status, 201);
    let retry = client.charge("key-b", &body);
    assert_eq!(
        retry.status, 200,
        "the key was left free, now a reference replay"
    );
    assert_eq!(retry.json()["id"], first.json()["id"]);
    let journal = support::journal(server.db_path()).unwrap();
    assert_eq!(journal.len(), 1, "one acquirer call: {journal:?}");
    support::assert_verified(server.db_path());
}

/// The number of key rows holding `key`, read from the server's database.
fn key_rows(db: &std::path::Path, key: &str) -> i64 {
    support::inspect(db, |c| {
        c.query_value(
            "SELECT count(*) FROM idempotency_keys WHERE key = ?1",
            &[&key as &dyn idem::store::Arg],
        )
    })
}

/// A body that names a member twice — at the top, inside `metadata`, inside
/// an array of objects, or spelled with escapes that unescape to the same
/// name — is 400 `invalid-request` naming the member's path, on every POST
/// route, before anything is stored: the ledger is exactly as before and
/// the key stays free, so a later valid request with it is a new request.
/// (serde_json keeps the last member, so `{"amount":1,"amount":1000000}`
/// charged 1,000,000 while anything reading the first saw 1.)
#[test]
fn duplicate_members_are_refused_at_every_depth_and_change_nothing() {
    let (server, client) = server();
    let charge = client.charge("seed", &charge_body(500)).json();
    let refunds = format!("/v1/charges/{}/refunds", charge["id"].as_str().unwrap());
    let before = snapshot(&client);
    let accounts_before = client.get("/v1/accounts/dup-acct").status;
    assert_eq!(accounts_before, 404);
    let tail = r#""currency":"BRL","source":"card","destination":"shop""#;
    let deep = |depth: usize, inner: &str| {
        // `depth` nested objects under metadata.k, the innermost `inner`.
        let open: String = (0..depth).map(|_| r#"{"d":"#).collect();
        let close = "}".repeat(depth);
        format!(r#"{{"amount":1,{tail},"metadata":{{"k":{open}{inner}{close}}}}}"#)
    };
    let deep_path = format!("metadata.k{}.x", ".d".repeat(100));
    #[rustfmt::skip]
    let cases: Vec<(&str, String, &str)> = vec![
        ("/v1/charges", format!(r#"{{"amount":1,"amount":1000000,{tail}}}"#), "amount"),
        ("/v1/charges", format!(r#"{{"amount":1000000,{tail},"amount":1}}"#), "amount"),
        ("/v1/charges", format!(r#"{{"amount":1,"\u0061mount":1000000,{tail}}}"#), "amount"),
        ("/v1/charges", format!(r#"{{"am\u006Fun\u0074":1,"amount":1,{tail}}}"#), "amount"),
        ("/v1/charges", format!(r#"{{"amount":1,{tail},"source":"card"}}"#), "source"),
        ("/v1/charges", format!(r#"{{"amount":1,{tail},"metadata":{{"k":"a","k":"b"}}}}"#), "metadata.k"),
        ("/v1/charges", format!(r#"{{"amount":1,{tail},"metadata":{{"k":"a","\u006b":"a"}}}}"#), "metadata.k"),
        ("/v1/charges", format!(r#"{{"amount":1,{tail},"metadata":{{"l":[{{"x":1}},{{"x":1,"x":2}}]}}}}"#), "metadata.l[1].x"),
        ("/v1/charges", format!(r#"{{"amount":1,{tail},"metadata":{{"a b":{{"x":1,"x":2}}}}}}"#), r#"metadata["a b"].x"#),
        ("/v1/charges", deep(100, r#"{"x":1,"x":2}"#), &deep_path),
        ("/v1/accounts", r#"{"id":"dup-acct","currency":"BRL","currency":"USD"}"#.into(), "currency"),
        ("/v1/accounts", r#"{"id":"dup-acct","currency":"BRL","id":"dup-acct"}"#.into(), "id"),
        ("/v1/accounts", r#"{"id":"dup-acct","currency":"BRL","metadata":{"s":"1","s":"2"}}"#.into(), "metadata.s"),
        (&refunds, r#"{"amount":1,"amount":400}"#.into(), "amount"),
        (&refunds, r#"{"amount":1,"\u0061mount":1}"#.into(), "amount"),
    ];
    for (path, body, member) in &cases {
        let r = client.request("POST", path, &[("Idempotency-Key", "dup-key")], body);
        let shown: String = body.chars().take(100).collect();
        assert_eq!(
            (r.status, r.slug().as_str()),
            (400, "invalid-request"),
            "{path} {shown}"
        );
        let detail = r.json()["detail"].as_str().unwrap().to_string();
        assert_eq!(
            detail,
            format!("{member}: duplicate member (each name may appear once per object)"),
            "{path} {shown}"
        );
        assert_eq!(
            snapshot(&client),
            before,
            "{path} {shown} changed the ledger"
        );
        assert_eq!(key_rows(server.db_path(), "dup-key"), 0, "{path} {shown}");
    }
    assert_eq!(client.get("/v1/accounts/dup-acct").status, 404);
    // The key stayed free on each route: a valid request with it is new.
    let ok = client.charge("dup-key", &charge_body(1));
    assert_eq!((ok.status, ok.replayed()), (201, false));
    assert_eq!(ok.json()["amount"], 1);
    let refund = client.post(&refunds, Some("dup-key"), &json!({"amount": 1}));
    assert_eq!((refund.status, refund.replayed()), (201, false));
    let account = client.post(
        "/v1/accounts",
        Some("dup-key"),
        &json!({"id": "dup-acct", "currency": "BRL"}),
    );
    assert_eq!((account.status, account.replayed()), (201, false));
    support::assert_verified(server.db_path());
}

/// serde_json's `Value` reads an object whose first member is named
/// `$serde_json::private::RawValue` as the JSON text in that member's string:
/// a proxy would see one string member while idem charged the body hidden
/// inside it. The name is an unknown field like any other.
#[test]
fn a_member_named_like_serde_jsons_raw_value_token_is_an_unknown_field() {
    let (server, client) = server();
    let before = snapshot(&client);
    let inner =
        r#"{\"amount\":700,\"currency\":\"BRL\",\"source\":\"card\",\"destination\":\"shop\"}"#;
    let body = format!(r#"{{"$serde_json::private::RawValue":"{inner}"}}"#);
    let r = client.request("POST", "/v1/charges", &[("Idempotency-Key", "raw")], &body);
    assert_eq!(
        (r.status, r.slug().as_str()),
        (400, "invalid-request"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(
        r.json()["detail"],
        "$serde_json::private::RawValue: unknown field"
    );
    assert_eq!(snapshot(&client), before);
    assert_eq!(key_rows(server.db_path(), "raw"), 0);
}

/// Nesting is bounded (serde_json's recursion limit: 127 nested arrays or
/// objects parse, the 128th is refused) and a body nested as deep as 64 KiB
/// allows is refused on a real worker thread without harm to the server.
#[test]
fn deeply_nested_bodies_are_refused_without_harm() {
    let (server, client) = server();
    let before = snapshot(&client);
    // The body object and metadata are two levels; `n` arrays nest below.
    let nested = |n: usize| {
        format!(
            r#"{{"amount":1,"currency":"BRL","source":"card","destination":"shop","metadata":{{"k":{}{}}}}}"#,
            "[".repeat(n),
            "]".repeat(n)
        )
    };
    let detail = |r: &Resp| r.json()["detail"].as_str().unwrap().to_string();
    let post =
        |body: &str| client.request("POST", "/v1/charges", &[("Idempotency-Key", "deep")], body);
    let at_limit = post(&nested(125));
    assert_eq!(
        (at_limit.status, at_limit.slug().as_str()),
        (400, "invalid-request")
    );
    assert_eq!(
        detail(&at_limit),
        "metadata.k: must be a string",
        "127 levels parse"
    );
    for n in [126, 30_000] {
        let r = post(&nested(n));
        assert_eq!(
            (r.status, r.slug().as_str()),
            (400, "invalid-request"),
            "{n}"
        );
        assert!(
            detail(&r).starts_with("malformed JSON: recursion limit exceeded"),
            "{n}: {}",
            detail(&r)
        );
    }
    assert_eq!(snapshot(&client), before);
    assert_eq!(key_rows(server.db_path(), "deep"), 0);
    assert_eq!(client.charge("deep", &charge_body(3)).status, 201);
}

/// Metadata may name a key like serde_json's raw-value token: it is kept,
/// answered, listed and compared exactly as sent — never read as the JSON
/// text inside its value, neither from the body nor when idem reads back
/// what it stored (the request in its key row, the ledger's metadata).
#[test]
fn metadata_named_like_the_raw_value_token_is_kept_as_sent() {
    let (server, client) = server();
    let metadata = json!({"$serde_json::private::RawValue": "{\"a\":\"b\"}", "n": "1"});
    let mut body = charge_body(40);
    body["metadata"] = metadata.clone();
    let created = client.charge("token", &body);
    assert_eq!(
        created.status,
        201,
        "{}",
        String::from_utf8_lossy(&created.body)
    );
    assert_eq!(created.json()["metadata"], metadata);
    let id = created.json()["id"].as_str().unwrap().to_string();
    assert_eq!(
        client.get(&format!("/v1/charges/{id}")).json()["metadata"],
        metadata
    );
    assert_eq!(client.all_charges()[0]["metadata"], metadata);
    let replay = client.charge("token", &body);
    assert!(replay.replayed());
    assert_eq!(replay.body, created.body);

    let account = json!({"id": "token-acct", "currency": "BRL", "metadata": metadata});
    let first = client.post("/v1/accounts", None, &account);
    assert_eq!(first.status, 201);
    assert_eq!(first.json()["metadata"], metadata);
    let again = client.post("/v1/accounts", None, &account);
    assert_eq!(
        (again.status, again.replayed()),
        (200, true),
        "{}",
        String::from_utf8_lossy(&again.body)
    );
    assert_eq!(
        client.get("/v1/accounts/token-acct").json()["metadata"],
        metadata
    );
    support::assert_verified(server.db_path());
}
