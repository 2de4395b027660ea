//! What real networks send: slow, idle, half-sent, oversized, ambiguous and
//! too many connections, and handlers that panic. Each test states the
//! answer it expects and checks that the server still serves others.
//!
//! Servers here run with short limits (1 s timeouts, a cap of 16) so the
//! tests finish fast; deadlines for "still served promptly" are generous
//! (2 s), because CI shares 2 cores between everything.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use idem::config::HttpLimits;
use serde_json::json;
use support::{charge_body, parse_response, Client, Resp};

/// What "served promptly" means on a loaded 2-core machine.
const PROMPT: Duration = Duration::from_secs(2);
/// The short timeouts the servers of these tests run with.
const SHORT: Duration = Duration::from_secs(1);

/// Tests that open hundreds of sockets take turns, so that together they
/// stay far below a 1024-descriptor limit.
static MANY_SOCKETS: Mutex<()> = Mutex::new(());

fn many_sockets() -> std::sync::MutexGuard<'static, ()> {
    MANY_SOCKETS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A raw keep-alive connection: writes bytes as given, reads responses one
/// at a time (framed by Content-Length), and tells when the server closed.
struct Raw {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    fn connect(addr: SocketAddr) -> Raw {
        let stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        Raw {
            stream,
            buf: Vec::new(),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write request");
    }

    /// Reads more bytes; false on EOF or reset.
    fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 8192];
        match self.stream.read(&mut chunk) {
            Ok(0) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
            Err(e) if is_reset(&e) => false,
            Err(e) => panic!("read: {e}"),
        }
    }

    /// The next response, or None if the connection closed first.
    fn response(&mut self) -> Option<Resp> {
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = parse_response(&self.buf[..end + 4]).expect("response head");
                let len: usize = head
                    .header("content-length")
                    .map_or(0, |v| v.parse().expect("content-length"));
                while self.buf.len() < end + 4 + len {
                    assert!(self.fill(), "closed in the middle of a body");
                }
                let raw: Vec<u8> = self.buf.drain(..end + 4 + len).collect();
                return Some(parse_response(&raw).expect("response"));
            }
            if !self.fill() {
                assert!(self.buf.is_empty(), "closed mid-response: {:?}", self.buf);
                return None;
            }
        }
    }

    /// Waits (up to `within`) for the server to close; returns how long it
    /// took, or None if it did not. Any bytes that arrive are kept.
    fn closed_within(&mut self, within: Duration) -> Option<Duration> {
        let started = Instant::now();
        loop {
            let left = within.saturating_sub(started.elapsed());
            if left.is_zero() {
                return None;
            }
            self.stream.set_read_timeout(Some(left)).unwrap();
            let mut chunk = [0u8; 8192];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Some(started.elapsed()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if is_reset(&e) => return Some(started.elapsed()),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return None
                }
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    /// Everything until the server closes (within 10 s).
    fn rest(&mut self) -> Vec<u8> {
        assert!(
            self.closed_within(Duration::from_secs(10)).is_some(),
            "the server did not close the connection"
        );
        std::mem::take(&mut self.buf)
    }
}

fn is_reset(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
    )
}

/// A keep-alive request head (no `Connection: close`).
fn request(method: &str, path: &str, key: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {key}\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn healthz(addr: SocketAddr) -> Resp {
    support::send(addr, "GET", "/healthz", &[], b"").expect("GET /healthz")
}

/// `GET /healthz` answers 200 within `PROMPT`.
fn assert_served_promptly(addr: SocketAddr, what: &str) {
    let started = Instant::now();
    let r = healthz(addr);
    let took = started.elapsed();
    assert_eq!(r.status, 200, "{what}");
    assert!(took < PROMPT, "{what}: /healthz took {took:?}");
}

/// The value of the metric line that starts with `line_prefix` (0 if absent).
fn metric(addr: SocketAddr, line_prefix: &str) -> u64 {
    let r = support::send(addr, "GET", "/metrics", &[], b"").expect("GET /metrics");
    let text = String::from_utf8(r.body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix))
        .map_or(0, |n| n.trim().parse().expect("a counter"))
}

/// Waits until the metric reaches `want`: a connection task counts hyper's
/// own answers when the connection ends, a moment after the client sees it
/// closed.
fn assert_metric(addr: SocketAddr, line_prefix: &str, want: u64, why: &str) {
    let mut got = 0;
    let reached = (0..40).any(|_| {
        got = metric(addr, line_prefix);
        got == want || {
            std::thread::sleep(Duration::from_millis(50));
            false
        }
    });
    assert!(reached, "{why}: {line_prefix} is {got}, not {want}");
}

// ---------------------------------------------------------------------------
// Slow and idle connections

/// Hundreds of connections that send nothing and a hundred that stall
/// half-way through a header line: real requests are still answered at
/// once, and the server closes every slow one after its 1 s timeout.
/// Runs the real binary, with the limits as `serve` flags.
#[test]
fn slowloris_does_not_starve_real_clients_and_is_closed_after_the_timeout() {
    const IDLE: usize = 300;
    const HALF: usize = 100;
    let _turn = many_sockets();
    let dir = support::TempDir::new("slowloris");
    let server = support::ChildServer::start(
        &dir.db(),
        &["--header-read-timeout", "1s", "--idle-timeout", "1s"],
        &[],
    );
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let opened = Instant::now();
    let mut slow: Vec<Raw> = (0..IDLE).map(|_| Raw::connect(server.addr)).collect();
    for _ in 0..HALF {
        let mut half = Raw::connect(server.addr);
        half.send(b"POST /v1/charges HTTP/1.1\r\nHost: idem\r\nX-Slow: aaaa");
        slow.push(half);
    }
    for i in 0..3 {
        assert_served_promptly(server.addr, "beside the slow connections");
        let started = Instant::now();
        let r = client.charge(&format!("real-{i}"), &charge_body(10));
        assert_eq!(r.status, 201);
        assert!(
            started.elapsed() < PROMPT,
            "a charge took {:?}",
            started.elapsed()
        );
    }
    // Every slow connection is closed by the server, without an answer.
    let deadline = opened + SHORT + Duration::from_secs(5);
    for (i, conn) in slow.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            conn.closed_within(left.max(Duration::from_millis(1)))
                .is_some(),
            "slow connection {i} still open {:?} after it opened",
            opened.elapsed()
        );
        assert!(conn.buf.is_empty(), "no answer to a request never sent");
    }
    assert_served_promptly(server.addr, "after the slow connections");
    assert_eq!(client.all_charges().len(), 3);
}

/// A keep-alive connection that got its answer and went silent is closed
/// after the idle timeout — by our idle timer when it is the shorter, by
/// hyper's header read timer (which restarts after each response) when that
/// one is. A connection that keeps talking stays open, and a request that
/// takes longer than the idle timeout to answer is not cut.
fn idle_keep_alive_case(header_read_timeout: Duration, idle_timeout: Duration) {
    let limits = HttpLimits {
        header_read_timeout,
        idle_timeout,
        ..HttpLimits::default()
    };
    let short = header_read_timeout.min(idle_timeout);
    let (server, client) = support::server(|c| {
        c.http = limits;
        c.acquirer_latency = short + short / 2;
    });
    let case = format!("header read {header_read_timeout:?}, idle {idle_timeout:?}");
    let ask = |raw: &mut Raw| {
        raw.send(&request("GET", "/v1/accounts/shop", &client.key, "", ""));
        raw.response().map(|r| r.status)
    };

    let mut silent = Raw::connect(server.addr());
    // Timed from before the request: the server's timer starts after its
    // answer is written, so however late this thread runs, the close cannot
    // come sooner than the timeout after this instant.
    let asked = Instant::now();
    assert_eq!(ask(&mut silent), Some(200), "{case}");
    let closed = silent.closed_within(short * 5);
    closed.unwrap_or_else(|| panic!("{case}: an idle connection was never closed"));
    let took = asked.elapsed();
    assert!(
        took >= short.mul_f32(0.95) && silent.buf.is_empty(),
        "{case}: closed after {took:?}, sooner than the timeout"
    );

    // Talking every 0.4 × timeout for 2.5 × timeout: never idle that long.
    let mut chatty = Raw::connect(server.addr());
    let started = Instant::now();
    while started.elapsed() < short * 5 / 2 {
        assert_eq!(
            ask(&mut chatty),
            Some(200),
            "{case}: a busy connection was closed"
        );
        std::thread::sleep(short.mul_f32(0.4));
    }

    // A charge whose acquirer takes 1.5 × timeout: in flight is not idle.
    let mut slow = Raw::connect(server.addr());
    let body = charge_body(5).to_string();
    slow.send(&request(
        "POST",
        "/v1/charges",
        &client.key,
        "Idempotency-Key: slow-charge\r\n",
        &body,
    ));
    let r = slow.response();
    assert_eq!(
        r.map(|r| r.status),
        Some(201),
        "{case}: a slow answer was cut"
    );
}

#[test]
fn an_idle_keep_alive_connection_is_closed_by_the_idle_timeout() {
    idle_keep_alive_case(Duration::from_secs(60), SHORT);
}

#[test]
fn an_idle_keep_alive_connection_is_closed_by_the_header_read_timeout() {
    idle_keep_alive_case(SHORT, Duration::from_secs(60));
}

/// A body shorter than its declared Content-Length: 400 after the body
/// timeout and the connection closed. No worker waits for the body (a
/// request reaches a worker only once its body is in), so with one worker
/// and more stalled bodies than workers, others are still served; the key
/// of the stalled request stays free.
#[test]
fn a_body_shorter_than_its_content_length_is_400_after_the_body_timeout() {
    const STALLED: usize = 4;
    let (server, client) = support::server(|c| {
        c.workers = 1;
        c.http = HttpLimits {
            body_read_timeout: SHORT,
            ..HttpLimits::default()
        };
    });
    let head = format!(
        "POST /v1/charges HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {}\r\nIdempotency-Key: stalled\r\nContent-Length: 100\r\n\r\n{{\"amount\":",
        client.key
    );
    let started = Instant::now();
    let mut stalled: Vec<Raw> = (0..STALLED)
        .map(|_| {
            let mut raw = Raw::connect(server.addr());
            raw.send(head.as_bytes());
            raw
        })
        .collect();
    assert_served_promptly(server.addr(), "while bodies stall");
    for raw in &mut stalled {
        let r = raw.response().expect("an answer to the stalled body");
        let took = started.elapsed();
        assert_eq!((r.status, r.slug().as_str()), (400, "invalid-request"));
        assert!(
            took >= SHORT.mul_f32(0.8) && took < SHORT + PROMPT,
            "answered after {took:?}"
        );
        assert!(raw.closed_within(PROMPT).is_some(), "closed after the 400");
    }
    let ok = client.charge("stalled", &charge_body(7));
    assert_eq!(ok.status, 201, "the key of the stalled request is free");
    assert!(!ok.replayed());
    assert_metric(
        server.addr(),
        "idem_http_requests_total{route=\"/v1/charges\",status=\"400\"}",
        STALLED as u64,
        "the engine's 400s are counted",
    );
}

// ---------------------------------------------------------------------------
// Oversized headers

/// One huge header line, too many headers, too many header bytes in total:
/// 431 and the connection closed. A client that streams header bytes
/// without end is cut off after the limit, so the server buffers no more
/// than that.
#[test]
fn oversized_or_too_many_headers_are_431_and_closed() {
    let (server, client) = support::server(|_| {});
    let long_line = format!("X-Long: {}\r\n", "a".repeat(20 * 1024));
    let many: String = (0..150).map(|i| format!("X-H{i}: v\r\n")).collect();
    let bulky: String = (0..60)
        .map(|i| format!("X-B{i}: {}\r\n", "b".repeat(300)))
        .collect();
    for (name, extra) in [
        ("a 20 KiB header line", &long_line),
        ("150 headers", &many),
        ("60 headers of 300 bytes", &bulky),
    ] {
        let mut raw = Raw::connect(server.addr());
        raw.send(&request("GET", "/v1/accounts/shop", &client.key, extra, ""));
        let r = raw
            .response()
            .unwrap_or_else(|| panic!("{name}: no answer"));
        assert_eq!(r.status, 431, "{name}");
        assert!(raw.rest().is_empty(), "{name}: closed after the 431");
    }

    let mut endless = TcpStream::connect(server.addr()).unwrap();
    endless
        .set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    endless
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: idem\r\nX-Endless: ")
        .unwrap();
    let chunk = vec![b'z'; 64 * 1024];
    let mut sent = 0usize;
    let cut = loop {
        if let Err(e) = endless.write_all(&chunk) {
            break e;
        }
        sent += chunk.len();
        assert!(sent < 256 << 20, "the server read 256 MiB of one header");
    };
    assert!(
        is_reset(&cut),
        "cut off by a close, not stalled: {cut} after {sent} bytes"
    );
    assert_served_promptly(server.addr(), "after oversized headers");
    assert_metric(
        server.addr(),
        "idem_http_requests_total{route=\"unmatched\",status=\"431\"}",
        4,
        "hyper's own 431s are counted",
    );
}

// ---------------------------------------------------------------------------
// Request smuggling

/// A request whose framing is ambiguous or malformed, carrying a complete
/// second request in its body: 400, the connection closed, and the second
/// request never executed (the account it would create does not exist).
#[test]
fn ambiguous_framing_is_400_and_close_and_never_a_second_request() {
    let (server, client) = support::server(|_| {});
    let cases: &[(&str, &str, &str)] = &[
        ("not a number", "HTTP/1.1", "Content-Length: abc\r\n"),
        (
            "two lengths",
            "HTTP/1.1",
            "Content-Length: 5\r\nContent-Length: 50\r\n",
        ),
        ("a list of lengths", "HTTP/1.1", "Content-Length: 5, 50\r\n"),
        ("a signed length", "HTTP/1.1", "Content-Length: +5\r\n"),
        ("a negative length", "HTTP/1.1", "Content-Length: -5\r\n"),
        (
            "a space before the colon",
            "HTTP/1.1",
            "Content-Length : 5\r\n",
        ),
        ("gzip only", "HTTP/1.1", "Transfer-Encoding: gzip\r\n"),
        (
            "chunked not last",
            "HTTP/1.1",
            "Transfer-Encoding: chunked, identity\r\n",
        ),
        ("identity", "HTTP/1.1", "Transfer-Encoding: identity\r\n"),
        (
            "chunked in HTTP/1.0",
            "HTTP/1.0",
            "Transfer-Encoding: chunked\r\n",
        ),
    ];
    for (i, (name, version, framing)) in cases.iter().enumerate() {
        let smuggled = smuggled_account(&client.key, &format!("smuggled-{i}"));
        let raw_request = format!(
            "POST /v1/accounts {version}\r\nHost: idem\r\nAuthorization: Bearer {}\r\n{framing}\r\n{smuggled}",
            client.key
        );
        let mut raw = Raw::connect(server.addr());
        raw.send(raw_request.as_bytes());
        let r = raw
            .response()
            .unwrap_or_else(|| panic!("{name}: no answer"));
        assert_eq!(r.status, 400, "{name}");
        let after = raw.rest();
        assert!(
            after.is_empty(),
            "{name}: a second answer: {}",
            String::from_utf8_lossy(&after)
        );
    }
    for i in 0..cases.len() {
        let r = client.get(&format!("/v1/accounts/smuggled-{i}"));
        assert_eq!(r.status, 404, "case {i}: the smuggled request ran");
    }
    assert_metric(
        server.addr(),
        "idem_http_requests_total{route=\"unmatched\",status=\"400\"}",
        cases.len() as u64,
        "hyper's own 400s are counted",
    );
    assert_served_promptly(server.addr(), "after the smuggling attempts");
}

/// `Transfer-Encoding: chunked` with a `Content-Length`: the chunked framing
/// wins (RFC 9112 §6.3) and the connection is closed after the answer, so
/// the bytes after the chunked body — a second request — are never run.
#[test]
fn chunked_with_content_length_closes_after_one_answer() {
    let (server, client) = support::server(|_| {});
    let first = r#"{"id":"te-first","currency":"BRL"}"#;
    let smuggled = smuggled_account(&client.key, "te-smuggled");
    let raw_request = format!(
        "POST /v1/accounts HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{first}\r\n0\r\n\r\n{smuggled}",
        client.key,
        first.len()
    );
    let mut raw = Raw::connect(server.addr());
    raw.send(raw_request.as_bytes());
    let r = raw.response().expect("an answer");
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    assert!(raw.rest().is_empty(), "exactly one answer, then close");
    assert_eq!(client.get("/v1/accounts/te-smuggled").status, 404);
}

/// A complete request that would create account `id`.
fn smuggled_account(key: &str, id: &str) -> String {
    let body = json!({"id": id, "currency": "BRL"}).to_string();
    format!(
        "POST /v1/accounts HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {key}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

// ---------------------------------------------------------------------------
// Too many connections

/// Beyond the cap (16), every new connection is refused at once (a 503
/// problem or a plain close, never a hang or a 200) while the 16 admitted
/// ones keep being served; once they close, service recovers.
#[test]
fn a_connection_flood_beyond_the_cap_is_refused_and_service_recovers() {
    const CAP: usize = 16;
    const FLOOD: usize = 64;
    let _turn = many_sockets();
    let (server, client) = support::server(|c| {
        // Admitted connections stay open however long the test takes.
        c.http = HttpLimits {
            connections_max: CAP,
            header_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            ..HttpLimits::default()
        };
    });
    // The setup's connections may hold their slots a moment after their
    // answers; a refused connection is tried again until 16 are admitted,
    // which then fill the cap exactly.
    let mut admitted: Vec<Raw> = (0..CAP)
        .map(|_| {
            support::eventually(PROMPT, || {
                let mut raw = Raw::connect(server.addr());
                let sent = raw
                    .stream
                    .write_all(&request("GET", "/healthz", &client.key, "", ""));
                let served = sent.is_ok() && raw.response().is_some_and(|r| r.status == 200);
                served.then_some(raw)
            })
        })
        .collect();
    let barrier = Arc::new(Barrier::new(FLOOD));
    let flood: Vec<_> = (0..FLOOD)
        .map(|_| {
            let (addr, barrier, key) = (server.addr(), barrier.clone(), client.key.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let started = Instant::now();
                let mut raw = Raw::connect(addr);
                let _ = raw
                    .stream
                    .write_all(&request("GET", "/healthz", &key, "", ""));
                let answer = raw.response();
                (answer, started.elapsed())
            })
        })
        .collect();
    let mut told = 0;
    for refused in flood {
        let (answer, took) = refused.join().unwrap();
        // A refusal beyond those drained at once may be a bare close.
        if let Some(r) = answer {
            assert_eq!(
                (r.status, r.slug().as_str()),
                (503, "temporarily-unavailable")
            );
            assert_eq!(r.header("connection"), Some("close"));
            told += 1;
        }
        assert!(took < PROMPT, "refused at once, not after {took:?}");
    }
    assert!(
        told >= FLOOD / 2,
        "only {told} of {FLOOD} refused clients read the 503"
    );
    for raw in &mut admitted {
        raw.send(&request("GET", "/healthz", &client.key, "", ""));
        assert_eq!(raw.response().map(|r| r.status), Some(200), "admitted");
    }
    drop(admitted);
    let r = support::eventually(PROMPT, || {
        client
            .try_request("GET", "/v1/accounts/shop", &[], "")
            .ok()
            .filter(|r| r.status == 200)
    });
    assert_eq!(r.json()["id"], "shop");
    assert!(
        metric(
            server.addr(),
            "idem_http_requests_total{route=\"unmatched\",status=\"503\"}"
        ) >= 1,
        "refusals are counted"
    );
}

/// A child `idem serve` whose descriptor limit is lowered (prlimit) to a
/// few above what it uses: more connections than descriptors make
/// `accept` fail; the accept loop logs, retries and, once the clients
/// close, serves again — charges included.
#[test]
fn the_accept_loop_survives_file_descriptor_exhaustion() {
    const CONNECTIONS: usize = 100;
    const SPARE_FDS: usize = 16;
    let _turn = many_sockets();
    let dir = support::TempDir::new("fds");
    let server = support::ChildServer::start(
        &dir.db(),
        &["--header-read-timeout", "60s", "--idle-timeout", "60s"],
        &[],
    );
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    assert_eq!(client.charge("before", &charge_body(1)).status, 201);
    let pid = server.child.id();
    let open_fds = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    // Let the connections of the setup close.
    let mut used = open_fds();
    support::eventually(Duration::from_secs(5), || {
        std::thread::sleep(Duration::from_millis(200));
        let now = open_fds();
        let settled = now == used;
        used = now;
        settled.then_some(())
    });
    let limit = (used + SPARE_FDS).to_string();
    let lowered = std::process::Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={limit}:{limit}"))
        .status()
        .expect("prlimit (util-linux) is needed to lower the server's descriptor limit");
    assert!(lowered.success(), "prlimit failed");

    let hogs: Vec<TcpStream> = (0..CONNECTIONS)
        .filter_map(|_| TcpStream::connect_timeout(&server.addr, PROMPT).ok())
        .collect();
    assert!(hogs.len() > SPARE_FDS * 2, "only {} connected", hogs.len());
    let exhausted = support::eventually(Duration::from_secs(5), || {
        let lines = server.stderr_lines();
        lines.into_iter().find(|l| l.contains("accept failed"))
    });
    assert!(exhausted.contains("os error 24"), "EMFILE: {exhausted}");
    drop(hogs);

    let ok = support::eventually(Duration::from_secs(10), || {
        client
            .try_request("GET", "/healthz", &[], "")
            .ok()
            .filter(|r| r.status == 200)
    });
    assert_eq!(ok.json(), json!({"status": "ok"}));
    let charged = support::eventually(Duration::from_secs(10), || {
        let r = client.try_request(
            "POST",
            "/v1/charges",
            &[("Idempotency-Key", "after")],
            &charge_body(2).to_string(),
        );
        r.ok().filter(|r| r.status == 201 || r.replayed())
    });
    assert_eq!(charged.json()["amount"], 2);
    assert!(server.child.id() == pid, "the same process");
    assert_eq!(client.all_charges().len(), 2);
}

// ---------------------------------------------------------------------------
// Panics

/// A handler that panics on a worker (more times than there are workers):
/// each request gets a 500 `internal-error` problem, the workers survive
/// (every one of them panicked at least once, and the server still
/// answers), and the key — never reserved — is free for the retry.
#[test]
fn a_panicking_handler_answers_500_and_the_workers_survive() {
    const WORKERS: usize = 2;
    const PANICS: usize = WORKERS * 3;
    let panics = Arc::new(AtomicUsize::new(0));
    let (server, client) = support::server(|c| {
        c.workers = WORKERS;
        let panics = Arc::clone(&panics);
        c.hooks.before_handler = Some(Arc::new(move |method: &str, path: &str| {
            if method == "POST"
                && path == "/v1/charges"
                && panics.fetch_add(1, Ordering::SeqCst) < PANICS
            {
                panic!("test: a bug in the handler");
            }
        }));
    });
    for _ in 0..PANICS {
        let r = client.charge("panic-key", &charge_body(30));
        assert_eq!((r.status, r.slug().as_str()), (500, "internal-error"));
    }
    assert_served_promptly(server.addr(), "after panics on every worker");
    let ok = client.charge("panic-key", &charge_body(30));
    assert_eq!(ok.status, 201);
    assert!(!ok.replayed());
    assert_eq!(client.balance("shop"), 30);
    assert_eq!(
        metric(
            server.addr(),
            "idem_http_requests_total{route=\"/v1/charges\",status=\"500\"}"
        ),
        PANICS as u64
    );
}

/// A panic inside an owned operation, after the acquirer authorized and
/// before the ledger phase, on more charges than the operation pool has
/// threads: each answers 500 `internal-error`, its key is unlocked at once
/// (the retry is not a 409 although the in-flight timeout is a minute), and
/// the retry asks the acquirer again under the same key (a charge's
/// authorization is recorded with its ledger phase): the same
/// authorization, one charge, per key. The pool threads survive.
#[test]
fn a_panic_in_an_operation_leaves_its_key_resumable_and_the_pool_serving() {
    const CHARGES: usize = idem::config::OPERATION_THREADS + 6;
    let dir = support::TempDir::new("op-panic");
    let acquirer = support::CountingAcquirer::new();
    let panics = Arc::new(AtomicUsize::new(0));
    let (server, client) = support::server_with_acquirer(&dir, acquirer.clone(), |c| {
        c.synchronous = idem::Synchronous::Normal;
        c.inflight_timeout = Duration::from_secs(60);
        let panics = Arc::clone(&panics);
        c.hooks.before_ledger_phase = Some(Arc::new(move |_op: &str| {
            if panics.fetch_add(1, Ordering::SeqCst) < CHARGES {
                panic!("test: a bug before the ledger phase");
            }
        }));
    });
    for i in 0..CHARGES {
        let r = client.charge(&format!("op-panic-{i}"), &charge_body(3));
        assert_eq!((r.status, r.slug().as_str()), (500, "internal-error"));
    }
    assert!(client.all_charges().is_empty(), "no effect yet");
    assert_eq!(acquirer.calls(), CHARGES);
    for i in 0..CHARGES {
        let r = client.charge(&format!("op-panic-{i}"), &charge_body(3));
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        assert!(!r.replayed());
        let again = client.charge(&format!("op-panic-{i}"), &charge_body(3));
        assert!(again.replayed());
        assert_eq!(again.body, r.body);
    }
    assert_eq!(acquirer.calls(), 2 * CHARGES, "each retry asked again");
    let charges = client.all_charges();
    assert_eq!(charges.len(), CHARGES);
    let authorizations: std::collections::BTreeSet<&str> = charges
        .iter()
        .map(|c| c["authorization"].as_str().unwrap())
        .collect();
    assert_eq!(authorizations.len(), CHARGES, "one authorization per key");
    assert_eq!(client.balance("shop"), 3 * CHARGES as i64);
    let db = server.db_path().to_path_buf();
    server.shutdown();
    support::assert_verified(&db);
}

// ---------------------------------------------------------------------------
// Reflection

/// Nothing a client sends — an idempotency key, a path, a header — comes
/// back in a response header: the only headers are the engine's and the
/// API's own, and `Location` is built from a server-made id.
#[test]
fn nothing_a_client_sends_is_reflected_into_a_response_header() {
    let (server, client) = support::server(|_| {});
    const MARK: &str = "zq7mark";
    let body = charge_body(1).to_string();
    let cases: Vec<(String, Vec<u8>)> = vec![
        (
            "a key that looks like a header".into(),
            request(
                "POST",
                "/v1/charges",
                &client.key,
                &format!(
                    "Idempotency-Key: {MARK}%0d%0aSet-Cookie:a=b\r\nPrefer: respond-async\r\n"
                ),
                &body,
            ),
        ),
        (
            "a quoted key".into(),
            request(
                "POST",
                "/v1/charges",
                &client.key,
                &format!("Idempotency-Key: \"{MARK}-q\"\r\nPrefer: respond-async\r\n"),
                &body,
            ),
        ),
        (
            "a key with obs-text bytes".into(),
            [
                &b"POST /v1/charges HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer "[..],
                client.key.as_bytes(),
                b"\r\nIdempotency-Key: ",
                MARK.as_bytes(),
                b"\xff\xfe\r\nContent-Length: 2\r\n\r\n{}",
            ]
            .concat(),
        ),
        (
            "an encoded CRLF in the path".into(),
            request(
                "GET",
                &format!("/v1/operations/op_{MARK}%0d%0aSet-Cookie:%20a=b"),
                &client.key,
                "",
                "",
            ),
        ),
        (
            "a wrong method".into(),
            request(
                "DELETE",
                &format!("/v1/charges/{MARK}"),
                &client.key,
                &format!("Origin: http://{MARK}\r\nX-Request-Id: {MARK}\r\n"),
                "",
            ),
        ),
        (
            "a bad bearer key".into(),
            request("GET", "/v1/charges", MARK, "", ""),
        ),
    ];
    let allowed = [
        "content-type",
        "content-length",
        "date",
        "connection",
        "retry-after",
        "allow",
        "location",
        "idempotent-replayed",
        "www-authenticate",
    ];
    for (name, bytes) in cases {
        let mut raw = Raw::connect(server.addr());
        raw.send(&bytes);
        let r = raw
            .response()
            .unwrap_or_else(|| panic!("{name}: no answer"));
        for (header, value) in &r.headers {
            assert!(
                allowed.contains(&header.as_str()),
                "{name}: unexpected header {header}: {value}"
            );
            assert!(
                !value.contains(MARK),
                "{name}: reflected in {header}: {value}"
            );
        }
        if let Some(location) = r.header("location") {
            let id = location.strip_prefix("/v1/operations/op_").expect(location);
            assert!(id.chars().all(|c| c.is_ascii_alphanumeric()), "{location}");
        }
    }
}

// ---------------------------------------------------------------------------
// Keep-alive fairness

/// `conns` keep-alive connections opened in one burst, each sending a
/// charge, a read and a health check on the same connection: every
/// connection gets all three answers (counting connections, not requests:
/// a load tool reports no error for a connection that is never read).
fn burst_of_keep_alive_connections(conns: usize) {
    const REQUESTS: usize = 3;
    let _turn = many_sockets();
    let (server, client) = support::server(|_| {});
    let barrier = Arc::new(Barrier::new(conns));
    let threads: Vec<_> = (0..conns)
        .map(|i| {
            let (addr, barrier, key) = (server.addr(), barrier.clone(), client.key.clone());
            std::thread::spawn(move || {
                let mut raw = Raw::connect(addr);
                barrier.wait();
                let body = charge_body(1).to_string();
                let key_header = format!("Idempotency-Key: burst-{i}\r\n");
                let requests = [
                    request("POST", "/v1/charges", &key, &key_header, &body),
                    request("GET", "/v1/accounts/shop", &key, "", ""),
                    request("GET", "/healthz", &key, "", ""),
                ];
                let mut answered = 0;
                for (req, want) in requests.iter().zip([201, 200, 200]) {
                    raw.send(req);
                    match raw.response() {
                        Some(r) if r.status == want => answered += 1,
                        other => panic!("connection {i}: {:?}", other.map(|r| r.status)),
                    }
                }
                answered
            })
        })
        .collect();
    let answered: Vec<usize> = threads
        .into_iter()
        .map(|t| t.join().expect("a connection thread"))
        .collect();
    let served = answered.iter().filter(|&&n| n == REQUESTS).count();
    assert_eq!(served, conns, "connections that got all their answers");
    assert_eq!(client.all_charges().len(), conns);
}

#[test]
fn a_burst_of_64_keep_alive_connections_is_all_served() {
    burst_of_keep_alive_connections(64);
}

#[test]
fn a_burst_of_256_keep_alive_connections_is_all_served() {
    burst_of_keep_alive_connections(256);
}

// ---------------------------------------------------------------------------
// Configuration

/// Each engine limit is a `serve` flag, and zero (or below hyper's buffer
/// floor) is refused as bad usage, exit 2, before anything starts.
#[test]
fn engine_limit_flags_refuse_zero() {
    let dir = support::TempDir::new("flags");
    let cases: &[(&str, &str)] = &[
        ("--header-read-timeout", "0s"),
        ("--body-read-timeout", "0ms"),
        ("--idle-timeout", "0s"),
        ("--connections-max", "0"),
        ("--header-bytes-max", "0"),
        ("--header-bytes-max", "4096"),
    ];
    for (flag, value) in cases {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["serve", "--addr", "127.0.0.1:0", "--db"])
            .arg(dir.db())
            .args([flag, value])
            .output()
            .expect("run idem serve");
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(flag),
            "{flag} {value}: the error names the flag"
        );
    }
    assert!(!dir.db().exists(), "nothing was created");
    let zero = HttpLimits {
        idle_timeout: Duration::ZERO,
        ..HttpLimits::default()
    };
    let embedded = idem::Server::start_temporary(|c| c.http = zero);
    assert!(embedded.is_err(), "the embedding API refuses it too");
}

/// The `serve` flags default to the named constants (the flags spell their
/// defaults as text, so this catches one changed without the other).
#[test]
fn engine_limit_flags_default_to_the_named_constants() {
    use idem::config::{
        BODY_READ_TIMEOUT, CONNECTIONS_MAX, HEADER_BYTES_MAX, HEADER_READ_TIMEOUT, IDLE_TIMEOUT,
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--help"])
        .output()
        .expect("run idem serve --help");
    let help = String::from_utf8(out.stdout).unwrap();
    let seconds = |d: Duration| format!("{}s", d.as_secs());
    let cases = [
        ("--header-read-timeout", seconds(HEADER_READ_TIMEOUT)),
        ("--body-read-timeout", seconds(BODY_READ_TIMEOUT)),
        ("--idle-timeout", seconds(IDLE_TIMEOUT)),
        ("--header-bytes-max", HEADER_BYTES_MAX.to_string()),
        ("--connections-max", CONNECTIONS_MAX.to_string()),
    ];
    for (flag, default) in cases {
        let after = &help[help
            .find(flag)
            .unwrap_or_else(|| panic!("{flag} in --help"))..];
        let entry = &after[..after[2..].find("\n      --").map_or(after.len(), |i| i + 2)];
        assert!(
            entry.contains(&format!("[default: {default}]")),
            "{flag} defaults to {default}: {entry}"
        );
    }
}
