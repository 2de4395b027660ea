//! Inbound notifications through HTTP against real servers: sources,
//! Standard Webhooks signatures (signed here by the independent
//! `standardwebhooks` crate), the sender's `webhook-id` as the idempotency
//! key, chargebacks and their disputes, notifications that overtake their
//! authorization (both orders, and a crash between them), a crash inside
//! the notification's writer command, and `idem verify` after each.

mod support;

use std::path::Path;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use support::{charge_body, ChildServer, Client, Resp, TempDir};

fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A sender: a source's id and secret, signing as the acquirer would.
#[derive(Clone)]
struct Sender {
    addr: std::net::SocketAddr,
    source: String,
    secret: String,
}

impl Sender {
    fn create(client: &Client, name: &str) -> Sender {
        let r = client.post("/v1/notification_sources", None, &json!({"name": name}));
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        let body = r.json();
        Sender {
            addr: client.addr,
            source: body["id"].as_str().unwrap().to_string(),
            secret: body["secret"].as_str().unwrap().to_string(),
        }
    }

    fn signature(&self, id: &str, ts: i64, body: &[u8]) -> String {
        standardwebhooks::Webhook::new(&self.secret)
            .unwrap()
            .sign(id, ts, body)
            .unwrap()
    }

    /// Sends `headers` and `body` to this source's route, no bearer key.
    fn raw(&self, headers: &[(&str, &str)], body: &[u8]) -> std::io::Result<Resp> {
        let path = format!("/v1/notifications/{}", self.source);
        support::send(self.addr, "POST", &path, headers, body)
    }

    /// Signs and delivers `body` as `id`, now.
    fn deliver(&self, id: &str, body: &str) -> Resp {
        self.deliver_at(id, now_s(), body)
    }

    fn deliver_at(&self, id: &str, ts: i64, body: &str) -> Resp {
        let sig = self.signature(id, ts, body.as_bytes());
        let ts = ts.to_string();
        self.raw(
            &[
                ("webhook-id", id),
                ("webhook-timestamp", &ts),
                ("webhook-signature", &sig),
                ("content-type", "application/json"),
            ],
            body.as_bytes(),
        )
        .expect("deliver")
    }
}

fn chargeback(authorization: &str, amount: i64) -> String {
    json!({"type": "chargeback.created",
           "data": {"authorization": authorization, "amount": amount, "reason": "fraudulent"}})
    .to_string()
}

/// A captured charge card → shop; its object.
fn sale(client: &Client, key: &str, amount: i64) -> Value {
    let r = client.charge(key, &charge_body(amount));
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn hold(client: &Client, key: &str, amount: i64) -> Value {
    let mut body = charge_body(amount);
    body["capture"] = json!(false);
    let r = client.charge(key, &body);
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn notifications(client: &Client, query: &str) -> Vec<Value> {
    let r = client.get(&format!("/v1/notifications?limit=100{query}"));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["data"].as_array().unwrap().clone()
}

fn disputes(client: &Client) -> Vec<Value> {
    let r = client.get("/v1/events?limit=100&type=charge.dispute.created");
    assert_eq!(r.status, 200);
    r.json()["data"].as_array().unwrap().clone()
}

fn charge_of(client: &Client, id: &str) -> Value {
    client.get(&format!("/v1/charges/{id}")).json()
}

fn ok(r: &Resp) -> Value {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn embedded(dir: &TempDir, configure: impl FnOnce(&mut idem::Config)) -> (idem::Server, Client) {
    let mut config = support::config(dir);
    configure(&mut config);
    let server = idem::Server::start(config).expect("start server");
    let client = Client::new(server.addr(), server.initial_key().expect("default key"));
    client.card_and_shop();
    (server, client)
}

#[test]
fn sources_show_their_secret_once_and_belong_to_their_consumer() {
    let dir = TempDir::new("ntf-sources");
    let (server, client) = embedded(&dir, |_| {});
    let sender = Sender::create(&client, "acquirer");
    assert!(sender.secret.starts_with("whsec_"));
    let got = ok(&client.get(&format!("/v1/notification_sources/{}", sender.source)));
    assert_eq!(got["name"], "acquirer");
    assert_eq!(got["object"], "notification_source");
    assert!(got.get("secret").is_none(), "no secret after creation");
    let list = ok(&client.get("/v1/notification_sources"));
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    assert!(list["data"][0].get("secret").is_none());
    // With an Idempotency-Key, a replay is the stored 201, secret included.
    let first = client.post(
        "/v1/notification_sources",
        Some("src-key"),
        &json!({"name": "n"}),
    );
    let again = client.post(
        "/v1/notification_sources",
        Some("src-key"),
        &json!({"name": "n"}),
    );
    assert_eq!((first.status, again.status), (201, 201));
    assert!(again.replayed());
    assert_eq!(first.body, again.body);
    let other = client.post(
        "/v1/notification_sources",
        Some("src-key"),
        &json!({"name": "m"}),
    );
    assert_eq!(other.slug(), "idempotency-key-reused");
    // Names are validated; nothing is created.
    for bad in [
        json!({}),
        json!({"name": ""}),
        json!({"name": "x".repeat(65)}),
        json!({"name": "a\u{0}b"}),
        json!({"name": 7}),
        json!({"name": "n", "secret": "whsec_AAAA"}),
    ] {
        let r = client.post("/v1/notification_sources", None, &bad);
        assert_eq!(
            (r.status, r.slug().as_str()),
            (400, "invalid-request"),
            "{bad}"
        );
    }
    assert_eq!(
        ok(&client.get("/v1/notification_sources?limit=100"))["data"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    // Another consumer sees none of it, and its charges are not ours.
    let other_key = server.create_consumer("other").unwrap();
    let stranger = Client::new(server.addr(), &other_key);
    assert_eq!(
        stranger
            .get(&format!("/v1/notification_sources/{}", sender.source))
            .status,
        404
    );
    assert_eq!(
        client.get("/v1/notification_sources/src_nope").slug(),
        "not-found"
    );
    stranger.card_and_shop();
    let theirs = sale(&stranger, "their-sale", 500);
    let auth = theirs["authorization"].as_str().unwrap();
    let r = ok(&sender.deliver("msg-cross", &chargeback(auth, 100)));
    assert_eq!(
        r["status"], "unmatched",
        "another consumer's charge is not ours"
    );
    assert_eq!(stranger.balance("shop"), 500);
    // Reading needs a bearer key; the notification route does not.
    let anonymous = support::send(server.addr(), "GET", "/v1/notifications", &[], b"").unwrap();
    assert_eq!(anonymous.status, 401);
    server.shutdown();
    support::assert_verified(&dir.db());
}

/// A case of the signature table: its name, where it goes, its headers
/// and its body.
type SignatureCase<'a> = (&'a str, &'a Sender, Vec<(String, String)>, &'a str);

#[test]
fn signatures_are_checked_before_anything_is_stored() {
    let dir = TempDir::new("ntf-signatures");
    let (server, client) = embedded(&dir, |c| {
        c.notification_tolerance = Duration::from_secs(300);
    });
    let sender = Sender::create(&client, "acquirer");
    let other = Sender::create(&client, "other");
    let charge = sale(&client, "sale", 1000);
    let auth = charge["authorization"].as_str().unwrap();
    let body = chargeback(auth, 100);
    let now = now_s();
    let sig = sender.signature("msg-1", now, body.as_bytes());
    let ts = now.to_string();
    let old = (now - 301).to_string();
    let old_sig = sender.signature("msg-1", now - 301, body.as_bytes());
    let future = (now + 301).to_string();
    let future_sig = sender.signature("msg-1", now + 301, body.as_bytes());
    let foreign_sig = other.signature("msg-1", now, body.as_bytes());
    let mut flipped = sig.clone().into_bytes();
    let last = flipped.len() - 2;
    flipped[last] = if flipped[last] == b'A' { b'B' } else { b'A' };
    let flipped = String::from_utf8(flipped).unwrap();
    let tampered = chargeback(auth, 999);
    let unknown = Sender {
        source: "src_0000000000000000000000000000dead".into(),
        ..sender.clone()
    };
    let h = |id: &'static str, ts: &str, sig: &str| -> Vec<(String, String)> {
        vec![
            ("webhook-id".into(), id.into()),
            ("webhook-timestamp".into(), ts.into()),
            ("webhook-signature".into(), sig.into()),
        ]
    };
    #[rustfmt::skip]
    let cases: Vec<SignatureCase<'_>> = vec![
        ("no headers", &sender, vec![], &body),
        ("no id", &sender, h("msg-1", &ts, &sig)[1..].to_vec(), &body),
        ("no timestamp", &sender, vec![h("msg-1", &ts, &sig)[0].clone(), h("msg-1", &ts, &sig)[2].clone()], &body),
        ("no signature", &sender, h("msg-1", &ts, &sig)[..2].to_vec(), &body),
        ("flipped signature", &sender, h("msg-1", &ts, &flipped), &body),
        ("signature for another id", &sender, h("msg-2", &ts, &sig), &body),
        ("a replayed old signature", &sender, h("msg-1", &old, &old_sig), &body),
        ("a future timestamp", &sender, h("msg-1", &future, &future_sig), &body),
        ("timestamp not a number", &sender, h("msg-1", "soon", &sig), &body),
        ("another source's secret", &sender, h("msg-1", &ts, &foreign_sig), &body),
        ("tampered body", &sender, h("msg-1", &ts, &sig), &tampered),
        ("unknown source", &unknown, h("msg-1", &ts, &sig), &body),
        ("v2 scheme", &sender, h("msg-1", &ts, &sig.replace("v1,", "v2,")), &body),
    ];
    let mut details = Vec::new();
    for (name, to, headers, body) in &cases {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let r = to.raw(&headers, body.as_bytes()).unwrap();
        assert_eq!(
            (r.status, r.slug().as_str()),
            (401, "signature-invalid"),
            "{name}"
        );
        details.push((name.to_string(), r.json()["detail"].clone()));
    }
    // An unknown source is indistinguishable from a wrong signature.
    let detail_of = |n: &str| details.iter().find(|(d, _)| d == n).unwrap().1.clone();
    assert_eq!(detail_of("unknown source"), detail_of("flipped signature"));
    assert!(notifications(&client, "").is_empty(), "nothing stored");
    assert_eq!(client.balance("shop"), 1000);
    // The valid delivery, with a rotated-out signature beside the good one.
    let both = format!("{foreign_sig} {sig}");
    let r = sender
        .raw(
            &[
                ("webhook-id", "msg-1"),
                ("webhook-timestamp", &ts),
                ("webhook-signature", &both),
            ],
            body.as_bytes(),
        )
        .unwrap();
    let r = ok(&r);
    assert_eq!(r["status"], "applied");
    assert_eq!(client.balance("shop"), 900);
    // The old signature replayed later is still refused, even for an id
    // that is stored.
    let r = sender
        .raw(
            &[
                ("webhook-id", "msg-1"),
                ("webhook-timestamp", &old),
                ("webhook-signature", &old_sig),
            ],
            body.as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 401);
    server.shutdown();
    support::assert_verified(&dir.db());
}

#[test]
fn a_redelivery_replays_the_stored_answer_and_another_body_is_refused() {
    let dir = TempDir::new("ntf-replay");
    let (server, client) = embedded(&dir, |_| {});
    let sender = Sender::create(&client, "acquirer");
    let second = Sender::create(&client, "second");
    let charge = sale(&client, "sale", 1000);
    let auth = charge["authorization"].as_str().unwrap();
    let first = sender.deliver("msg-1", &chargeback(auth, 300));
    let answer = ok(&first);
    assert!(!first.replayed());
    assert_eq!(answer["object"], "notification");
    assert_eq!(answer["source"], sender.source.as_str());
    assert_eq!(answer["type"], "chargeback.created");
    assert_eq!(answer["status"], "applied");
    assert!(answer["id"].as_str().unwrap().starts_with("ntf_"));
    assert!(answer["dispute"].as_str().unwrap().starts_with("dp_"));
    // The same body reordered and re-indented, a minute later.
    let respelled = format!(
        "{{ \"data\": {{\"reason\":\"fraudulent\", \"amount\": 300, \"authorization\": \"{auth}\"}},\n  \"type\": \"chargeback.created\" }}"
    );
    let again = sender.deliver_at("msg-1", now_s() + 60, &respelled);
    assert_eq!(again.status, 200);
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "byte for byte");
    let reused = sender.deliver("msg-1", &chargeback(auth, 301));
    assert_eq!(
        (reused.status, reused.slug().as_str()),
        (422, "idempotency-key-reused")
    );
    // The same id from another source is another notification.
    let elsewhere = ok(&second.deliver("msg-1", &chargeback(auth, 300)));
    assert_eq!(elsewhere["status"], "applied");
    assert_eq!(client.balance("shop"), 400);
    assert_eq!(client.balance("card"), -400);
    assert_eq!(
        charge_of(&client, charge["id"].as_str().unwrap())["amount_disputed"],
        600
    );
    assert_eq!(disputes(&client).len(), 2);
    assert_eq!(notifications(&client, "").len(), 2);
    let metrics = support::send(server.addr(), "GET", "/metrics", &[], b"").unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("idem_notifications_total{status=\"applied\"} 2"),
        "{text}"
    );
    server.shutdown();
    support::assert_verified(&dir.db());
}

#[test]
fn concurrent_deliveries_of_one_id_move_the_money_once() {
    const THREADS: usize = 48;
    let dir = TempDir::new("ntf-concurrent");
    let (server, client) = embedded(&dir, |_| {});
    let sender = Sender::create(&client, "acquirer");
    let charge = sale(&client, "sale", 10_000);
    let body = chargeback(charge["authorization"].as_str().unwrap(), 2_500);
    let barrier = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let (sender, body, barrier) = (sender.clone(), body.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                sender.deliver("msg-storm", &body)
            })
        })
        .collect();
    let answers: Vec<Resp> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        answers.iter().all(|r| r.status == 200),
        "every delivery answered 200"
    );
    assert!(
        answers.iter().all(|r| r.body == answers[0].body),
        "one answer"
    );
    assert_eq!(
        answers.iter().filter(|r| !r.replayed()).count(),
        1,
        "one first"
    );
    assert_eq!(disputes(&client).len(), 1);
    assert_eq!(client.balance("shop"), 7_500);
    assert_eq!(
        charge_of(&client, charge["id"].as_str().unwrap())["amount_disputed"],
        2_500
    );
    server.shutdown();
    support::assert_verified(&dir.db());
}

#[test]
fn a_chargeback_is_forced_past_zero_and_shows_in_entries_and_events() {
    let dir = TempDir::new("ntf-forced");
    let (server, client) = embedded(&dir, |_| {});
    let sender = Sender::create(&client, "acquirer");
    let charge = sale(&client, "sale", 1000);
    // The shop spends most of it.
    let spend = client.charge(
        "spend",
        &json!({"amount": 800, "currency": "BRL", "source": "shop", "destination": "card"}),
    );
    assert_eq!(spend.status, 201);
    let auth = charge["authorization"].as_str().unwrap();
    let answer = ok(&sender.deliver("msg-1", &chargeback(auth, 1000)));
    assert_eq!(answer["status"], "applied");
    assert_eq!(client.balance("shop"), -800, "forced below zero");
    let after = charge_of(&client, charge["id"].as_str().unwrap());
    assert_eq!(after["amount_disputed"], 1000);
    // Nothing is left to refund, and the shop cannot pay.
    let refund = client.post(
        &format!("/v1/charges/{}/refunds", charge["id"].as_str().unwrap()),
        Some("refund"),
        &json!({}),
    );
    assert_eq!(refund.slug(), "refund-exceeds-charge");
    let pay = client.charge(
        "pay",
        &json!({"amount": 1, "currency": "BRL", "source": "shop", "destination": "card"}),
    );
    assert_eq!(pay.slug(), "insufficient-funds");
    let entries = ok(&client.get("/v1/accounts/shop/entries"));
    let newest = &entries["data"][0];
    assert_eq!(newest["amount"], -1000);
    assert_eq!(newest["dispute"], answer["dispute"]);
    assert_eq!(newest["charge"], charge["id"]);
    assert_eq!(entries["data"][1]["dispute"], Value::Null);
    let events = disputes(&client);
    assert_eq!(events.len(), 1);
    let object = &events[0]["data"]["object"];
    assert_eq!(object["object"], "dispute");
    assert_eq!(object["id"], answer["dispute"]);
    assert_eq!(object["charge"], charge["id"]);
    assert_eq!(object["amount"], 1000);
    assert_eq!(object["reason"], "fraudulent");
    assert_eq!(object["notification"], answer["id"]);
    server.shutdown();
    support::assert_verified(&dir.db());
}

#[test]
fn a_chargeback_beyond_what_is_left_is_refused_and_stored() {
    let dir = TempDir::new("ntf-exceeds");
    let (server, client) = embedded(&dir, |_| {});
    let sender = Sender::create(&client, "acquirer");
    let charge = sale(&client, "sale", 1000);
    let id = charge["id"].as_str().unwrap();
    let auth = charge["authorization"].as_str().unwrap();
    let refund = client.post(
        &format!("/v1/charges/{id}/refunds"),
        Some("refund"),
        &json!({"amount": 300}),
    );
    assert_eq!(refund.status, 201);
    let too_much = sender.deliver("msg-1", &chargeback(auth, 701));
    assert_eq!(
        (too_much.status, too_much.slug().as_str()),
        (422, "dispute-exceeds-charge")
    );
    let again = sender.deliver("msg-1", &chargeback(auth, 701));
    assert!(again.replayed());
    assert_eq!((again.status, &again.body), (422, &too_much.body));
    let ignored = notifications(&client, "&status=ignored");
    assert_eq!(ignored.len(), 1);
    assert!(ignored[0]["detail"]
        .as_str()
        .unwrap()
        .contains("dispute-exceeds-charge"));
    assert_eq!(
        ok(&sender.deliver("msg-2", &chargeback(auth, 700)))["status"],
        "applied"
    );
    let one_more = sender.deliver("msg-3", &chargeback(auth, 1));
    assert_eq!(one_more.slug(), "dispute-exceeds-charge");
    assert_eq!(client.balance("shop"), 0);
    assert_eq!(charge_of(&client, id)["amount_disputed"], 700);
    assert_eq!(notifications(&client, "&status=applied").len(), 1);
    server.shutdown();
    support::assert_verified(&dir.db());
}

#[test]
fn unknown_types_are_stored_as_ignored() {
    let dir = TempDir::new("ntf-unknown");
    let (server, client) = embedded(&dir, |_| {});
    let sender = Sender::create(&client, "acquirer");
    sale(&client, "sale", 1000);
    let body = json!({"type": "payout.paid", "data": {"anything": [1, {"x": null}]}}).to_string();
    let answer = ok(&sender.deliver("msg-1", &body));
    assert_eq!(answer["status"], "ignored");
    assert_eq!(answer["type"], "payout.paid");
    assert!(sender.deliver("msg-1", &body).replayed());
    assert_eq!(client.balance("shop"), 1000);
    assert_eq!(notifications(&client, "&status=ignored").len(), 1);
    assert!(notifications(&client, "&status=applied").is_empty());
    assert_eq!(
        client.get("/v1/notifications?status=lost").slug(),
        "invalid-request"
    );
    server.shutdown();
    support::assert_verified(&dir.db());
}

#[test]
fn bad_input_is_refused_and_leaves_the_webhook_id_free() {
    let dir = TempDir::new("ntf-bad");
    let (server, client) = embedded(&dir, |_| {});
    let sender = Sender::create(&client, "acquirer");
    let charge = sale(&client, "sale", 1000);
    let auth = charge["authorization"].as_str().unwrap();
    let big = format!(
        "{{\"type\":\"x\",\"data\":{{\"pad\":\"{}\"}}}}",
        "a".repeat(70_000)
    );
    #[rustfmt::skip]
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("msg-bad", "not json".into(), 400, "invalid-request"),
        ("msg-bad", "[1]".into(), 400, "invalid-request"),
        ("msg-bad", "".into(), 400, "invalid-request"),
        ("msg-bad", r#"{"type":"x","type":"y","data":{}}"#.into(), 400, "invalid-request"),
        ("msg-bad", r#"{"type":"x","data":{},"extra":1}"#.into(), 400, "invalid-request"),
        ("msg-bad", r#"{"data":{}}"#.into(), 400, "invalid-request"),
        ("msg-bad", r#"{"type":"","data":{}}"#.into(), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"{}","data":{{}}}}"#, "t".repeat(129)), 400, "invalid-request"),
        ("msg-bad", r#"{"type":"x","data":null}"#.into(), 400, "invalid-request"),
        ("msg-bad", r#"{"type":"x"}"#.into(), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"chargeback.created","data":{{"authorization":"{auth}","amount":0}}}}"#), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"chargeback.created","data":{{"authorization":"{auth}","amount":1000000000000001}}}}"#), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"chargeback.created","data":{{"authorization":"{auth}","amount":9223372036854775808}}}}"#), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"chargeback.created","data":{{"authorization":"{auth}","amount":1.0}}}}"#), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"chargeback.created","data":{{"authorization":"{auth}","amount":"5"}}}}"#), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"chargeback.created","data":{{"authorization":"{auth}","amount":-5}}}}"#), 400, "invalid-request"),
        ("msg-bad", r#"{"type":"chargeback.created","data":{"authorization":"","amount":5}}"#.into(), 400, "invalid-request"),
        ("msg-bad", r#"{"type":"chargeback.created","data":{"amount":5}}"#.into(), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"chargeback.created","data":{{"authorization":"{auth}","amount":5,"reason":7}}}}"#), 400, "invalid-request"),
        ("msg-bad", format!(r#"{{"type":"chargeback.created","data":{{"authorization":"{auth}","amount":5,"extra":true}}}}"#), 400, "invalid-request"),
        ("msg bad", chargeback(auth, 5), 400, "idempotency-key-invalid"),
        (&*"m".repeat(256).leak(), chargeback(auth, 5), 400, "idempotency-key-invalid"),
        ("msg-bad", big, 413, "body-too-large"),
    ];
    for (id, body, status, slug) in &cases {
        let r = sender.deliver(id, body);
        assert_eq!(
            (r.status, r.slug().as_str()),
            (*status, *slug),
            "{id} {body:.80}"
        );
    }
    assert!(notifications(&client, "").is_empty(), "nothing stored");
    assert_eq!(client.balance("shop"), 1000);
    // The id stayed free: a good body under it is new.
    let r = sender.deliver("msg-bad", &chargeback(auth, 5));
    assert!(!r.replayed());
    assert_eq!(ok(&r)["status"], "applied");
    // Wrong method and a bearer-less GET.
    let path = format!("/v1/notifications/{}", sender.source);
    let get = support::send(server.addr(), "GET", &path, &[], b"").unwrap();
    assert_eq!((get.status, get.header("allow")), (405, Some("POST")));
    server.shutdown();
    support::assert_verified(&dir.db());
}

/// The notification overtakes its authorization: it arrives after the
/// acquirer authorised and before the ledger recorded the charge.
#[test]
fn a_chargeback_that_overtakes_its_authorization_applies_once_when_it_is_recorded() {
    let dir = TempDir::new("ntf-overtake");
    let db = dir.db();
    let sender: Arc<Mutex<Option<Sender>>> = Arc::new(Mutex::new(None));
    let seen: Arc<Mutex<Vec<Resp>>> = Arc::new(Mutex::new(Vec::new()));
    let (hook_sender, hook_seen, hook_db) = (sender.clone(), seen.clone(), db.clone());
    let (server, client) = embedded(&dir, move |c| {
        c.hooks.before_ledger_phase = Some(Arc::new(move |op: &str| {
            let Some(sender) = hook_sender.lock().unwrap().clone() else {
                return;
            };
            let auth = support::authorizations(&hook_db)
                .unwrap()
                .into_iter()
                .find(|a| a.key == op)
                .expect("the acquirer authorised this operation")
                .id;
            let r = sender.deliver(&format!("early-{op}"), &chargeback(&auth, 400));
            hook_seen.lock().unwrap().push(r);
        }));
    });
    *sender.lock().unwrap() = Some(Sender::create(&client, "acquirer"));
    let charge = sale(&client, "sale", 1000);
    let early = seen.lock().unwrap().pop().expect("delivered from the hook");
    assert_eq!(ok(&early)["status"], "unmatched");
    assert_eq!(client.balance("shop"), 600, "applied with the charge");
    assert_eq!(
        charge_of(&client, charge["id"].as_str().unwrap())["amount_disputed"],
        400
    );
    let listed = notifications(&client, "");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["status"], "applied");
    assert!(listed[0]["dispute"].as_str().unwrap().starts_with("dp_"));
    // A redelivery replays the first answer (unmatched) and does nothing.
    let id = listed[0]["webhook_id"].as_str().unwrap().to_string();
    let auth = charge["authorization"].as_str().unwrap();
    let sender = sender.lock().unwrap().clone().unwrap();
    let again = sender.deliver(&id, &chargeback(auth, 400));
    assert!(again.replayed());
    assert_eq!(again.body, early.body);
    assert_eq!(client.balance("shop"), 600);
    assert_eq!(disputes(&client).len(), 1);
    // And the other order, for comparison: the charge first.
    assert_eq!(
        ok(&sender.deliver("late", &chargeback(auth, 100)))["status"],
        "applied"
    );
    assert_eq!(client.balance("shop"), 500);
    server.shutdown();
    support::assert_verified(&db);
}

#[test]
fn a_hold_keeps_its_chargeback_until_capture_and_a_cancel_ignores_it() {
    let dir = TempDir::new("ntf-hold");
    let (server, client) = embedded(&dir, |_| {});
    let sender = Sender::create(&client, "acquirer");
    let held = hold(&client, "hold", 1000);
    let auth = held["authorization"].as_str().unwrap();
    assert_eq!(
        ok(&sender.deliver("cb-1", &chargeback(auth, 300)))["status"],
        "unmatched"
    );
    // More than a partial capture will leave: ignored at capture.
    assert_eq!(
        ok(&sender.deliver("cb-2", &chargeback(auth, 500)))["status"],
        "unmatched"
    );
    let cap = client.post(
        &format!("/v1/charges/{}/capture", held["id"].as_str().unwrap()),
        Some("cap"),
        &json!({"amount": 600}),
    );
    assert_eq!(cap.status, 200, "{}", String::from_utf8_lossy(&cap.body));
    assert_eq!(client.balance("shop"), 300, "600 captured, 300 disputed");
    let listed = notifications(&client, "");
    let status = |id: &str| {
        listed
            .iter()
            .find(|n| n["webhook_id"] == id)
            .map(|n| (n["status"].clone(), n["detail"].clone()))
            .unwrap()
    };
    assert_eq!(status("cb-1").0, "applied");
    assert_eq!(status("cb-2").0, "ignored");
    assert!(status("cb-2")
        .1
        .as_str()
        .unwrap()
        .contains("dispute-exceeds-charge"));
    // A canceled hold leaves nothing to take back.
    let other = hold(&client, "hold-2", 1000);
    let auth2 = other["authorization"].as_str().unwrap();
    assert_eq!(
        ok(&sender.deliver("cb-3", &chargeback(auth2, 300)))["status"],
        "unmatched"
    );
    let cancel = client.post(
        &format!("/v1/charges/{}/cancel", other["id"].as_str().unwrap()),
        Some("cancel"),
        &json!({}),
    );
    assert_eq!(cancel.status, 200);
    let n = notifications(&client, "&status=ignored");
    assert!(n
        .iter()
        .any(|n| n["webhook_id"] == "cb-3" && n["detail"].as_str().unwrap().contains("canceled")));
    // And one that arrives after the cancel is ignored at once.
    assert_eq!(
        ok(&sender.deliver("cb-4", &chargeback(auth2, 1)))["status"],
        "ignored"
    );
    assert!(notifications(&client, "&status=unmatched").is_empty());
    assert_eq!(client.balance("shop"), 300);
    server.shutdown();
    support::assert_verified(&dir.db());
}

fn child(db: &Path, env: &[(&str, &str)]) -> ChildServer {
    ChildServer::start(
        db,
        &["--inflight-timeout", "1s", "--reaper-interval", "1h"],
        env,
    )
}

fn client_for(server: &ChildServer, key: &str) -> Client {
    Client::new(server.addr, key)
}

/// A crash between the authorization and its ledger phase: the acquirer
/// authorised (its own file has it), the ledger has no charge. The
/// notification arrives at the restarted server, is stored unmatched, and
/// the retried charge records the authorization and applies it once.
#[test]
fn a_crash_between_authorization_and_ledger_leaves_the_chargeback_unmatched_until_the_retry() {
    let dir = TempDir::new("ntf-crash-between");
    let db = dir.db();
    let first = child(&db, &[("IDEM_FAULT", "charge:after_acquirer")]);
    let key = first.initial_key.clone().unwrap();
    let client = client_for(&first, &key);
    client.card_and_shop();
    let sender = Sender::create(&client, "acquirer");
    let crashed = client.try_request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "crash-sale")],
        &charge_body(1000).to_string(),
    );
    assert!(crashed.is_err() || crashed.unwrap().status >= 500);
    first.wait_exit(Duration::from_secs(10));
    let auths = support::authorizations(&db).unwrap();
    assert_eq!(auths.len(), 1);
    let auth = auths[0].id.clone();

    let second = child(&db, &[]);
    let client = client_for(&second, &key);
    let sender = Sender {
        addr: second.addr,
        ..sender
    };
    assert_eq!(
        ok(&sender.deliver("cb-1", &chargeback(&auth, 250)))["status"],
        "unmatched"
    );
    assert_eq!(client.balance("shop"), 0);
    let done = support::eventually(Duration::from_secs(10), || {
        let r = client.charge("crash-sale", &charge_body(1000));
        (r.status == 201).then_some(r)
    });
    assert_eq!(done.json()["authorization"], auth.as_str());
    assert_eq!(client.balance("shop"), 750);
    assert_eq!(notifications(&client, "&status=applied").len(), 1);
    assert!(sender.deliver("cb-1", &chargeback(&auth, 250)).replayed());
    assert_eq!(client.balance("shop"), 750);
    second.kill();
    support::assert_verified(&db);
}

/// The process dies inside the notification's writer command, after the
/// notification and its dispute were written and before the commit:
/// nothing of it remains, and the sender's retry applies it once.
#[test]
fn a_crash_inside_the_notification_leaves_nothing_and_the_retry_applies_it_once() {
    let dir = TempDir::new("ntf-crash-inside");
    let db = dir.db();
    let first = child(&db, &[("IDEM_FAULT", "notification:in_notification")]);
    let key = first.initial_key.clone().unwrap();
    let client = client_for(&first, &key);
    client.card_and_shop();
    let sender = Sender::create(&client, "acquirer");
    let charge = sale(&client, "sale", 1000);
    let auth = charge["authorization"].as_str().unwrap().to_string();
    let body = chargeback(&auth, 400);
    let ts = now_s();
    let sig = sender.signature("cb-1", ts, body.as_bytes());
    let ts_text = ts.to_string();
    let headers = [
        ("webhook-id", "cb-1"),
        ("webhook-timestamp", ts_text.as_str()),
        ("webhook-signature", sig.as_str()),
    ];
    let crashed = sender.raw(&headers, body.as_bytes());
    assert!(crashed.is_err() || crashed.unwrap().status >= 500);
    first.wait_exit(Duration::from_secs(10));
    support::assert_verified(&db);

    let second = child(&db, &[]);
    let client = client_for(&second, &key);
    let sender = Sender {
        addr: second.addr,
        ..sender
    };
    assert!(
        notifications(&client, "").is_empty(),
        "the crash left nothing"
    );
    assert_eq!(client.balance("shop"), 1000);
    // The sender retries the very same request (same timestamp, same
    // signature): still within the tolerance.
    let retry = sender.raw(&headers, body.as_bytes()).unwrap();
    assert!(!retry.replayed());
    assert_eq!(ok(&retry)["status"], "applied");
    assert!(sender.raw(&headers, body.as_bytes()).unwrap().replayed());
    assert_eq!(client.balance("shop"), 600);
    assert_eq!(disputes(&client).len(), 1);
    second.kill();
    support::assert_verified(&db);
}

/// SIGKILL while deliveries of many ids are in flight from several
/// threads: after the restart every id is redelivered; each is applied
/// exactly once whichever side of the kill it committed on.
#[test]
fn sigkill_during_a_storm_of_deliveries_loses_and_doubles_nothing() {
    const IDS: usize = 96;
    const THREADS: usize = 8;
    let dir = TempDir::new("ntf-sigkill");
    let db = dir.db();
    let first = child(&db, &[]);
    let key = first.initial_key.clone().unwrap();
    let client = client_for(&first, &key);
    client.card_and_shop();
    let sender = Sender::create(&client, "acquirer");
    let charge = sale(&client, "sale", (IDS as i64) * 10);
    let auth = charge["authorization"].as_str().unwrap().to_string();
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (sender, auth, barrier) = (sender.clone(), auth.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for i in (t..IDS).step_by(THREADS) {
                    let body = chargeback(&auth, 10);
                    let ts = now_s().to_string();
                    let id = format!("cb-{i}");
                    let sig = sender.signature(&id, ts.parse().unwrap(), body.as_bytes());
                    let headers = [
                        ("webhook-id", id.as_str()),
                        ("webhook-timestamp", ts.as_str()),
                        ("webhook-signature", sig.as_str()),
                    ];
                    if sender.raw(&headers, body.as_bytes()).is_err() {
                        return;
                    }
                }
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    support::eventually(Duration::from_secs(20), || {
        let n = notifications(&client, "").len();
        (n >= 10 || started.elapsed() > Duration::from_secs(5)).then_some(())
    });
    first.kill();
    for t in threads {
        t.join().unwrap();
    }
    support::assert_verified(&db);

    let second = child(&db, &[]);
    let client = client_for(&second, &key);
    let sender = Sender {
        addr: second.addr,
        ..sender
    };
    let before = client.balance("shop");
    let mut fresh = 0;
    for i in 0..IDS {
        let r = sender.deliver(&format!("cb-{i}"), &chargeback(&auth, 10));
        assert_eq!(ok(&r)["status"], "applied");
        if !r.replayed() {
            fresh += 1;
        }
    }
    assert_eq!(
        before - client.balance("shop"),
        10 * fresh,
        "only the new ones moved money"
    );
    assert_eq!(client.balance("shop"), 0, "every chargeback applied once");
    assert_eq!(disputes(&client).len(), IDS);
    assert_eq!(
        charge_of(&client, charge["id"].as_str().unwrap())["amount_disputed"],
        (IDS as i64) * 10
    );
    second.kill();
    support::assert_verified(&db);
}
