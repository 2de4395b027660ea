//! The webhook delivery engine: sends each pending delivery to its endpoint,
//! per Standard Webhooks, until a 2xx, the last attempt, or the endpoint's
//! deletion.
//!
//! One dispatcher thread (`idem-webhooks`) finds due deliveries on a reader
//! every [`WEBHOOK_POLL_INTERVAL`] (at once when an attempt ends and frees a
//! thread, or when the writer commits: a delivery queued by a change goes
//! out right after the change's commit) and hands them to
//! [`WEBHOOK_THREADS`] sender threads (`idem-webhook-N`). The dispatcher alone keeps the in-process lease, the
//! set of deliveries on the wire: a delivery is handed out again only once
//! its attempt is recorded, so one delivery is never sent twice at once; at
//! most [`ENDPOINT_CONCURRENCY_MAX`] attempts to one endpoint run at once,
//! so a hanging receiver cannot take every thread.
//!
//! An attempt is a `POST` of the event's stored bytes with `webhook-id` (the
//! event id, the same on every attempt), `webhook-timestamp` (this attempt)
//! and `webhook-signature`, within `--webhook-timeout` overall (connect,
//! request, response headers and body each capped by it too); redirects are
//! not followed, no proxy is used, and at most
//! [`WEBHOOK_RESPONSE_BYTES_MAX`] of the response body is read and thrown
//! away. Its outcome goes to the recorder thread (`idem-webhook-record`),
//! which writes every outcome that has arrived in one writer command
//! (`webhooks::record_attempt` each) and only then releases their leases:
//! a sender never waits for a commit. Nothing here runs on an HTTP worker
//! or inside a writer command: a receiver that hangs costs a sender thread,
//! nothing else.
//!
//! Delivery is at least once: the state is in the database, so a crash
//! between an attempt and its record sends it again after the restart, with
//! the same `webhook-id` and body, for the receiver to deduplicate.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::app::App;
use crate::config::{
    WEBHOOK_ERROR_LEN_MAX, WEBHOOK_POLL_INTERVAL, WEBHOOK_RESPONSE_BYTES_MAX, WEBHOOK_RETRY_CAP,
    WEBHOOK_THREADS,
};
use crate::signature;
use crate::time::{millis, now_ms};
use crate::webhooks::{AttemptRecord, Due, Recorded};

/// Attempts to one endpoint on the wire at once, at most.
pub const ENDPOINT_CONCURRENCY_MAX: usize = WEBHOOK_THREADS / 2;
/// How often the `idem_webhook_backlog` gauge is refreshed.
const BACKLOG_REFRESH: Duration = Duration::from_secs(1);

/// The running engine; stops on [`Delivery::stop`] or drop.
pub struct Delivery {
    stopping: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

/// An attempt handed to a sender thread.
struct Job(Due);

/// What the dispatcher hears back: a sender is free again (its attempt to
/// this endpoint is off the wire), or an attempt is recorded (the delivery
/// may be handed out again if it is still due).
enum Done {
    Sent { endpoint_id: i64 },
    Recorded { id: i64 },
}

/// An attempt over, for the recorder to write.
struct Attempted {
    id: i64,
    event: String,
    outcome: Outcome,
    next_attempt_at: Option<i64>,
}

/// Attempts the recorder writes in one writer command, at most: under load
/// the outcomes of a whole poll share one command and one commit, instead of
/// each sender waiting for a commit of its own.
const RECORD_BATCH_MAX: usize = 256;

impl Delivery {
    /// Starts the dispatcher and the sender threads of `app`.
    pub fn start(app: Arc<App>) -> Delivery {
        let stopping = Arc::new(AtomicBool::new(false));
        let (jobs_tx, jobs_rx) = crossbeam_channel::bounded::<Job>(WEBHOOK_THREADS);
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Done>();
        let (attempted_tx, attempted_rx) = crossbeam_channel::unbounded::<Attempted>();
        let agent = agent(app.config.webhook_timeout);
        let mut threads = Vec::with_capacity(WEBHOOK_THREADS + 2);
        for n in 0..WEBHOOK_THREADS {
            let (app, agent, jobs, done, attempted, stopping) = (
                Arc::clone(&app),
                agent.clone(),
                jobs_rx.clone(),
                done_tx.clone(),
                attempted_tx.clone(),
                Arc::clone(&stopping),
            );
            threads.push(
                std::thread::Builder::new()
                    .name(format!("idem-webhook-{n}"))
                    .spawn(move || send_loop(&app, &agent, &jobs, &done, &attempted, &stopping))
                    .expect("spawn webhook sender"),
            );
        }
        drop(attempted_tx);
        let recorder_app = Arc::clone(&app);
        threads.push(
            std::thread::Builder::new()
                .name("idem-webhook-record".into())
                .spawn(move || record_loop(&recorder_app, &attempted_rx, &done_tx))
                .expect("spawn webhook recorder"),
        );
        let s = Arc::clone(&stopping);
        threads.push(
            std::thread::Builder::new()
                .name("idem-webhooks".into())
                .spawn(move || dispatch(&app, jobs_tx, &done_rx, &s))
                .expect("spawn webhook dispatcher"),
        );
        Delivery { stopping, threads }
    }

    /// Stops handing out attempts and waits for those on the wire (each
    /// bounded by `--webhook-timeout`) to be recorded. Deliveries not
    /// attempted stay pending for the next start.
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The HTTP client of every attempt: per-phase timeouts, all within the
/// overall one; no redirect followed; statuses are answers, not errors; no
/// proxy from the environment (a delivery goes where its URL says).
fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .timeout_connect(Some(timeout))
        .timeout_send_request(Some(timeout))
        .timeout_send_body(Some(timeout))
        .timeout_recv_response(Some(timeout))
        .timeout_recv_body(Some(timeout))
        .http_status_as_error(false)
        .max_redirects(0)
        .proxy(None)
        .user_agent(concat!("idem-webhooks/", env!("CARGO_PKG_VERSION")))
        .build()
        .into()
}

/// The dispatcher's lease: the deliveries handed out and not yet recorded
/// (`on_wire`), the attempts on the wire (each holds a sender thread), and
/// each endpoint's share of them.
#[derive(Default)]
struct Lease {
    on_wire: HashSet<i64>,
    sending: usize,
    per_endpoint: HashMap<i64, usize>,
}

impl Lease {
    /// Senders without an attempt.
    fn free(&self) -> usize {
        WEBHOOK_THREADS - self.sending
    }

    /// Hands out, oldest first, what of `ahead` a free sender and its
    /// endpoint's share allow, and keeps the rest; `Err` once the senders
    /// are gone.
    fn hand_out(&mut self, ahead: &mut VecDeque<Due>, jobs: &Sender<Job>) -> Result<(), ()> {
        let mut kept = VecDeque::with_capacity(ahead.len());
        while let Some(d) = ahead.pop_front() {
            let busy = self.per_endpoint.get(&d.endpoint_id).copied().unwrap_or(0);
            if self.free() == 0 || busy >= ENDPOINT_CONCURRENCY_MAX {
                kept.push_back(d);
                continue;
            }
            self.on_wire.insert(d.id);
            *self.per_endpoint.entry(d.endpoint_id).or_default() += 1;
            self.sending += 1;
            jobs.send(Job(d)).map_err(|_| ())?;
        }
        *ahead = kept;
        Ok(())
    }

    /// A sender is free again, or an attempt is recorded.
    fn release(&mut self, done: Done) {
        match done {
            Done::Sent { endpoint_id } => {
                self.sending -= 1;
                if let Some(n) = self.per_endpoint.get_mut(&endpoint_id) {
                    *n -= 1;
                    if *n == 0 {
                        self.per_endpoint.remove(&endpoint_id);
                    }
                }
            }
            Done::Recorded { id } => {
                self.on_wire.remove(&id);
            }
        }
    }
}

/// Due deliveries the dispatcher reads ahead in one query, at most.
const READ_AHEAD: usize = 64;

/// The dispatcher: hands due deliveries to free senders, keeping the lease
/// (`on_wire`) and the per-endpoint counts; refreshes the backlog gauge.
///
/// It reads up to [`READ_AHEAD`] due deliveries at a time, oldest first,
/// and hands them out as senders free up; it reads again only once they
/// are all handed out (or none of them can be, every one's endpoint being
/// at its share) and more may be due: a commit since, the poll interval
/// (retries coming due), or a last read that filled its limit (a backlog,
/// which then drains at the senders' pace). Reading again after every
/// attempt cost a sixth of the server's CPU under load. An endpoint's
/// deletion drops what was read ahead, so a deleted endpoint gets no new
/// attempt.
fn dispatch(app: &App, jobs: Sender<Job>, done: &Receiver<Done>, stopping: &AtomicBool) {
    let mut lease = Lease::default();
    let mut backlog_at = Instant::now() - BACKLOG_REFRESH;
    let mut commits = app.commits();
    // Read ahead, not yet handed out, oldest first.
    let mut ahead: VecDeque<Due> = VecDeque::new();
    // Whether a read may find due deliveries that `ahead` lacks.
    let mut stale = true;
    // The last read filled its limit: more were due than it took.
    let mut more = false;
    let mut deletions = app.endpoint_deletions();
    let mut polled_at = Instant::now();
    while !stopping.load(Ordering::SeqCst) {
        if backlog_at.elapsed() >= BACKLOG_REFRESH {
            backlog_at = Instant::now();
            match app.webhook_backlog() {
                Ok(n) => app.metrics.set_webhook_backlog(n),
                Err(e) => log::warn!("webhooks: cannot count the backlog: {e}"),
            }
        }
        if polled_at.elapsed() >= WEBHOOK_POLL_INTERVAL {
            polled_at = Instant::now();
            stale = true;
        }
        let now_deletions = app.endpoint_deletions();
        if now_deletions != deletions {
            deletions = now_deletions;
            ahead.clear();
            stale = true;
        }
        if lease.hand_out(&mut ahead, &jobs).is_err() {
            return;
        }
        // Read again if senders are free and more may be due; a backlog
        // drains at the senders' pace, not a read per poll interval.
        let backlog = more && ahead.is_empty();
        if lease.free() > 0 && (stale || backlog) {
            // Rows on the wire are still pending: read past them.
            let limit = lease.on_wire.len() + READ_AHEAD;
            match app.due_deliveries(limit) {
                Ok(due) => {
                    more = due.len() == limit;
                    ahead = due
                        .into_iter()
                        .filter(|d| !lease.on_wire.contains(&d.id))
                        .collect();
                    stale = false;
                    if lease.hand_out(&mut ahead, &jobs).is_err() {
                        return;
                    }
                }
                Err(e) => log::warn!("webhooks: cannot read due deliveries: {e}"),
            }
        }
        // Woken by an attempt's end, by a commit (which may have queued
        // deliveries: they go out now, not at the next poll), or by the
        // poll interval (retries coming due).
        crossbeam_channel::select! {
            recv(done) -> d => match d {
                Ok(d) => {
                    lease.release(d);
                    while let Ok(d) = done.try_recv() {
                        lease.release(d);
                    }
                }
                Err(_) => return,
            },
            recv(commits) -> c => {
                stale = true;
                if c.is_err() {
                    // The writer has stopped: nothing new will commit.
                    commits = crossbeam_channel::never();
                }
            },
            default(WEBHOOK_POLL_INTERVAL) => {}
        }
    }
}

/// A sender thread: one attempt at a time until the dispatcher is gone;
/// its outcome goes to the recorder, and the thread is free at once.
fn send_loop(
    app: &App,
    agent: &ureq::Agent,
    jobs: &Receiver<Job>,
    done: &Sender<Done>,
    attempted: &Sender<Attempted>,
    stopping: &AtomicBool,
) {
    while let Ok(Job(due)) = jobs.recv() {
        let sent = Done::Sent {
            endpoint_id: due.endpoint_id,
        };
        if stopping.load(Ordering::SeqCst) {
            // Not attempted: the delivery stays pending for the next start.
            let _ = done.send(sent);
            let _ = done.send(Done::Recorded { id: due.id });
            continue;
        }
        let outcome = attempt(agent, &due);
        let next_attempt_at = next_attempt_at(app, &due, &outcome);
        let _ = attempted.send(Attempted {
            id: due.id,
            event: due.event,
            outcome,
            next_attempt_at,
        });
        let _ = done.send(sent);
    }
}

/// The recorder thread: writes the outcomes that have arrived, up to
/// [`RECORD_BATCH_MAX`] in one writer command, counts them, and only then
/// lets the dispatcher hand their deliveries out again. Runs until every
/// sender is gone, so an attempt made before a shutdown is still recorded.
fn record_loop(app: &App, attempted: &Receiver<Attempted>, done: &Sender<Done>) {
    while let Ok(first) = attempted.recv() {
        let mut batch = vec![first];
        while batch.len() < RECORD_BATCH_MAX {
            match attempted.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        record(app, &batch);
        for a in &batch {
            let _ = done.send(Done::Recorded { id: a.id });
        }
    }
}

/// When to try `due` again after `outcome`: `None` once it succeeded or its
/// last attempt failed.
fn next_attempt_at(app: &App, due: &Due, outcome: &Outcome) -> Option<i64> {
    let config = &app.config;
    let attempts = due.attempts.saturating_add(1);
    (!outcome.ok && attempts < config.webhook_attempts_max).then(|| {
        let wait = backoff_ms(
            millis(config.webhook_retry_base),
            millis(WEBHOOK_RETRY_CAP),
            attempts,
            getrandom::u64().unwrap_or(u64::MAX / 2),
        );
        now_ms().saturating_add(wait)
    })
}

/// What one attempt got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// A 2xx arrived.
    pub ok: bool,
    /// The response's status, if one arrived.
    pub status: Option<u16>,
    /// Why it failed.
    pub error: Option<String>,
}

/// Sends one attempt of `due` and reads at most
/// [`WEBHOOK_RESPONSE_BYTES_MAX`] of the answer's body.
fn attempt(agent: &ureq::Agent, due: &Due) -> Outcome {
    let timestamp = now_ms().div_euclid(1000);
    let signature = signature::sign(&due.key, &due.event, timestamp, &due.body);
    let sent = agent
        .post(&due.url)
        .header("content-type", "application/json")
        .header("webhook-id", &due.event)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .send(&due.body[..]);
    match sent {
        Ok(mut response) => {
            let status = response.status().as_u16();
            // Read (and drop) a little, so a short answer leaves the
            // connection reusable; a long or slow one is cut off, and the
            // status already decided the attempt.
            let mut reader = response
                .body_mut()
                .as_reader()
                .take(WEBHOOK_RESPONSE_BYTES_MAX);
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
            let ok = (200..300).contains(&status);
            Outcome {
                ok,
                status: Some(status),
                error: (!ok).then(|| format!("the endpoint answered {status}")),
            }
        }
        Err(e) => Outcome {
            ok: false,
            status: None,
            error: Some(e.to_string()),
        },
    }
}

/// Records attempts in one writer command and counts them. If the writer
/// cannot take them, the deliveries stay as they were (pending, due): they
/// are sent again, with the same `webhook-id`.
fn record(app: &App, batch: &[Attempted]) {
    let rows: Vec<AttemptRecord> = batch
        .iter()
        .map(|a| AttemptRecord {
            id: a.id,
            ok: a.outcome.ok,
            status: a.outcome.status,
            error: a
                .outcome
                .error
                .as_ref()
                .map(|e| e.chars().take(WEBHOOK_ERROR_LEN_MAX).collect::<String>()),
            next_attempt_at: a.next_attempt_at,
        })
        .collect();
    match app.record_deliveries(rows) {
        Ok(recorded) => {
            for r in recorded {
                match r {
                    Recorded::Succeeded => app.metrics.webhook_succeeded.inc(),
                    Recorded::Retried => app.metrics.webhook_retried.inc(),
                    Recorded::Failed => app.metrics.webhook_failed.inc(),
                    Recorded::Gone => {}
                }
            }
        }
        Err(e) => log::warn!(
            "webhooks: cannot record {} attempt(s) (first: {}): {e}",
            batch.len(),
            batch[0].event
        ),
    }
}

/// The wait before the next attempt after `attempts` failed ones, with full
/// jitter: uniform in `0..=min(cap, base · 2^(attempts-1))` milliseconds,
/// drawn from `random`. Saturates rather than overflows for any input.
pub fn backoff_ms(base_ms: i64, cap_ms: i64, attempts: u32, random: u64) -> i64 {
    let doublings = attempts.saturating_sub(1).min(62);
    let ceiling = base_ms
        .max(0)
        .saturating_mul(1i64 << doublings)
        .min(cap_ms.max(0));
    (random % (ceiling as u64 + 1)) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_with_full_jitter() {
        let cap = 3_600_000;
        // The ceiling: the largest draw.
        let top = |attempts| backoff_ms(5_000, cap, attempts, u64::MAX - 1);
        assert!(top(1) <= 5_000);
        assert_eq!(backoff_ms(5_000, cap, 1, 5_000), 5_000);
        assert_eq!(backoff_ms(5_000, cap, 2, 10_000), 10_000);
        assert_eq!(backoff_ms(5_000, cap, 3, 20_000), 20_000);
        assert_eq!(backoff_ms(5_000, cap, 3, 20_001), 0);
        // 5 s · 2^9 is still under the hour; from the 11th attempt on the
        // cap decides.
        assert_eq!(backoff_ms(5_000, cap, 10, 2_560_000), 2_560_000);
        assert_eq!(backoff_ms(5_000, cap, 10, 2_560_001), 0);
        for attempts in [11, 12, 40, 63, 64, u32::MAX] {
            assert!(top(attempts) <= cap, "{attempts}");
            assert_eq!(backoff_ms(5_000, cap, attempts, cap as u64), cap);
        }
        assert_eq!(backoff_ms(5_000, cap, 0, 0), 0);
        assert_eq!(backoff_ms(i64::MAX, i64::MAX, u32::MAX, u64::MAX), i64::MAX);
        assert_eq!(backoff_ms(0, cap, 5, 12345), 0);
    }
}
