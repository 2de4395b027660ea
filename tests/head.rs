//! HEAD through a real server (RFC 9110 §9.3.2: wherever GET is supported,
//! HEAD is too). It answers exactly what GET answers — status, headers,
//! `Content-Length` of GET's body included — and sends no body; it follows
//! GET's auth rules; a 405 lists HEAD wherever GET is allowed; a POST-only
//! route answers HEAD 405 `Allow: POST`; and it is counted in the metrics.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::json;
use support::{charge_body, parse_response, Resp, READ_TIMEOUT};

/// Sends one request (`Connection: close`) and reads to the end: the
/// response, and every byte the server sent after its head.
fn exchange(addr: SocketAddr, method: &str, path: &str, key: Option<&str>) -> (Resp, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(key) = key {
        head.push_str(&format!("Authorization: Bearer {key}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4;
    (parse_response(&raw).unwrap(), raw[end..].to_vec())
}

/// The headers a HEAD must share with its GET: all but `date`.
fn shared_headers(r: &Resp) -> Vec<(String, String)> {
    let mut headers: Vec<_> = r
        .headers
        .iter()
        .filter(|(n, _)| n != "date")
        .cloned()
        .collect();
    headers.sort();
    headers
}

/// GET then HEAD of `path`: the same status and headers, HEAD's
/// `Content-Length` is the length of GET's body, and HEAD sends no body.
fn assert_head_is_get(addr: SocketAddr, path: &str, key: Option<&str>, status: u16) {
    let (get, _) = exchange(addr, "GET", path, key);
    let (head, after_head) = exchange(addr, "HEAD", path, key);
    assert_eq!((get.status, head.status), (status, status), "{path}");
    assert!(!get.body.is_empty(), "{path}: GET has a body");
    assert_eq!(shared_headers(&head), shared_headers(&get), "{path}");
    let length = get.body.len().to_string();
    assert_eq!(
        head.header("content-length"),
        Some(length.as_str()),
        "{path}"
    );
    assert!(
        after_head.is_empty(),
        "{path}: HEAD sent a body: {after_head:?}"
    );
}

/// The count of `idem_http_requests_total` for a route and status.
fn requests(addr: SocketAddr, route: &str, status: u16) -> u64 {
    let (metrics, _) = exchange(addr, "GET", "/metrics", None);
    let prefix = format!("idem_http_requests_total{{route=\"{route}\",status=\"{status}\"}} ");
    String::from_utf8(metrics.body)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).map(|n| n.parse().unwrap()))
        .unwrap_or(0)
}

#[test]
fn head_answers_what_get_answers_without_a_body() {
    let (server, client) = support::server(|_| {});
    let addr = server.addr();
    let key = Some(client.key.as_str());
    let charge = client.charge("h1", &charge_body(300)).json();
    let charge = charge["id"].as_str().unwrap().to_string();
    let refunds = format!("/v1/charges/{charge}/refunds");
    assert_eq!(
        client
            .post(&refunds, Some("r1"), &json!({"amount": 5}))
            .status,
        201
    );
    let prefer = [("Idempotency-Key", "h2"), ("Prefer", "respond-async")];
    let accepted = client.request("POST", "/v1/charges", &prefer, &charge_body(7).to_string());
    let operation = accepted.header("location").unwrap().to_string();
    support::eventually(Duration::from_secs(10), || {
        (client.get(&operation).json()["status"] == "completed").then_some(())
    });

    let public = [("/healthz", 200), ("/openapi.json", 200), ("/nowhere", 404)];
    for (path, status) in public {
        assert_head_is_get(addr, path, None, status);
    }
    let charge_path = format!("/v1/charges/{charge}");
    let authenticated = [
        ("/v1/accounts/card", 200),
        ("/v1/accounts/card/entries?limit=2", 200),
        ("/v1/charges", 200),
        ("/v1/charges?limit=1", 200),
        (charge_path.as_str(), 200),
        (operation.as_str(), 200),
        ("/v1/accounts/nope", 404),
        ("/v1/charges/ch_nope", 404),
        ("/v1/charges?limit=0", 400),
    ];
    for (path, status) in authenticated {
        assert_head_is_get(addr, path, key, status);
    }
    // /metrics changes between two requests (they count themselves), so
    // only its status, type and a length that announces a body.
    let (get, _) = exchange(addr, "GET", "/metrics", None);
    let (head, after_head) = exchange(addr, "HEAD", "/metrics", None);
    assert_eq!(
        (head.status, head.header("content-type")),
        (200, get.header("content-type"))
    );
    let length: usize = head.header("content-length").unwrap().parse().unwrap();
    assert!(
        length > 1000 && after_head.is_empty(),
        "{length} {after_head:?}"
    );
}

/// A HEAD's `Content-Length` announces GET's body, but no body follows: on a
/// keep-alive connection the next response starts right after HEAD's head.
#[test]
fn head_keeps_a_keep_alive_connection_in_step() {
    let (server, _client) = support::server(|_| {});
    let mut stream = TcpStream::connect(server.addr()).unwrap();
    stream.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    let requests = "HEAD /healthz HTTP/1.1\r\nHost: t\r\n\r\n\
                    HEAD /openapi.json HTTP/1.1\r\nHost: t\r\n\r\n\
                    GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
    stream.write_all(requests.as_bytes()).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8(raw).unwrap();
    let parts: Vec<&str> = text.split("\r\n\r\n").collect();
    assert_eq!(parts.len(), 4, "three heads and one body: {text}");
    for head in &parts[..3] {
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    }
    assert!(parts[0].contains("content-length: 15\r\n"), "{text}");
    assert_eq!(parts[3], r#"{"status":"ok"}"#);
}

#[test]
fn head_follows_the_auth_and_method_rules_of_get_and_is_counted() {
    let (server, client) = support::server(|_| {});
    let addr = server.addr();
    let key = Some(client.key.as_str());
    // No key under /v1: 401, known route or not, as GET.
    for path in ["/v1/charges", "/v1/accounts/card", "/v1/nowhere"] {
        assert_head_is_get(addr, path, None, 401);
        let (head, _) = exchange(addr, "HEAD", path, None);
        assert_eq!(head.header("www-authenticate"), Some("Bearer"));
    }
    // POST-only routes: HEAD is 405 `Allow: POST`, with the length of the
    // problem it does not send.
    for path in ["/v1/accounts", "/v1/charges/ch_x/refunds"] {
        let (get, _) = exchange(addr, "GET", path, key);
        let (head, after_head) = exchange(addr, "HEAD", path, key);
        assert_eq!(
            (get.status, get.slug().as_str()),
            (405, "method-not-allowed")
        );
        assert_eq!(
            (head.status, head.header("allow")),
            (405, Some("POST")),
            "{path}"
        );
        assert_eq!(shared_headers(&head), shared_headers(&get), "{path}");
        assert!(after_head.is_empty());
    }
    // Every 405 lists HEAD wherever GET is allowed.
    let allows = [
        ("DELETE", "/v1/charges", "GET, HEAD, POST"),
        ("PUT", "/v1/accounts/card", "GET, HEAD"),
        ("POST", "/v1/accounts/card/entries", "GET, HEAD"),
        ("PATCH", "/v1/operations/op_x", "GET, HEAD"),
        ("POST", "/healthz", "GET, HEAD"),
        ("POST", "/metrics", "GET, HEAD"),
        ("DELETE", "/openapi.json", "GET, HEAD"),
        ("GET", "/v1/accounts", "POST"),
    ];
    for (method, path, allow) in allows {
        let (r, _) = exchange(addr, method, path, key);
        assert_eq!(
            (r.status, r.slug().as_str()),
            (405, "method-not-allowed"),
            "{method} {path}"
        );
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
    }
    // Counted under its route and status, like GET.
    let before = requests(addr, "/v1/accounts/{id}", 200);
    for _ in 0..3 {
        assert_eq!(
            exchange(addr, "HEAD", "/v1/accounts/card", key).0.status,
            200
        );
    }
    assert_eq!(requests(addr, "/v1/accounts/{id}", 200), before + 3);
    let before = requests(addr, "/v1/accounts", 405);
    exchange(addr, "HEAD", "/v1/accounts", key);
    assert_eq!(requests(addr, "/v1/accounts", 405), before + 1);
}
