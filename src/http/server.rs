//! The connection engine: hyper (HTTP/1.1) on a small tokio runtime.
//!
//! The design card named tiny_http 0.12; measured here it leaves some
//! keep-alive connections unanswered under a burst of new connections, has no
//! read timeouts, accepts unbounded header lines and mis-frames
//! `Content-Length: abc`. hyper keeps idle connections cheap (a task, not a
//! thread), frames strictly, bounds header bytes and times out slow headers.
//! It only moves bytes: each complete request is handed to a pool of
//! synchronous worker threads, which run the handler and send the reply back.
//!
//! What a hostile or broken client can do, and what bounds it (the limits are
//! [`HttpLimits`]): send headers slowly or not at all (hyper's header read
//! timeout, which also runs between keep-alive requests, and our idle
//! timeout: no byte either way and no request in flight); declare a body it
//! never sends (the body read timeout, then 400 and close); send huge or
//! too many headers (hyper's buffer cap and header count, 431 and close);
//! frame a body ambiguously (hyper answers 400 and closes, or lets
//! `Transfer-Encoding: chunked` win over `Content-Length` and closes after
//! the response, so a body is never read as a second request); open more
//! connections than the cap (503 and close at once) or than the process has
//! descriptors (`accept` fails, is logged and retried); make a handler panic
//! (500, and the worker thread survives: every job runs under
//! `catch_unwind`).

use std::io;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::time::Instant;

use super::router::match_route;
use super::Request;
use crate::api::{Answer, Handover, Problem, Reply};
use crate::config::{
    HttpLimits, ACCEPT_RETRY_DELAY, BODY_SIZE_MAX_BYTES, HEADER_BYTES_MAX_FLOOR,
    REFUSALS_LINGERING_MAX, REFUSAL_LINGER, SHUTDOWN_GRACE, WARN_PERIOD,
    WORKER_QUEUE_LEN_PER_WORKER,
};
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// What the workers run for each request. An `Answer::Later` is started on
/// the worker (it must not block) and delivers its reply from elsewhere; the
/// connection task awaits it without holding a worker.
pub type Handler = Arc<dyn Fn(&Request) -> Answer + Send + Sync>;

struct Job {
    request: Request,
    reply: oneshot::Sender<Reply>,
}

/// A running HTTP server. Dropping it shuts it down.
pub struct HttpServer {
    addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
    stop: watch::Sender<bool>,
    accept: Option<tokio::task::JoinHandle<()>>,
    jobs: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

/// What every connection task shares: the worker queue, the limits, and the
/// metrics, where the answers the engine gives itself are counted.
#[derive(Clone)]
struct Shared {
    jobs: Sender<Job>,
    limits: HttpLimits,
    metrics: Arc<Metrics>,
}

impl HttpServer {
    /// Binds `addr` (port 0 picks one) and starts serving with `workers`
    /// worker threads within `limits`. Returns once the listener accepts
    /// connections.
    pub fn start(
        addr: SocketAddr,
        workers: usize,
        limits: HttpLimits,
        handler: Handler,
        metrics: Arc<Metrics>,
    ) -> Result<HttpServer> {
        limits.validate().map_err(Error::Config)?;
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|e| Error::Config(format!("cannot listen on {addr}: {e}")))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("idem-http")
            .enable_all()
            .build()?;
        let (jobs, queue) = crossbeam_channel::bounded(workers * WORKER_QUEUE_LEN_PER_WORKER);
        let workers = (0..workers)
            .map(|i| {
                let queue: Receiver<Job> = queue.clone();
                let handler = Arc::clone(&handler);
                std::thread::Builder::new()
                    .name(format!("idem-worker-{i}"))
                    .spawn(move || work(&queue, &handler))
                    .expect("spawn worker thread")
            })
            .collect();
        let (stop, stopped) = watch::channel(false);
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let shared = Shared {
            jobs: jobs.clone(),
            limits,
            metrics,
        };
        let accept = runtime.spawn(accept_loop(listener, shared, stopped));
        Ok(HttpServer {
            addr,
            runtime: Some(runtime),
            stop,
            accept: Some(accept),
            jobs: Some(jobs),
            workers,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets in-flight requests finish (up to
    /// `SHUTDOWN_GRACE`), then stops the workers.
    pub fn shutdown(&mut self) {
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        let _ = self.stop.send(true);
        if let Some(accept) = self.accept.take() {
            let _ = runtime.block_on(accept);
        }
        runtime.shutdown_timeout(std::time::Duration::from_secs(1));
        self.jobs = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A worker: runs jobs until the queue closes. Everything a job does —
/// the handler and starting its deferred work — runs under `catch_unwind`,
/// so a panic costs that request a 500 (its reply sender is dropped, and the
/// connection answers 500), never the thread: the pool keeps its size
/// however many handlers panic.
fn work(queue: &Receiver<Job>, handler: &Handler) {
    while let Ok(job) = queue.recv() {
        let Job { request, reply } = job;
        if catch_unwind(AssertUnwindSafe(|| run_job(&request, reply, handler))).is_err() {
            // The route template, never the raw path: logs hold nothing a
            // client sent.
            let route = match_route(&request.path).map_or("unmatched", |r| r.template());
            log::error!("handler panicked on {} {route}", request.method);
        }
    }
}

fn run_job(request: &Request, tx: oneshot::Sender<Reply>, handler: &Handler) {
    match handler(request) {
        Answer::Now(reply) => {
            let _ = tx.send(reply);
        }
        Answer::Later(start) => start(Box::new(move |reply| {
            let _ = tx.send(reply);
        })),
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    shared: Shared,
    mut stopped: watch::Receiver<bool>,
) {
    let graceful = GracefulShutdown::new();
    let limits = shared.limits;
    let connections = Arc::new(Semaphore::new(limits.connections_max));
    let refusal = refusal_bytes();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.header_bytes_max.max(HEADER_BYTES_MAX_FLOOR))
        .keep_alive(true);
    let (mut accept_failed, mut refused) = (Throttle::default(), Throttle::default());
    let lingering = Arc::new(Semaphore::new(REFUSALS_LINGERING_MAX));
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // EMFILE and friends: back off and keep accepting.
                        if let Some(more) = accept_failed.due() {
                            log::warn!("accept failed{more} (retrying every {ACCEPT_RETRY_DELAY:?}): {e}");
                        }
                        tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
                        continue;
                    }
                };
                let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
                    if let Some(more) = refused.due() {
                        let cap = limits.connections_max;
                        log::warn!("connection cap of {cap} reached; refusing a connection{more}");
                    }
                    refuse(stream, &refusal, &shared.metrics, &lingering);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let activity = Arc::new(Activity::new());
                let service = {
                    let (shared, activity) = (shared.clone(), Arc::clone(&activity));
                    service_fn(move |req| {
                        let busy = Busy::enter(Arc::clone(&activity));
                        let reply = serve(req, shared.clone());
                        async move {
                            let reply = reply.await;
                            drop(busy);
                            reply
                        }
                    })
                };
                let io = TokioIo::new(Tracked { inner: stream, activity: Arc::clone(&activity) });
                let conn = graceful.watch(builder.serve_connection(io, service));
                let metrics = Arc::clone(&shared.metrics);
                tokio::spawn(async move {
                    if let Some(Err(e)) = close_when_idle(conn, &activity, limits.idle_timeout).await {
                        note_engine_error(&e, &metrics);
                    }
                    drop(permit);
                });
            }
            _ = stopped.changed() => break,
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => log::warn!("shutdown grace period over"),
    }
}

/// Drives `conn` to its end, or drops it (closing the socket) once it has
/// had no request in flight and no byte moving either way for `idle`.
/// `None`: closed as idle.
async fn close_when_idle<F: std::future::Future>(
    conn: F,
    activity: &Activity,
    idle: Duration,
) -> Option<F::Output> {
    let mut conn = std::pin::pin!(conn);
    let mut deadline = activity.last() + idle;
    loop {
        tokio::select! {
            done = &mut conn => return Some(done),
            _ = tokio::time::sleep_until(deadline) => {
                let now = Instant::now();
                if activity.in_service() {
                    // A request is in the service: its body read has its
                    // own timeout, and its answer comes when it comes (a
                    // charge may wait seconds for the acquirer).
                    deadline = now + idle;
                } else if activity.last() + idle <= now {
                    log::debug!("closing a connection idle for {idle:?}");
                    return None;
                } else {
                    deadline = activity.last() + idle;
                }
            }
        }
    }
}

/// Counts the answers hyper gives by itself to a request it could not parse
/// (400, 431), which never reach `serve`.
fn note_engine_error(e: &hyper::Error, metrics: &Metrics) {
    let status = if e.is_parse_too_large() {
        431
    } else if e.is_parse() && !e.is_parse_version_h2() {
        400
    } else {
        log::debug!("connection ended: {e}");
        return;
    };
    log::debug!("rejected a request: {e}");
    metrics.record_request("unmatched", status, 0.0);
}

/// Rate-limits a repeated warning to one per `WARN_PERIOD`.
#[derive(Default)]
struct Throttle {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    /// `Some(note)` if the warning is due now; the note counts the ones
    /// suppressed since the last.
    fn due(&mut self) -> Option<String> {
        let now = Instant::now();
        if self.last.is_some_and(|t| now - t < WARN_PERIOD) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        let note = match std::mem::take(&mut self.suppressed) {
            0 => String::new(),
            n => format!(" ({n} more since the last warning)"),
        };
        Some(note)
    }
}

/// Over the connection cap: a best-effort 503 (the client may not have sent
/// its request yet; nothing waits for it to), then close.
/// Answers a connection over the cap with the 503 and closes it.
///
/// Closing a socket whose request is still unread makes the kernel send a
/// reset, and a reset can destroy the 503 before the client reads it. So the
/// 503 is followed by a FIN, and what the client sent is read and discarded
/// for up to `REFUSAL_LINGER` before the socket is closed — for at most
/// `REFUSALS_LINGERING_MAX` refusals at once; beyond that, a flood's
/// connections are closed at once.
fn refuse(stream: TcpStream, refusal: &[u8], metrics: &Metrics, lingering: &Arc<Semaphore>) {
    metrics.record_request("unmatched", 503, 0.0);
    let _ = stream.try_write(refusal);
    let Ok(permit) = Arc::clone(lingering).try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = stream;
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 1024];
        let drain = async { while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {} };
        let _ = tokio::time::timeout(REFUSAL_LINGER, drain).await;
        drop(permit);
    });
}

/// The raw bytes of the 503 for a connection over the cap.
fn refusal_bytes() -> Vec<u8> {
    let reply = Problem::TemporarilyUnavailable("too many open connections".into()).reply();
    let mut head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n",
        reply.content_type,
        reply.body.len()
    );
    for (name, value) in &reply.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(&reply.body);
    bytes
}

/// When a connection last moved a byte (milliseconds since it opened), and
/// how many of its requests are in the service: what the idle timer reads.
struct Activity {
    opened: Instant,
    last_ms: AtomicU64,
    in_service: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            opened: Instant::now(),
            last_ms: AtomicU64::new(0),
            in_service: AtomicUsize::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.opened.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.opened + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    fn in_service(&self) -> bool {
        self.in_service.load(Ordering::Relaxed) > 0
    }
}

/// A request in the service, from its parsed head to its reply.
struct Busy(Arc<Activity>);

impl Busy {
    fn enter(activity: Arc<Activity>) -> Busy {
        activity.in_service.fetch_add(1, Ordering::Relaxed);
        activity.touch();
        Busy(activity)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_service.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The socket, noting every byte that moves.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.touch();
        }
        polled
    }
}

impl Tracked {
    fn wrote(&self, polled: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A reply handed over as [`Handover::Abandon`]: the service fails, and
/// hyper closes the connection without writing a response.
#[derive(Debug)]
struct Abandoned;

impl std::fmt::Display for Abandoned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the answer was abandoned (sandbox)")
    }
}

impl std::error::Error for Abandoned {}

/// Reads one request fully (bounded), hands it to a worker, awaits the
/// reply, and hands it over as it says: at once, after a wait (on this
/// task: no thread waits), or not at all (the connection is closed).
async fn serve(
    req: hyper::Request<Incoming>,
    shared: Shared,
) -> std::result::Result<hyper::Response<Full<Bytes>>, Abandoned> {
    let started = std::time::Instant::now();
    let (parts, body) = req.into_parts();
    let declared: Option<u64> = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mut request = Request {
        method: parts.method.as_str().to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect(),
        body: Vec::new(),
        body_too_large: false,
    };
    // The answers the engine gives itself are counted like the handler's.
    let engine_reply = |reply: Reply, path: &str| {
        let route = match_route(path).map_or("unmatched", |r| r.template());
        let seconds = started.elapsed().as_secs_f64();
        shared.metrics.record_request(route, reply.status, seconds);
        Ok(to_hyper(reply))
    };
    if declared.is_some_and(|n| n > BODY_SIZE_MAX_BYTES as u64) {
        request.body_too_large = true;
    } else {
        let limited = Limited::new(body, BODY_SIZE_MAX_BYTES);
        let timeout = shared.limits.body_read_timeout;
        match tokio::time::timeout(timeout, limited.collect()).await {
            Ok(Ok(collected)) => request.body = collected.to_bytes().to_vec(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                request.body_too_large = true
            }
            Ok(Err(_)) | Err(_) => {
                let mut reply =
                    Problem::InvalidRequest("the body could not be read".into()).reply();
                reply.close = true;
                return engine_reply(reply, &request.path);
            }
        }
    }
    let unread_body = request.body_too_large;
    let path = request.path.clone();
    let (tx, rx) = oneshot::channel();
    let mut reply = match shared.jobs.try_send(Job { request, reply: tx }) {
        // A handler that panicked dropped `tx`; it counted its own 500.
        Ok(()) => rx.await.unwrap_or_else(|_| Problem::Internal.reply()),
        Err(_) => {
            let reply = Problem::TemporarilyUnavailable("all workers are busy".into()).reply();
            return engine_reply(reply, &path);
        }
    };
    reply.close |= unread_body;
    match reply.handover {
        Handover::Send => {}
        Handover::After(wait) => tokio::time::sleep(wait).await,
        Handover::Abandon => return Err(Abandoned),
    }
    Ok(to_hyper(reply))
}

/// The engine's response for `reply`. The body always goes in, HEAD or not:
/// for a HEAD request hyper writes the `Content-Length` of this body and
/// never the body itself (RFC 9110 §9.3.2), so a HEAD answers exactly GET's
/// status and headers (tests/head.rs checks the bytes on the wire).
fn to_hyper(reply: Reply) -> hyper::Response<Full<Bytes>> {
    let mut response = hyper::Response::new(Full::new(Bytes::from(reply.body)));
    *response.status_mut() = hyper::StatusCode::from_u16(reply.status)
        .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    for (name, value) in reply.headers {
        // Values are built by us from ids and numbers; one that is not a
        // valid header value is dropped rather than sent unescaped.
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.append(HeaderName::from_static(name), value);
        }
    }
    if reply.close {
        headers.insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let head = format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).unwrap();
        raw
    }

    /// A handler that panics (nothing above it catches) on the only worker,
    /// again and again: each request is answered 500 problem+json, and the
    /// worker is still there for the next request.
    #[test]
    fn a_worker_survives_handlers_that_panic() {
        let handler: Handler = Arc::new(|req: &Request| {
            if req.path == "/boom" {
                panic!("test: a bug in the handler");
            }
            Answer::Now(Reply::raw(200, "text/plain", b"fine".to_vec()))
        });
        let addr = "127.0.0.1:0".parse().unwrap();
        let metrics = Arc::new(Metrics::default());
        let server = HttpServer::start(addr, 1, HttpLimits::default(), handler, metrics).unwrap();
        for _ in 0..3 {
            let raw = get(server.addr(), "/boom");
            assert!(raw.starts_with("HTTP/1.1 500"), "{raw}");
            assert!(raw.contains("application/problem+json"), "{raw}");
            assert!(raw.contains("urn:idem:problem:internal-error"), "{raw}");
        }
        let raw = get(server.addr(), "/fine");
        assert!(
            raw.starts_with("HTTP/1.1 200") && raw.ends_with("fine"),
            "{raw}"
        );
    }

    #[test]
    fn limits_of_zero_are_refused() {
        let handler: Handler = Arc::new(|_: &Request| Answer::Now(Problem::NotFound.reply()));
        let limits = HttpLimits {
            connections_max: 0,
            ..HttpLimits::default()
        };
        let addr = "127.0.0.1:0".parse().unwrap();
        let started = HttpServer::start(addr, 1, limits, handler, Arc::default());
        assert!(started.is_err());
    }
}
