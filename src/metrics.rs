//! Prometheus counters and histograms (the names are part of the contract),
//! kept in memory and rendered in the text exposition format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Seconds buckets for request and commit durations.
const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Commands-per-commit buckets.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    /// Sum in micro-units, so it can be an atomic integer.
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_micros
            .fetch_add((v * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

#[derive(Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The `status` labels of `idem_notifications_total`, in the order of
/// [`Metrics::notifications`].
pub const NOTIFICATION_STATUSES: [&str; 3] = ["applied", "ignored", "unmatched"];

pub struct Metrics {
    /// (route template, status) → count.
    http_requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub http_request_duration_seconds: Histogram,
    pub idempotent_replays: Counter,
    /// 409 `idempotency-key-in-use`: this key's first attempt is running.
    pub conflicts_in_use: Counter,
    /// 409 `reference-in-use`: another key's charge with this `reference`
    /// is running. A conflict of its own, not a key in use.
    pub conflicts_reference_in_use: Counter,
    /// 422 `idempotency-key-reused`: this key was used with another body.
    pub conflicts_reused: Counter,
    pub orphans_taken_over: Counter,
    pub keys_reaped: Counter,
    /// Holds the reaper voided and released after `--authorization-ttl`.
    pub authorizations_expired: Counter,
    /// Inbound notifications by the status they were stored with
    /// (`applied`, `ignored`, `unmatched`; an `unmatched` one settled later
    /// is not counted again). Replays and refused deliveries are not
    /// counted here.
    pub notifications: [Counter; 3],
    pub commit_batch_size: Histogram,
    pub commit_duration_seconds: Histogram,
    /// Webhook attempts answered 2xx (`result="succeeded"`).
    pub webhook_succeeded: Counter,
    /// Webhook attempts that failed with another attempt scheduled.
    pub webhook_retried: Counter,
    /// Webhook attempts that failed and were the delivery's last.
    pub webhook_failed: Counter,
    /// Pending deliveries, as last counted by the delivery engine.
    webhook_backlog: AtomicU64,
    /// Sandbox faults applied, by directive, in the order of
    /// [`crate::sandbox::DIRECTIVE_LABELS`].
    simulated_faults: [Counter; 9],
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            http_requests: Mutex::new(BTreeMap::new()),
            http_request_duration_seconds: Histogram::new(SECONDS_BUCKETS),
            idempotent_replays: Counter::default(),
            conflicts_in_use: Counter::default(),
            conflicts_reference_in_use: Counter::default(),
            conflicts_reused: Counter::default(),
            orphans_taken_over: Counter::default(),
            keys_reaped: Counter::default(),
            authorizations_expired: Counter::default(),
            notifications: Default::default(),
            commit_batch_size: Histogram::new(BATCH_BUCKETS),
            commit_duration_seconds: Histogram::new(SECONDS_BUCKETS),
            webhook_succeeded: Counter::default(),
            webhook_retried: Counter::default(),
            webhook_failed: Counter::default(),
            webhook_backlog: AtomicU64::new(0),
            simulated_faults: Default::default(),
        }
    }
}

impl Metrics {
    pub fn record_request(&self, route: &'static str, status: u16, seconds: f64) {
        *self
            .http_requests
            .lock()
            .expect("metrics lock")
            .entry((route, status))
            .or_default() += 1;
        self.http_request_duration_seconds.observe(seconds);
    }

    /// Counts one sandbox fault applied (`idem_simulated_faults_total`).
    pub fn simulated(&self, directive: crate::sandbox::Directive) {
        self.simulated_faults[directive.index()].inc();
    }

    /// Sets the `idem_webhook_backlog` gauge.
    pub fn set_webhook_backlog(&self, pending: u64) {
        self.webhook_backlog.store(pending, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP idem_http_requests_total HTTP requests by route and status.\n");
        out.push_str("# TYPE idem_http_requests_total counter\n");
        for ((route, status), n) in self.http_requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                out,
                "idem_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        self.http_request_duration_seconds.render(
            "idem_http_request_duration_seconds",
            "HTTP request latency.",
            &mut out,
        );
        let counters = [
            (
                "idem_idempotent_replays_total",
                "Stored answers replayed.",
                "",
                &self.idempotent_replays,
            ),
            (
                "idem_idempotency_conflicts_total",
                "Idempotency conflicts: in_use (409 idempotency-key-in-use), reference_in_use (409 reference-in-use), reused (422 idempotency-key-reused).",
                "{kind=\"in_use\"}",
                &self.conflicts_in_use,
            ),
            (
                "idem_idempotency_conflicts_total",
                "",
                "{kind=\"reference_in_use\"}",
                &self.conflicts_reference_in_use,
            ),
            (
                "idem_idempotency_conflicts_total",
                "",
                "{kind=\"reused\"}",
                &self.conflicts_reused,
            ),
            (
                "idem_orphans_taken_over_total",
                "Orphaned keys taken over.",
                "",
                &self.orphans_taken_over,
            ),
            (
                "idem_keys_reaped_total",
                "Completed keys deleted after retention.",
                "",
                &self.keys_reaped,
            ),
            (
                "idem_authorizations_expired_total",
                "Uncaptured holds voided and released after --authorization-ttl.",
                "",
                &self.authorizations_expired,
            ),
            (
                "idem_webhook_deliveries_total",
                "Webhook delivery attempts by result: succeeded (2xx), retried (failed, another attempt due), failed (failed, no attempt left).",
                "{result=\"succeeded\"}",
                &self.webhook_succeeded,
            ),
            (
                "idem_webhook_deliveries_total",
                "",
                "{result=\"retried\"}",
                &self.webhook_retried,
            ),
            (
                "idem_webhook_deliveries_total",
                "",
                "{result=\"failed\"}",
                &self.webhook_failed,
            ),
        ];
        for (name, help, labels, counter) in counters {
            if !help.is_empty() {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            }
            let _ = writeln!(out, "{name}{labels} {}", counter.get());
        }
        let _ = writeln!(
            out,
            "# HELP idem_webhook_backlog Webhook deliveries pending (due or waiting for a retry).\n\
             # TYPE idem_webhook_backlog gauge\nidem_webhook_backlog {}",
            self.webhook_backlog.load(Ordering::Relaxed)
        );
        out.push_str(
            "# HELP idem_notifications_total Inbound notifications stored, by the status \
             they were received with.\n# TYPE idem_notifications_total counter\n",
        );
        for (status, counter) in NOTIFICATION_STATUSES.iter().zip(&self.notifications) {
            let _ = writeln!(
                out,
                "idem_notifications_total{{status=\"{status}\"}} {}",
                counter.get()
            );
        }
        out.push_str(
            "# HELP idem_simulated_faults_total Faults the sandbox applied (Idem-Simulate \
             or Server::simulate), by directive.\n# TYPE idem_simulated_faults_total counter\n",
        );
        for (label, counter) in crate::sandbox::DIRECTIVE_LABELS
            .iter()
            .zip(&self.simulated_faults)
        {
            let _ = writeln!(
                out,
                "idem_simulated_faults_total{{directive=\"{label}\"}} {}",
                counter.get()
            );
        }
        self.commit_batch_size.render(
            "idem_commit_batch_size",
            "Write commands per commit.",
            &mut out,
        );
        self.commit_duration_seconds.render(
            "idem_commit_duration_seconds",
            "Duration of one write transaction, commit included.",
            &mut out,
        );
        out
    }
}
