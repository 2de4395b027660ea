//! The connection engine: hyper (HTTP/1.1) on a small tokio runtime.
//!
//! The design card named tiny_http 0.12; measured here it leaves some
//! keep-alive connections unanswered under a burst of new connections, has no
//! read timeouts, accepts unbounded header lines and mis-frames
//! `Content-Length: abc`. hyper keeps idle connections cheap (a task, not a
//! thread), frames strictly, bounds header bytes and times out slow headers.
//! It only moves bytes: each complete request is handed to a pool of
//! synchronous worker threads, which run the handler and send the reply back.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::sync::{oneshot, watch, Semaphore};

use super::Request;
use crate::api::{Answer, Problem, Reply};
use crate::config::{
    BODY_READ_TIMEOUT, BODY_SIZE_MAX_BYTES, CONNECTIONS_MAX, HEADER_BYTES_MAX, HEADER_READ_TIMEOUT,
    SHUTDOWN_GRACE, WORKER_QUEUE_LEN_PER_WORKER,
};
use crate::error::{Error, Result};

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

impl HttpServer {
    /// Binds `addr` (port 0 picks one) and starts serving with `workers`
    /// worker threads. Returns once the listener accepts connections.
    pub fn start(addr: SocketAddr, workers: usize, handler: Handler) -> Result<HttpServer> {
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
        let accept = runtime.spawn(accept_loop(listener, jobs.clone(), stopped));
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

fn work(queue: &Receiver<Job>, handler: &Handler) {
    while let Ok(job) = queue.recv() {
        let answer =
            catch_unwind(AssertUnwindSafe(|| handler(&job.request))).unwrap_or_else(|_| {
                log::error!(
                    "handler panicked on {} {}",
                    job.request.method,
                    job.request.path
                );
                Answer::Now(Problem::Internal.reply())
            });
        let tx = job.reply;
        match answer {
            Answer::Now(reply) => {
                let _ = tx.send(reply);
            }
            Answer::Later(start) => start(Box::new(move |reply| {
                let _ = tx.send(reply);
            })),
        }
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    jobs: Sender<Job>,
    mut stopped: watch::Receiver<bool>,
) {
    let graceful = GracefulShutdown::new();
    let connections = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(HEADER_BYTES_MAX)
        .keep_alive(true);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // EMFILE and friends: back off and keep accepting.
                        log::warn!("accept failed: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
                    log::warn!("connection cap of {CONNECTIONS_MAX} reached; refusing");
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let jobs = jobs.clone();
                let service = service_fn(move |req| serve(req, jobs.clone()));
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
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

/// Reads one request fully (bounded), hands it to a worker, awaits the reply.
async fn serve(
    req: hyper::Request<Incoming>,
    jobs: Sender<Job>,
) -> std::result::Result<hyper::Response<Full<Bytes>>, Infallible> {
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
    if declared.is_some_and(|n| n > BODY_SIZE_MAX_BYTES as u64) {
        request.body_too_large = true;
    } else {
        let limited = Limited::new(body, BODY_SIZE_MAX_BYTES);
        match tokio::time::timeout(BODY_READ_TIMEOUT, limited.collect()).await {
            Ok(Ok(collected)) => request.body = collected.to_bytes().to_vec(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                request.body_too_large = true
            }
            Ok(Err(_)) | Err(_) => {
                let mut reply =
                    Problem::InvalidRequest("the body could not be read".into()).reply();
                reply.close = true;
                return Ok(to_hyper(reply));
            }
        }
    }
    let unread_body = request.body_too_large;
    let (tx, rx) = oneshot::channel();
    let reply = match jobs.try_send(Job { request, reply: tx }) {
        Ok(()) => rx.await.unwrap_or_else(|_| Problem::Internal.reply()),
        Err(_) => Problem::TemporarilyUnavailable("all workers are busy".into()).reply(),
    };
    let mut reply = reply;
    reply.close |= unread_body;
    Ok(to_hyper(reply))
}

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
