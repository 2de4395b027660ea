//! Webhook endpoints and the delivery engine, through HTTP against real
//! servers and real local receivers (a small `TcpListener` HTTP server in
//! this file): signatures checked by the Standard Webhooks reference crate,
//! retries after 500s with the same `webhook-id` and byte-identical body, a
//! receiver that hangs, one that closes, one that is down, endpoint filters,
//! deletion, bad input, requests never held up by deliveries, and a SIGKILL
//! of an `idem serve` child with deliveries pending.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{charge_body, eventually, ChildServer, Client, TempDir};

/// What the receiver does with one request.
#[derive(Clone, Copy, Debug)]
enum Behave {
    /// Answer this status (with a short body), then close.
    Status(u16),
    /// Read the request, answer nothing for this long, then close.
    Hang(Duration),
    /// Read the request and close the connection without a word.
    Close,
}

/// One request as the receiver got it.
#[derive(Clone, Debug)]
struct Received {
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Received {
    fn header(&self, name: &str) -> &str {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {name} header"))
    }
    fn id(&self) -> String {
        self.header("webhook-id").to_string()
    }
}

type Policy = Arc<dyn Fn(&str, usize) -> Behave + Send + Sync>;

/// A local HTTP receiver: every request is recorded, then answered as
/// `policy(path, how many requests this path got before)` says.
struct Receiver {
    addr: SocketAddr,
    got: Arc<Mutex<Vec<Received>>>,
    stop: Arc<AtomicBool>,
}

impl Receiver {
    fn start(policy: impl Fn(&str, usize) -> Behave + Send + Sync + 'static) -> Receiver {
        Receiver::start_on("127.0.0.1:0".parse().unwrap(), Arc::new(policy))
    }

    fn start_on(addr: SocketAddr, policy: Policy) -> Receiver {
        let listener = TcpListener::bind(addr).expect("bind receiver");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (g, s) = (Arc::clone(&got), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (g, policy) = (Arc::clone(&g), Arc::clone(&policy));
                        std::thread::spawn(move || serve_one(stream, &g, &*policy));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Receiver { addr, got, stop }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn got(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }

    fn got_on(&self, path: &str) -> Vec<Received> {
        self.got().into_iter().filter(|r| r.path == path).collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn serve_one(
    mut stream: TcpStream,
    got: &Mutex<Vec<Received>>,
    policy: &dyn Fn(&str, usize) -> Behave,
) {
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
    let head = String::from_utf8_lossy(&raw[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or("");
    let path = request_line.split(' ').nth(1).unwrap_or("").to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = raw[head_end + 4..].to_vec();
    while body.len() < len {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => body.extend_from_slice(&buf[..n]),
        }
    }
    let nth = {
        let mut g = got.lock().unwrap();
        let nth = g.iter().filter(|r| r.path == path).count();
        g.push(Received {
            path: path.clone(),
            headers,
            body,
        });
        nth
    };
    match policy(&path, nth) {
        Behave::Status(status) => {
            let _ = stream.write_all(
                format!("HTTP/1.1 {status} X\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    .as_bytes(),
            );
        }
        Behave::Hang(d) => std::thread::sleep(d),
        Behave::Close => {}
    }
}

/// A port nothing listens on (bound, then released).
fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn fast(config: &mut idem::Config) {
    config.webhook_retry_base = Duration::from_millis(20);
    config.webhook_timeout = Duration::from_millis(500);
}

/// Creates an endpoint; returns (id, secret).
fn endpoint(client: &Client, url: &str, events: Value) -> (String, String) {
    let r = client.post(
        "/v1/webhook_endpoints",
        None,
        &json!({"url": url, "enabled_events": events}),
    );
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    (
        v["id"].as_str().unwrap().to_string(),
        v["secret"].as_str().unwrap().to_string(),
    )
}

/// Every event of the consumer, newest first (all pages).
fn all_events(client: &Client) -> Vec<Value> {
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            Some(id) => format!("/v1/events?limit=100&starting_after={id}"),
            None => "/v1/events?limit=100".to_string(),
        };
        let page = client.get(&path).json();
        let data = page["data"].as_array().unwrap().clone();
        after = data.last().map(|e| e["id"].as_str().unwrap().to_string());
        all.extend(data);
        if page["has_more"] != json!(true) {
            return all;
        }
    }
}

fn deliveries(client: &Client, event: &str) -> Vec<Value> {
    let r = client.get(&format!("/v1/events/{event}/deliveries"));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["data"].as_array().unwrap().clone()
}

fn event_bytes(client: &Client, event: &str) -> Vec<u8> {
    let r = client.get(&format!("/v1/events/{event}"));
    assert_eq!(r.status, 200);
    r.body
}

fn metric(client: &Client, line_prefix: &str) -> u64 {
    let text = String::from_utf8(client.get("/metrics").body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {line_prefix}"))
}

#[test]
fn a_delivery_is_signed_filtered_and_only_for_events_after_the_endpoint() {
    let receiver = Receiver::start(|_, _| Behave::Status(200));
    let (_server, client) = support::server(fast);
    // `card` and `shop` were created before any endpoint.
    let before = all_events(&client);
    assert_eq!(before.len(), 2);
    let (all_id, all_secret) = endpoint(&client, &receiver.url("/all"), json!(["*"]));
    let (charges_id, charges_secret) = endpoint(
        &client,
        &receiver.url("/charges?x=1"),
        json!(["charge.succeeded"]),
    );
    client.account("late", false);
    let charge = client.charge("k1", &charge_body(500));
    assert_eq!(charge.status, 201);
    let events = all_events(&client);
    assert_eq!(events.len(), 4);
    let account_event = events[1]["id"].as_str().unwrap().to_string();
    let charge_event = events[0]["id"].as_str().unwrap().to_string();
    assert_eq!(events[0]["type"], "charge.succeeded");
    eventually(Duration::from_secs(10), || {
        (receiver.got().len() >= 3).then_some(())
    });
    std::thread::sleep(Duration::from_millis(200));
    let got = receiver.got();
    assert_eq!(got.len(), 3, "{got:?}");
    let on_all: BTreeSet<String> = receiver.got_on("/all").iter().map(Received::id).collect();
    assert_eq!(
        on_all,
        BTreeSet::from([account_event.clone(), charge_event.clone()])
    );
    let on_charges: Vec<String> = receiver
        .got_on("/charges?x=1")
        .iter()
        .map(Received::id)
        .collect();
    assert_eq!(on_charges, vec![charge_event.clone()]);
    for r in &got {
        assert_eq!(r.header("content-type"), "application/json");
        assert_eq!(r.body, event_bytes(&client, &r.id()));
        let secret = if r.path == "/all" {
            &all_secret
        } else {
            &charges_secret
        };
        let mut headers = hyper::HeaderMap::new();
        for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
            headers.insert(name, r.header(name).parse().unwrap());
        }
        standardwebhooks::Webhook::new(secret)
            .unwrap()
            .verify(&r.body, &headers)
            .expect("the reference implementation accepts the signature");
        // The other endpoint's secret does not.
        let other = if r.path == "/all" {
            &charges_secret
        } else {
            &all_secret
        };
        assert!(standardwebhooks::Webhook::new(other)
            .unwrap()
            .verify(&r.body, &headers)
            .is_err());
    }
    // Events from before the endpoints have no delivery at all.
    for e in &before {
        assert!(deliveries(&client, e["id"].as_str().unwrap()).is_empty());
    }
    let d = deliveries(&client, &charge_event);
    assert_eq!(d.len(), 2);
    let by_endpoint: BTreeMap<String, &Value> = d
        .iter()
        .map(|d| (d["endpoint"].as_str().unwrap().to_string(), d))
        .collect();
    for id in [&all_id, &charges_id] {
        let d = by_endpoint[id.as_str()];
        assert_eq!(d["object"], "delivery");
        assert_eq!(d["status"], "succeeded");
        assert_eq!(d["attempts"], 1);
        assert_eq!(d["last_status"], 200);
        assert_eq!(d["next_attempt_at"], Value::Null);
    }
    assert_eq!(deliveries(&client, &account_event).len(), 1);
    assert!(
        metric(
            &client,
            "idem_webhook_deliveries_total{result=\"succeeded\"}"
        ) >= 3
    );
    // Nothing secret in what GET shows.
    let shown = client.get(&format!("/v1/webhook_endpoints/{all_id}"));
    assert_eq!(shown.status, 200);
    assert!(shown.json().get("secret").is_none());
    let list = client.get("/v1/webhook_endpoints").json();
    assert_eq!(list["data"].as_array().unwrap().len(), 2);
    assert!(!String::from_utf8_lossy(&client.get("/v1/webhook_endpoints").body).contains("whsec_"));
}

#[test]
fn a_receiver_answering_500_three_times_gets_the_same_bytes_until_it_says_200() {
    let receiver = Receiver::start(|_, nth| {
        if nth < 3 {
            Behave::Status(500)
        } else {
            Behave::Status(200)
        }
    });
    let (_server, client) = support::server(fast);
    endpoint(&client, &receiver.url("/flaky"), json!(["*"]));
    client.account("x", false);
    let event = all_events(&client)[0]["id"].as_str().unwrap().to_string();
    let d = eventually(Duration::from_secs(10), || {
        let d = deliveries(&client, &event);
        (d[0]["status"] == "succeeded").then_some(d)
    });
    assert_eq!(d[0]["attempts"], 4);
    assert_eq!(d[0]["last_status"], 200);
    let got = receiver.got();
    assert_eq!(got.len(), 4);
    let stored = event_bytes(&client, &event);
    let mut timestamps = Vec::new();
    for r in &got {
        assert_eq!(r.id(), event);
        assert_eq!(r.body, stored, "byte-identical on every attempt");
        timestamps.push(r.header("webhook-timestamp").parse::<i64>().unwrap());
    }
    assert!(timestamps.windows(2).all(|w| w[0] <= w[1]));
    assert!(metric(&client, "idem_webhook_deliveries_total{result=\"retried\"}") >= 3);
    assert_eq!(metric(&client, "idem_webhook_backlog"), 0);
}

#[test]
fn hanging_closing_and_absent_receivers_are_retried_until_failed() {
    let receiver = Receiver::start(|path, _| match path {
        "/hang" => Behave::Hang(Duration::from_secs(3)),
        _ => Behave::Close,
    });
    let down = free_port();
    let (_server, client) = support::server(|c| {
        fast(c);
        c.webhook_attempts_max = 3;
    });
    let (hang, _) = endpoint(&client, &receiver.url("/hang"), json!(["*"]));
    let (close, _) = endpoint(&client, &receiver.url("/close"), json!(["*"]));
    let (absent, _) = endpoint(&client, &format!("http://{down}/"), json!(["*"]));
    let started = Instant::now();
    client.account("x", false);
    let event = all_events(&client)[0]["id"].as_str().unwrap().to_string();
    let d = eventually(Duration::from_secs(20), || {
        let d = deliveries(&client, &event);
        d.iter().all(|d| d["status"] == "failed").then_some(d)
    });
    // Three attempts of a hanging receiver, each cut at the 500 ms timeout.
    assert!(started.elapsed() >= Duration::from_millis(1400));
    for d in &d {
        assert_eq!(d["attempts"], 3, "{d}");
        assert_eq!(d["last_status"], Value::Null, "{d}");
        assert_eq!(d["next_attempt_at"], Value::Null, "{d}");
        assert!(
            d["last_error"].as_str().is_some_and(|e| !e.is_empty()),
            "{d}"
        );
        assert!([&hang, &close, &absent].contains(&&d["endpoint"].as_str().unwrap().to_string()));
    }
    assert_eq!(receiver.got_on("/hang").len(), 3);
    assert_eq!(receiver.got_on("/close").len(), 3);
    assert!(metric(&client, "idem_webhook_deliveries_total{result=\"failed\"}") >= 3);
    assert!(metric(&client, "idem_webhook_deliveries_total{result=\"retried\"}") >= 6);
    // Nothing more is sent once failed.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(receiver.got().len(), 6);
}

#[test]
fn a_hanging_receiver_never_holds_up_requests() {
    let receiver = Receiver::start(|_, _| Behave::Hang(Duration::from_secs(5)));
    let (_server, client) = support::server(|c| {
        c.webhook_timeout = Duration::from_secs(4);
        c.webhook_retry_base = Duration::from_millis(20);
    });
    for i in 0..4 {
        endpoint(&client, &receiver.url(&format!("/h{i}")), json!(["*"]));
    }
    // Every charge queues four deliveries; every sender thread is soon
    // stuck in a receiver that answers nothing.
    let mut slowest = Duration::ZERO;
    for i in 0..40 {
        let t = Instant::now();
        let r = client.charge(&format!("k{i}"), &charge_body(1));
        assert_eq!(r.status, 201);
        assert_eq!(client.get("/healthz").status, 200);
        slowest = slowest.max(t.elapsed());
    }
    assert!(
        receiver.got().len() >= 4,
        "the engine is busy with the hang"
    );
    assert!(slowest < Duration::from_millis(1000), "slowest {slowest:?}");
    let backlog = eventually(Duration::from_secs(5), || {
        let n = metric(&client, "idem_webhook_backlog");
        (n > 0).then_some(n)
    });
    assert!(backlog <= 160, "{backlog}");
}

#[test]
fn deleting_an_endpoint_stops_its_deliveries() {
    let down = free_port();
    let (_server, client) = support::server(|c| {
        c.webhook_retry_base = Duration::from_secs(3600);
        c.webhook_timeout = Duration::from_millis(500);
    });
    let (id, _) = endpoint(&client, &format!("http://{down}/"), json!(["*"]));
    client.account("x", false);
    let event = all_events(&client)[0]["id"].as_str().unwrap().to_string();
    // Tried once (nobody listening), now waiting for its retry.
    eventually(Duration::from_secs(10), || {
        let d = deliveries(&client, &event);
        (d[0]["attempts"] == 1 && d[0]["status"] == "pending").then_some(())
    });
    let r = client.request("DELETE", &format!("/v1/webhook_endpoints/{id}"), &[], "");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json(),
        json!({"id": id, "object": "webhook_endpoint", "deleted": true})
    );
    let d = deliveries(&client, &event);
    assert_eq!(d[0]["status"], "failed");
    assert_eq!(d[0]["next_attempt_at"], Value::Null);
    assert!(d[0]["last_error"].as_str().unwrap().contains("deleted"));
    // A retried DELETE answers the same; the endpoint is gone from reads.
    let again = client.request("DELETE", &format!("/v1/webhook_endpoints/{id}"), &[], "");
    assert_eq!((again.status, again.body), (200, r.body));
    assert_eq!(
        client.get(&format!("/v1/webhook_endpoints/{id}")).slug(),
        "not-found"
    );
    assert_eq!(
        client.get("/v1/webhook_endpoints").json()["data"],
        json!([])
    );
    // New events queue nothing for it.
    client.account("y", false);
    let newest = all_events(&client)[0]["id"].as_str().unwrap().to_string();
    assert!(deliveries(&client, &newest).is_empty());
    assert_eq!(metric(&client, "idem_webhook_backlog"), 0);
    let unknown = client.request("DELETE", "/v1/webhook_endpoints/we_nope", &[], "");
    assert_eq!(unknown.slug(), "not-found");
}

#[test]
fn bad_input_is_refused_and_stores_nothing() {
    let (_server, client) = support::server(|_| {});
    let long_url = format!("http://example.com/{}", "a".repeat(2048));
    let long_description = "d".repeat(501);
    #[rustfmt::skip]
    let bodies: Vec<String> = vec![
        "{".into(),
        "[]".into(),
        r#"{"enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a.example","enabled_events":["*"],"url":"http://b.example"}"#.into(),
        r#"{"url":"http://a.example"}"#.into(),
        r#"{"url":"http://a.example","enabled_events":["*"],"colour":"red"}"#.into(),
        r#"{"url":1,"enabled_events":["*"]}"#.into(),
        r#"{"url":"ftp://a.example/","enabled_events":["*"]}"#.into(),
        r#"{"url":"HTTP://a.example/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://","enabled_events":["*"]}"#.into(),
        r#"{"url":"http:///path","enabled_events":["*"]}"#.into(),
        r#"{"url":"a.example","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a example/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a.example/\u0000","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a.exämple/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://user:pw@a.example/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a.example/#frag","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a.example:0/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a.example:65536/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a.example:/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://a.example:8x/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://-a.example/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://[::1/","enabled_events":["*"]}"#.into(),
        r#"{"url":"http://[zz]/","enabled_events":["*"]}"#.into(),
        format!(r#"{{"url":"{long_url}","enabled_events":["*"]}}"#),
        r#"{"url":"http://a.example","enabled_events":[]}"#.into(),
        r#"{"url":"http://a.example","enabled_events":"*"}"#.into(),
        r#"{"url":"http://a.example","enabled_events":null}"#.into(),
        r#"{"url":"http://a.example","enabled_events":[1]}"#.into(),
        r#"{"url":"http://a.example","enabled_events":["charge.refunded"]}"#.into(),
        r#"{"url":"http://a.example","enabled_events":["charge.succeeded","charge.succeeded"]}"#.into(),
        r#"{"url":"http://a.example","enabled_events":["*","charge.succeeded"]}"#.into(),
        r#"{"url":"http://a.example","enabled_events":["*"],"description":7}"#.into(),
        format!(r#"{{"url":"http://a.example","enabled_events":["*"],"description":"{long_description}"}}"#),
    ];
    for body in &bodies {
        let r = client.request("POST", "/v1/webhook_endpoints", &[], body);
        assert_eq!(
            r.status,
            400,
            "{body}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.slug(), "invalid-request", "{body}");
    }
    let good = r#"{"url":"http://a.example","enabled_events":["*"]}"#;
    let bad_key = client.request(
        "POST",
        "/v1/webhook_endpoints",
        &[("Idempotency-Key", "a b")],
        good,
    );
    assert_eq!(bad_key.slug(), "idempotency-key-invalid");
    assert_eq!(
        client.get("/v1/webhook_endpoints").json()["data"],
        json!([])
    );
    // Accepted edges.
    for url in [
        "https://a.example",
        "http://127.0.0.1:65535/hook?x=1&y=%20",
        "http://[::1]:8080/",
        "http://a.example./",
    ] {
        let body = json!({"url": url, "enabled_events": ["charge.succeeded", "refund.created"], "description": "d".repeat(500)});
        let r = client.post("/v1/webhook_endpoints", None, &body);
        assert_eq!(r.status, 201, "{url}: {}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        assert_eq!(v["url"], url);
        assert_eq!(
            v["enabled_events"],
            json!(["charge.succeeded", "refund.created"])
        );
        assert_eq!(v["status"], "enabled");
        assert!(v["secret"].as_str().unwrap().starts_with("whsec_"));
    }
    // Reads and methods.
    assert_eq!(
        client.get("/v1/webhook_endpoints/we_nope").slug(),
        "not-found"
    );
    assert_eq!(
        client.get("/v1/events/evt_nope/deliveries").slug(),
        "not-found"
    );
    assert_eq!(
        client.get("/v1/webhook_endpoints?limit=0").slug(),
        "invalid-request"
    );
    assert_eq!(
        client
            .get("/v1/webhook_endpoints?starting_after=we_nope")
            .slug(),
        "invalid-request"
    );
    for (method, path, allow) in [
        ("PUT", "/v1/webhook_endpoints/we_1", "GET, HEAD, DELETE"),
        ("DELETE", "/v1/webhook_endpoints", "GET, HEAD, POST"),
        ("DELETE", "/v1/events/evt_1/deliveries", "GET, HEAD"),
        ("POST", "/v1/events/evt_1/deliveries", "GET, HEAD"),
    ] {
        let r = client.request(method, path, &[], "");
        assert_eq!(r.status, 405, "{method} {path}");
        assert_eq!(r.header("allow"), Some(allow));
    }
    let no_auth = support::send(
        client.addr,
        "DELETE",
        "/v1/webhook_endpoints/we_1",
        &[],
        b"",
    )
    .unwrap();
    assert_eq!(no_auth.slug(), "unauthorized");
}

#[test]
fn the_endpoint_cap_and_an_idempotent_create() {
    let (_server, client) = support::server(|_| {});
    let body = json!({"url": "http://a.example/", "enabled_events": ["*"]});
    let first = client.post("/v1/webhook_endpoints", Some("we-1"), &body);
    assert_eq!(first.status, 201);
    let replay = client.post("/v1/webhook_endpoints", Some("we-1"), &body);
    assert_eq!((replay.status, &replay.body), (201, &first.body));
    assert!(replay.replayed());
    let reused = client.post(
        "/v1/webhook_endpoints",
        Some("we-1"),
        &json!({"url": "http://b.example/", "enabled_events": ["*"]}),
    );
    assert_eq!(reused.slug(), "idempotency-key-reused");
    let listed = client.get("/v1/webhook_endpoints?limit=100").json();
    assert_eq!(listed["data"].as_array().unwrap().len(), 1);
    // Up to the cap, concurrently: exactly 16 live endpoints.
    let threads: Vec<_> = (0..30)
        .map(|i| {
            let client = client.clone();
            let body = body.clone();
            std::thread::spawn(move || {
                let key = format!("cap-{i}");
                client.post("/v1/webhook_endpoints", Some(&key), &body)
            })
        })
        .collect();
    let answers: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let created = answers.iter().filter(|r| r.status == 201).count();
    assert_eq!(created, 15);
    for r in answers.iter().filter(|r| r.status != 201) {
        assert_eq!(r.status, 422);
        assert_eq!(r.slug(), "webhook-endpoint-limit");
    }
    let page1 = client.get("/v1/webhook_endpoints?limit=10").json();
    assert_eq!(page1["has_more"], true);
    let last = page1["data"][9]["id"].as_str().unwrap().to_string();
    let page2 = client
        .get(&format!(
            "/v1/webhook_endpoints?limit=10&starting_after={last}"
        ))
        .json();
    assert_eq!(page2["data"].as_array().unwrap().len(), 6);
    assert_eq!(page2["has_more"], false);
    // Deleting one makes room for one.
    let r = client.request("DELETE", &format!("/v1/webhook_endpoints/{last}"), &[], "");
    assert_eq!(r.status, 200);
    assert_eq!(
        client.post("/v1/webhook_endpoints", None, &body).status,
        201
    );
    assert_eq!(
        client.post("/v1/webhook_endpoints", None, &body).slug(),
        "webhook-endpoint-limit"
    );
}

/// The crash test: deliveries pending (the receiver down), SIGKILL, restart
/// on the same file with the receiver up; every event reaches every
/// subscribed endpoint with the same `webhook-id` and byte-identical body.
#[test]
fn deliveries_pending_at_a_sigkill_all_arrive_after_the_restart() {
    let dir = TempDir::new("webhooks-kill");
    let db = dir.db();
    let port = free_port();
    let args = [
        "--webhook-retry-base",
        "20ms",
        "--webhook-timeout",
        "500ms",
        "--webhook-attempts-max",
        "40",
    ];
    let child = ChildServer::start(&db, &args, &[]);
    let key = child.initial_key.clone().expect("default key");
    let client = Client::new(child.addr, &key);
    let url = |path: &str| format!("http://{port}{path}");
    let (all, _) = endpoint(&client, &url("/all"), json!(["*"]));
    let (charges, _) = endpoint(&client, &url("/charges"), json!(["charge.succeeded"]));
    client.card_and_shop();
    // Concurrent clients while deliveries fail (nothing listens).
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let client = client.clone();
            std::thread::spawn(move || {
                for i in 0..10 {
                    let r = client.charge(&format!("t{t}-{i}"), &charge_body(100));
                    assert_eq!(r.status, 201);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Some attempts made and recorded, none succeeded, then the kill.
    eventually(Duration::from_secs(10), || {
        (metric(&client, "idem_webhook_deliveries_total{result=\"retried\"}") >= 20).then_some(())
    });
    let events = all_events(&client);
    assert_eq!(events.len(), 42);
    let backlog = events
        .iter()
        .flat_map(|e| deliveries(&client, e["id"].as_str().unwrap()))
        .filter(|d| d["status"] == "pending")
        .count();
    assert_eq!(backlog, 42 + 40, "every delivery pending before the kill");
    child.kill();

    let receiver = Receiver::start_on(port, Arc::new(|_, _| Behave::Status(204)));
    let child = ChildServer::start(&db, &args, &[]);
    let client = Client::new(child.addr, &key);
    let expected: BTreeSet<(String, String)> = events
        .iter()
        .flat_map(|e| {
            let id = e["id"].as_str().unwrap().to_string();
            let mut to = vec![("/all".to_string(), id.clone())];
            if e["type"] == "charge.succeeded" {
                to.push(("/charges".to_string(), id));
            }
            to
        })
        .collect();
    assert_eq!(expected.len(), 82);
    eventually(Duration::from_secs(60), || {
        let got: BTreeSet<(String, String)> = receiver
            .got()
            .iter()
            .map(|r| (r.path.clone(), r.id()))
            .collect();
        (got == expected).then_some(())
    });
    let bodies: BTreeMap<String, Vec<u8>> = events
        .iter()
        .map(|e| {
            let id = e["id"].as_str().unwrap().to_string();
            let bytes = event_bytes(&client, &id);
            (id, bytes)
        })
        .collect();
    for r in receiver.got() {
        assert_eq!(r.body, bodies[&r.id()], "byte-identical after the restart");
    }
    for e in &events {
        for d in deliveries(&client, e["id"].as_str().unwrap()) {
            assert_eq!(d["status"], "succeeded", "{d}");
            assert!([&all, &charges].contains(&&d["endpoint"].as_str().unwrap().to_string()));
        }
    }
    eventually(Duration::from_secs(5), || {
        (metric(&client, "idem_webhook_backlog") == 0).then_some(())
    });
    child.kill();
    support::assert_verified(&db);
}
