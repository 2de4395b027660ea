//! Validated configuration and the named limits of the system.
//!
//! Raw flags become a [`Config`] once, in `cli.rs` (or directly through the
//! embedding API); everything inside the crate takes the validated type.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Largest request body accepted. A charge with 50 metadata keys of 500 bytes
/// each fits in ~30 KiB; 64 KiB leaves room without letting one client pin
/// megabytes of worker memory.
pub const BODY_SIZE_MAX_BYTES: usize = 64 * 1024;
/// Idempotency keys are 1–255 printable ASCII characters (a UUID is 36).
pub const IDEMPOTENCY_KEY_LEN_MAX: usize = 255;
/// Largest charge: 10^15 minor units. Far below `i64::MAX` (≈9.2·10^18), so a
/// sum of two amounts never overflows and balances overflow only after
/// thousands of maximal charges, which checked arithmetic turns into an outcome.
pub const AMOUNT_MINOR_MAX: i64 = 1_000_000_000_000_000;
/// Longest charge `reference`, in bytes.
pub const REFERENCE_LEN_MAX: usize = 128;
/// Longest charge `description`, in bytes.
pub const DESCRIPTION_LEN_MAX: usize = 500;
/// Most keys in one `metadata` object.
pub const METADATA_KEYS_MAX: usize = 50;
/// Longest `metadata` key, in bytes.
pub const METADATA_KEY_LEN_MAX: usize = 40;
/// Longest `metadata` string value, in bytes.
pub const METADATA_VALUE_LEN_MAX: usize = 500;
/// Longest account id (chosen by the client), in bytes.
pub const ACCOUNT_ID_LEN_MAX: usize = 64;
/// Longest consumer name (A-Z a-z 0-9 _ - .).
pub const CONSUMER_NAME_LEN_MAX: usize = 64;
/// Page size of list endpoints: 1 ..= 100, default 10.
pub const LIST_LIMIT_MAX: usize = 100;
/// Page size of list endpoints without `limit`.
pub const LIST_LIMIT_DEFAULT: usize = 10;
/// Write commands waiting for the writer thread. A full queue answers 503 at
/// once instead of piling up requests that would time out anyway.
pub const WRITE_QUEUE_LEN_MAX: usize = 4096;
/// Most write commands the writer applies in one transaction (group commit).
pub const COMMIT_BATCH_MAX_DEFAULT: usize = 128;
const _: () = assert!(COMMIT_BATCH_MAX_DEFAULT <= WRITE_QUEUE_LEN_MAX);
/// Requests waiting for a worker thread, per worker.
pub const WORKER_QUEUE_LEN_PER_WORKER: usize = 64;
/// Short write tasks (reserving a key) waiting for a reservation thread. A
/// full queue answers 503; nothing has been reserved yet.
pub const RESERVATION_QUEUE_LEN_MAX: usize = 1024;
/// Threads that reserve keys. A reservation is one writer command, so a few
/// dozen keep the writer's batches full; they are separate from the
/// operation threads so that slow acquirer calls never delay a reservation,
/// a 202 or a 409.
pub const RESERVATION_THREADS: usize = 32;
/// Owned operations (a charge waiting for its acquirer and the writer, or an
/// async operation) waiting for an operation thread. A full queue answers 503
/// and unlocks the key.
pub const OPERATION_QUEUE_LEN_MAX: usize = 1024;
/// Threads that run owned operations, so that a slow acquirer never holds an
/// HTTP worker: a duplicate, a GET or /healthz is answered while 64 charges
/// wait. They mostly sleep (on the acquirer, on the writer), and 64 of them
/// in flight let up to 64 commands share one commit.
pub const OPERATION_THREADS: usize = 64;
const _: () = assert!(OPERATION_THREADS <= OPERATION_QUEUE_LEN_MAX);
/// Orphans one reaper pass takes over, and expired keys one delete removes:
/// small batches keep the write lock short.
pub const REAPER_ORPHANS_PER_PASS_MAX: usize = 64;
/// Expired holds one reaper pass voids and releases (each an acquirer call
/// and two short writes), so a backlog of expiries never holds a pass long.
pub const REAPER_EXPIRIES_PER_PASS_MAX: usize = 64;
/// How long an uncaptured hold (`capture: false`) lives before the reaper
/// voids it: 7 days, as card networks commonly let an authorization live.
pub const AUTHORIZATION_TTL_DEFAULT: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest `--authorization-ttl`: a year, far past what any card network
/// keeps an authorization, and a date every client can parse.
pub const AUTHORIZATION_TTL_MAX: Duration = Duration::from_secs(365 * 24 * 3600);
/// The longest duration any flag takes (100 years): past it a value is a
/// typo, and every duration then fits the i64 milliseconds of the database.
pub const DURATION_MAX: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// Completed keys (or events) one reaper delete removes, each batch its
/// own short transaction.
pub const REAPER_DELETE_BATCH_LEN: usize = 500;
/// How long events are kept (`--event-retention`): 30 days, long past any
/// webhook retry schedule (the last of 12 attempts falls within a day), so
/// a back office that was down for weeks can still page through what it
/// missed.
pub const EVENT_RETENTION_DEFAULT: Duration = Duration::from_secs(30 * 24 * 3600);
/// A webhook attempt that has not completed (connect, headers and body)
/// within this is a failure and is retried (`--webhook-timeout`).
pub const WEBHOOK_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// The first retry of a failed delivery waits up to this (full jitter), each
/// later one up to twice as long (`--webhook-retry-base`).
pub const WEBHOOK_RETRY_BASE_DEFAULT: Duration = Duration::from_secs(5);
/// No retry waits longer than this, however many attempts failed.
pub const WEBHOOK_RETRY_CAP: Duration = Duration::from_secs(3600);
/// Attempts of one delivery before it is `failed` (`--webhook-attempts-max`).
pub const WEBHOOK_ATTEMPTS_MAX_DEFAULT: u32 = 12;
/// Live webhook endpoints one consumer may have (`422
/// webhook-endpoint-limit` past it): every event is queued once per
/// endpoint in the transaction that records it, so the cap bounds the
/// writes a single state change can cost and the rows a delivery list holds.
pub const WEBHOOK_ENDPOINTS_MAX: usize = 16;
/// Longest accepted webhook endpoint URL, in bytes.
pub const WEBHOOK_URL_LEN_MAX: usize = 2048;
/// Delivery threads: at most this many attempts are on the wire at once,
/// whatever the backlog, so a thousand hanging receivers cost 32 threads,
/// never an HTTP worker or the writer. One endpoint may use half of them:
/// on a 2-core machine whose cores the load keeps busy, every round trip
/// waits for its turn to run, and 16 attempts in flight are what kept a
/// local receiver taking every event of a fully loaded server up to date
/// (with 4, then 8, the backlog grew through the run and the
/// commit-to-arrival p99 reached 440–850 ms; with 16, 90–150 ms).
pub const WEBHOOK_THREADS: usize = 32;

/// Connections one server keeps to a PostgreSQL database, at most. Every
/// transaction is short (no connection is held across an acquirer call or a
/// webhook), so threads take turns on a few connections; three servers use
/// 96 of PostgreSQL's default `max_connections` of 100. A thread that waits
/// longer than 10 s for one gets a 503.
pub const PG_POOL_MAX: usize = 30;
/// How often the delivery engine looks for due deliveries when nothing
/// woke it (a commit that queued deliveries wakes it at once).
pub const WEBHOOK_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Bytes of a receiver's response body read (and discarded) at most; the
/// rest is never read and the connection is dropped.
pub const WEBHOOK_RESPONSE_BYTES_MAX: u64 = 64 * 1024;
/// Longest `last_error` kept for a delivery, in characters.
pub const WEBHOOK_ERROR_LEN_MAX: usize = 200;
/// How far an inbound notification's `webhook-timestamp` may be from now
/// (`--notification-tolerance`): the Standard Webhooks default, 5 minutes.
pub const NOTIFICATION_TOLERANCE_DEFAULT: Duration = Duration::from_secs(300);
/// How long a completed idempotency key is kept and replayed
/// (`--key-retention`), unless configured: a day covers any client's retry
/// schedule, including a batch job re-run the next morning.
pub const KEY_RETENTION_DEFAULT: Duration = Duration::from_secs(24 * 3600);
/// The acquirer simulator prunes what it remembers past its retention once
/// every this many calls: one short `DELETE` under its lock, never on every
/// call, and never on a timer of its own.
pub const SIMULATOR_PRUNE_EVERY_CALLS: u32 = 256;
/// Rows of each simulator table one prune deletes. A call adds at most one
/// row to each, so 1024 per 256 calls forgets four times faster than it
/// learns: a backlog (an imported v1 journal, a retention shortened on
/// restart) drains while the simulator keeps up with any charge rate.
pub const SIMULATOR_PRUNE_BATCH_LEN: usize = 1024;
const _: () = assert!(SIMULATOR_PRUNE_BATCH_LEN >= SIMULATOR_PRUNE_EVERY_CALLS as usize);
/// Page size of the acquirer simulator's file (set when it is created).
/// Its rows are about 100 bytes and every call commits, writing one page of
/// each of its three B-trees to the WAL: 1 KiB pages write 3 KiB per call
/// where SQLite's default 4 KiB would write 12 KiB.
pub const SIMULATOR_PAGE_SIZE_BYTES: i64 = 1024;
/// The acquirer simulator's SQLite page cache. Its hot pages are the
/// right-hand edges of its two tables and of the key index (operation ids
/// are UUIDv7, so they grow with time) and the interior pages above them, a
/// few dozen; 512 KiB holds them and bounds what the simulator keeps in
/// memory, whatever it remembers on disk.
pub const SIMULATOR_CACHE_MAX_KIB: i64 = 512;
/// Deadline of one acquirer call (`--acquirer-timeout`) unless configured,
/// and unless half the in-flight timeout is shorter. A real authorization
/// answers within seconds; one still silent after 30 s is more likely lost
/// than slow, and the client is better served by a 503 and a retry (which
/// asks again with the same key, so it cannot authorize twice). 30 s is also
/// the most that fits the default 60 s `--inflight-timeout` under
/// [`INFLIGHT_PER_ACQUIRER_TIMEOUT_MIN`].
pub const ACQUIRER_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// The in-flight timeout must be at least this many acquirer timeouts. An
/// owner's lock is taken at reservation and refreshed at its recovery
/// point; between the two lie the operation queue, the pre-check, the
/// acquirer call and the recovery point's write behind a writer batch. The
/// acquirer gets at most half of the in-flight timeout, counted from the
/// lock, so the other half is left for the rest and a live owner always
/// refreshes its lock before anyone may take it over: takeover is for dead
/// or stuck owners only, never a slow acquirer.
pub const INFLIGHT_PER_ACQUIRER_TIMEOUT_MIN: u32 = 2;
/// An acquirer call that returns this much past its deadline ignored it (a
/// thread woken at the deadline is late by scheduling only): logged, so
/// an embedder's acquirer that overruns shows up before owners are taken
/// over.
pub const ACQUIRER_OVERRUN_TOLERANCE: Duration = Duration::from_millis(100);
/// The longest duration an `Idem-Simulate` directive takes
/// (`acquirer-latency=`, `response=delay:`): long enough to outlast any
/// client's read timeout, short enough that a hostile client in a sandbox
/// cannot pin an operation thread or a connection for hours.
pub const SIMULATE_DURATION_MAX: Duration = Duration::from_secs(60);
/// The longest `Idem-Simulate` value, in bytes: every directive at once
/// fits in under 150.
pub const SIMULATE_HEADER_BYTES_MAX: usize = 256;
/// Seconds a 409 asks the client to wait (`Retry-After`).
pub const RETRY_AFTER_IN_USE_SECONDS: u32 = 1;
/// Seconds a 503 asks the client to wait (`Retry-After`).
pub const RETRY_AFTER_UNAVAILABLE_SECONDS: u32 = 1;
/// HTTP engine limits (see `http/server.rs`); the defaults of [`HttpLimits`],
/// each also a `serve` flag.
///
/// A client must send a request's headers within this (slowloris). hyper
/// starts the timer when the connection is ready for a request — on accept
/// and again once the previous response is written — so it also bounds how
/// long a keep-alive connection may sit idle.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A declared body must arrive within this once the headers are in;
/// otherwise 400 and the connection is closed, so a client that declares
/// more bytes than it sends cannot hold a connection task forever.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection with no request in flight and no byte moving either way for
/// this long is closed: an idle keep-alive connection, a half-sent header
/// that stalled, a client that stopped reading its response. Shorter than
/// `HEADER_READ_TIMEOUT` so that idle connections go first; a busy client
/// reuses its connection well within it.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
/// Header bytes per request, request line included; more is 431. 16 KiB
/// holds any real client's headers (a bearer key and an idempotency key are
/// well under 300 bytes) and bounds what one connection can make us buffer.
pub const HEADER_BYTES_MAX: usize = 16 * 1024;
/// hyper's read buffer is at least this big, so it is the smallest
/// `HEADER_BYTES_MAX` that means what it says.
pub const HEADER_BYTES_MAX_FLOOR: usize = 8 * 1024;
const _: () = assert!(HEADER_BYTES_MAX >= HEADER_BYTES_MAX_FLOOR);
/// Open connections; the next one is answered 503 and closed at once. Each
/// costs a task, a file descriptor and a read buffer of up to
/// `HEADER_BYTES_MAX`, so 1024 of them stay within ~20 MiB. The process's
/// descriptor limit should leave room above this for the database files;
/// when it does not, `accept` fails, is logged and retried, never fatal.
pub const CONNECTIONS_MAX: usize = 1024;
/// Descriptors the server needs besides connections and reader connections:
/// the writer's database, WAL and shm, temp files, the lock, the acquirer
/// simulator's database, WAL and shm, the listener, stdio, the runtime's epoll and eventfds.
pub const DESCRIPTORS_RESERVED: usize = 32;
/// How long the accept loop waits after a failed `accept` (EMFILE: out of
/// file descriptors) before trying again; the pending connection stays in
/// the kernel's backlog meanwhile.
pub const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(50);
/// At most one warning of a kind ("accept failed", "connection refused")
/// per this period, however long the descriptors stay exhausted or the
/// flood lasts.
pub const WARN_PERIOD: Duration = Duration::from_secs(1);
/// Refused connections (over the cap) kept open at once to drain the
/// client's request after the 503, so that closing does not reset it away.
pub const REFUSALS_LINGERING_MAX: usize = 64;
/// How long a refused connection is drained before it is closed.
pub const REFUSAL_LINGER: Duration = Duration::from_millis(500);
/// How long `idem backup` waits for a lock it cannot take (a checkpoint that
/// truncates the WAL, another process's exclusive lock) before giving up.
pub const BACKUP_BUSY_MAX: Duration = Duration::from_secs(30);
/// How long `idem backup` sleeps before it tries a lock again.
pub const BACKUP_BUSY_RETRY_DELAY: Duration = Duration::from_millis(20);
/// Names `idem backup` tries for its partial file before giving up; more
/// than one is needed only when another backup removes a stale partial in
/// the instant between this one's creating and locking it.
pub const BACKUP_PARTIAL_CREATE_ATTEMPTS: usize = 8;
/// Pages `idem backup` copies per step (4 MiB at SQLite's default 4 KiB
/// page): the whole copy is still one snapshot, and between two steps it
/// notices SIGINT or SIGTERM, so it stops within one step's copy (a few
/// milliseconds) and removes its partial file.
pub const BACKUP_STEP_PAGES: std::ffi::c_int = 1024;
/// Size the writer's WAL file is cut back to (SQLite's
/// `journal_size_limit`) once a checkpoint has reset it. In normal running
/// the WAL cycles at about 4 MiB (SQLite checkpoints every 1000 pages of
/// 4 KiB), well under this, so it is never cut and regrown. While a reader
/// holds an old snapshot (an `idem backup` copying) no checkpoint can reset
/// it and it grows with every commit, about 25 MB a second under load; after
/// such a reader the file shrinks back to this instead of staying at its
/// high-water mark.
pub const WAL_SIZE_LIMIT_BYTES: i64 = 16 << 20;
/// How long shutdown waits for in-flight requests before closing anyway.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// SQLite busy timeout of every connection: how long a statement waits for a
/// lock held by another process (a CLI command beside a running server) or a
/// checkpoint before it fails with SQLITE_BUSY.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// SQLite `synchronous` in WAL mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synchronous {
    /// fsync on every commit: an acknowledged charge survives power loss.
    Full,
    /// fsync only at checkpoints: faster, and the last commits before a power
    /// loss (not a process crash) may be lost.
    Normal,
}

impl Synchronous {
    /// The value of SQLite's `PRAGMA synchronous`.
    pub fn pragma(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// A point where a test can make the server abort, to simulate a crash at the
/// worst moment (set with `IDEM_FAULT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// The key is reserved (committed), the acquirer not yet called.
    AfterReserve,
    /// The acquirer authorised; the recovery point is not yet recorded.
    AfterAcquirer,
    /// The recovery point is committed; the ledger phase has not run.
    AfterRecoveryPoint,
    /// The ledger phase is committed; the response is not yet written.
    AfterCommit,
    /// A schema migration step ran its SQL; its transaction has not
    /// committed (the database must stay at the previous version).
    InMigration,
    /// An inbound notification's writer command stored it and applied its
    /// effect; the transaction has not committed (nothing may remain).
    InNotification,
}

impl FaultPoint {
    /// `POINT` or `KIND:POINT` (`capture:after_acquirer`): the point, and
    /// the kind of operation it is limited to.
    pub fn parse_scoped(s: &str) -> Option<(FaultPoint, Option<String>)> {
        match s.split_once(':') {
            None => Some((FaultPoint::parse(s)?, None)),
            Some((kind, point)) => {
                let kinds = [
                    "account",
                    "charge",
                    "refund",
                    "capture",
                    "cancel",
                    "expiry",
                    "notification",
                ];
                kinds
                    .contains(&kind)
                    .then(|| Some((FaultPoint::parse(point)?, Some(kind.to_string()))))?
            }
        }
    }

    /// `after_reserve`, `after_acquirer`, `after_recovery_point`,
    /// `after_commit`, `in_migration`, `in_notification`.
    pub fn parse(s: &str) -> Option<FaultPoint> {
        Some(match s {
            "after_reserve" => FaultPoint::AfterReserve,
            "after_acquirer" => FaultPoint::AfterAcquirer,
            "after_recovery_point" => FaultPoint::AfterRecoveryPoint,
            "after_commit" => FaultPoint::AfterCommit,
            "in_migration" => FaultPoint::InMigration,
            "in_notification" => FaultPoint::InNotification,
            _ => return None,
        })
    }
}

/// A hook: called with an operation id.
pub type OperationHook = std::sync::Arc<dyn Fn(&str) + Send + Sync>;
/// A hook: called with a request's method and path.
pub type RequestHook = std::sync::Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Code a test runs at chosen points of an operation (embedding API only;
/// the CLI sets none), to stall an owner exactly where a race would hurt.
#[derive(Clone, Default)]
pub struct Hooks {
    /// Runs on the operation's thread just before a charge's ledger phase,
    /// with its operation id.
    pub before_ledger_phase: Option<OperationHook>,
    /// Runs on the HTTP worker, inside the handler, before routing, with the
    /// request's method and path (tests/hostile.rs panics here).
    pub before_handler: Option<RequestHook>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("before_ledger_phase", &self.before_ledger_phase.is_some())
            .field("before_handler", &self.before_handler.is_some())
            .finish()
    }
}

/// The HTTP engine's limits against slow, idle, oversized and too many
/// connections. Defaults are the named constants above; every field must be
/// above zero ([`HttpLimits::validate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// A client must send a request's headers within this
    /// (`--header-read-timeout`); it also bounds how long a keep-alive
    /// connection waits for its next request.
    pub header_read_timeout: Duration,
    /// A declared body must arrive within this once the headers are in
    /// (`--body-read-timeout`; else 400 and close).
    pub body_read_timeout: Duration,
    /// A connection with no request in flight and no byte moving for this
    /// long is closed (`--idle-timeout`).
    pub idle_timeout: Duration,
    /// Header bytes per request, request line included (more: 431;
    /// `--header-bytes-max`).
    pub header_bytes_max: usize,
    /// Open connections; the next one is answered 503 and closed
    /// (`--connections-max`).
    pub connections_max: usize,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpLimits {
            header_read_timeout: HEADER_READ_TIMEOUT,
            body_read_timeout: BODY_READ_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            header_bytes_max: HEADER_BYTES_MAX,
            connections_max: CONNECTIONS_MAX,
        }
    }
}

impl HttpLimits {
    /// A zero timeout would close every connection, a zero cap refuse them
    /// all; fewer header bytes than hyper's buffer floor would not be enforced.
    pub fn validate(&self) -> Result<(), String> {
        let timeouts = [
            ("header read timeout", self.header_read_timeout),
            ("body read timeout", self.body_read_timeout),
            ("idle timeout", self.idle_timeout),
        ];
        for (name, d) in timeouts {
            if d.is_zero() {
                return Err(format!("{name} must be longer than 0ms"));
            }
        }
        if self.header_bytes_max < HEADER_BYTES_MAX_FLOOR {
            return Err(format!(
                "header bytes max must be at least {HEADER_BYTES_MAX_FLOOR}"
            ));
        }
        if self.connections_max == 0 {
            return Err("connections max must be at least 1".into());
        }
        Ok(())
    }
}

/// Everything `idem serve` (or an embedded server) needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The database. A path is an SQLite file, created (with the schema)
    /// if missing and migrated if older; `<db>.lock`, `<db>.acquirer.sqlite`
    /// and SQLite's `-wal`/`-shm` files live beside it. A
    /// `postgres://user[:password]@host[:port]/database` URL is a PostgreSQL
    /// 15+ database (it must exist; an empty one gets the schema), which any
    /// number of servers may share.
    pub db: PathBuf,
    /// Where the built-in acquirer simulator keeps its memory. `None`:
    /// `<db>.acquirer.sqlite` beside an SQLite database. Required when `db`
    /// is PostgreSQL: every server sharing the database must name the same
    /// file, since they stand in front of one acquirer (a takeover on one
    /// server asks the acquirer again under the key another server used).
    pub acquirer_store: Option<PathBuf>,
    /// Where to listen. [`Config::new`] says `127.0.0.1:0`: a free port
    /// chosen by the system ([`crate::Server::url`] tells which), so servers
    /// of tests running in parallel never collide.
    pub addr: SocketAddr,
    /// HTTP worker threads (default: CPU count × 4, at least 4).
    pub workers: usize,
    /// How long a completed idempotency key is kept and replayed
    /// (`--key-retention`, default 24 h).
    pub key_retention: Duration,
    /// An in-progress key whose owner is silent this long is an orphan and
    /// may be taken over (`--inflight-timeout`, default 60 s).
    pub inflight_timeout: Duration,
    /// How often the reaper completes orphans, expires holds and deletes
    /// what is past retention (`--reaper-interval`, default 10 s).
    pub reaper_interval: Duration,
    /// How long the built-in simulator takes to decide an authorization.
    pub acquirer_latency: Duration,
    /// Deadline of every acquirer call (`--acquirer-timeout`): a call not
    /// answered by then is a transient failure (503, key unlocked). At most
    /// `inflight_timeout / INFLIGHT_PER_ACQUIRER_TIMEOUT_MIN`, else the
    /// server refuses to start; `None`: [`ACQUIRER_TIMEOUT_DEFAULT`] or that
    /// bound, whichever is shorter ([`Config::effective_acquirer_timeout`]).
    pub acquirer_timeout: Option<Duration>,
    /// SQLite's durability mode (`--synchronous`, default [`Synchronous::Full`]).
    pub synchronous: Synchronous,
    /// Most write commands committed in one transaction
    /// (`--commit-batch-max`; 1 = one transaction per command).
    pub commit_batch_max: usize,
    /// The HTTP engine's limits (timeouts, header bytes, connection cap).
    pub http: HttpLimits,
    /// Abort the process at this point of an operation, to simulate a crash
    /// (crash tests; `IDEM_FAULT`). Never set it in production.
    pub fault: Option<FaultPoint>,
    /// With `fault`: only operations of this kind (`charge`, `capture`,
    /// `cancel`, `refund`, `account`, or the reaper's `expiry` of a hold)
    /// reach the fault point; `None`: any.
    pub fault_operation: Option<String>,
    /// How long a `requires_capture` hold lives before the reaper voids it.
    pub authorization_ttl: Duration,
    /// How long events are kept before the reaper deletes them.
    pub event_retention: Duration,
    /// Deadline of one webhook attempt (connect, headers and body).
    pub webhook_timeout: Duration,
    /// Backoff base of webhook retries (full jitter, doubling, capped at
    /// [`WEBHOOK_RETRY_CAP`]).
    pub webhook_retry_base: Duration,
    /// Attempts of one delivery before it is `failed`.
    pub webhook_attempts_max: u32,
    /// How far an inbound notification's timestamp may be from now.
    pub notification_tolerance: Duration,
    /// Code run at chosen points of an operation (tests only).
    pub hooks: Hooks,
    /// Run `idem verify`'s checks before serving and refuse a database that
    /// fails them (`--skip-verify` turns this off).
    pub verify_on_start: bool,
    /// Sandbox mode (`--sandbox`): honour the `Idem-Simulate` header and
    /// [`crate::Server::simulate`], and say so in `/healthz`. Off, the
    /// header is refused with 400 `simulation-disabled`. Never in
    /// production: a client could then make the server drop its answers.
    pub sandbox: bool,
}

impl Config {
    /// The defaults of `idem serve` on database `db`, except the address:
    /// `127.0.0.1:0`, a free port, where `idem serve` defaults to 8080.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let mut config = idem::Config::new("/var/lib/idem/idem.db");
    /// config.addr = "127.0.0.1:8080".parse().unwrap();
    /// config.inflight_timeout = Duration::from_secs(10);
    /// // At most half the in-flight timeout, or the server refuses to start.
    /// config.acquirer_timeout = Some(Duration::from_secs(5));
    /// config.synchronous = idem::Synchronous::Full;
    /// assert!(config.validate().is_ok());
    /// assert_eq!(config.effective_acquirer_timeout(), Duration::from_secs(5));
    /// ```
    pub fn new(db: impl Into<PathBuf>) -> Config {
        Config {
            db: db.into(),
            acquirer_store: None,
            addr: "127.0.0.1:0".parse().expect("valid literal address"),
            workers: default_workers(),
            key_retention: KEY_RETENTION_DEFAULT,
            inflight_timeout: Duration::from_secs(60),
            reaper_interval: Duration::from_secs(10),
            acquirer_latency: Duration::ZERO,
            acquirer_timeout: None,
            synchronous: Synchronous::Full,
            commit_batch_max: COMMIT_BATCH_MAX_DEFAULT,
            http: HttpLimits::default(),
            fault: None,
            fault_operation: None,
            authorization_ttl: AUTHORIZATION_TTL_DEFAULT,
            event_retention: EVENT_RETENTION_DEFAULT,
            webhook_timeout: WEBHOOK_TIMEOUT_DEFAULT,
            webhook_retry_base: WEBHOOK_RETRY_BASE_DEFAULT,
            webhook_attempts_max: WEBHOOK_ATTEMPTS_MAX_DEFAULT,
            notification_tolerance: NOTIFICATION_TOLERANCE_DEFAULT,
            hooks: Hooks::default(),
            verify_on_start: true,
            sandbox: false,
        }
    }

    /// The deadline every acquirer call gets: `acquirer_timeout` if set,
    /// else the default capped to fit the in-flight timeout.
    pub fn effective_acquirer_timeout(&self) -> Duration {
        self.acquirer_timeout.unwrap_or_else(|| {
            ACQUIRER_TIMEOUT_DEFAULT.min(self.inflight_timeout / INFLIGHT_PER_ACQUIRER_TIMEOUT_MIN)
        })
    }

    /// Refuses settings that contradict each other: an acquirer deadline
    /// that does not fit in the in-flight timeout (with the margin of
    /// [`INFLIGHT_PER_ACQUIRER_TIMEOUT_MIN`]) would let a live owner be
    /// taken over while it waits for the acquirer, and every retry restart
    /// the call. The message names both flags.
    pub fn validate(&self) -> Result<(), String> {
        if self.authorization_ttl.is_zero() || self.authorization_ttl > AUTHORIZATION_TTL_MAX {
            return Err(
                "--authorization-ttl must be longer than 0ms and at most 365d (a date every \
                 client can parse, far past any card network's authorization)"
                    .into(),
            );
        }
        if self.event_retention.is_zero()
            || self.webhook_timeout.is_zero()
            || self.webhook_retry_base.is_zero()
            || self.notification_tolerance.is_zero()
        {
            return Err(
                "--event-retention, --webhook-timeout, --webhook-retry-base and \
                 --notification-tolerance must be longer than 0ms"
                    .into(),
            );
        }
        if self.webhook_attempts_max == 0 {
            return Err("--webhook-attempts-max must be at least 1".into());
        }
        let Some(timeout) = self.acquirer_timeout else {
            return Ok(());
        };
        if timeout.is_zero() {
            return Err("--acquirer-timeout must be longer than 0ms".into());
        }
        let most = self.inflight_timeout / INFLIGHT_PER_ACQUIRER_TIMEOUT_MIN;
        if timeout > most {
            return Err(format!(
                "--acquirer-timeout {timeout:?} does not fit in --inflight-timeout {:?}: \
                 it may be at most 1/{INFLIGHT_PER_ACQUIRER_TIMEOUT_MIN} of it ({most:?}), so that \
                 an owner waiting for the acquirer reaches its recovery point before it can be \
                 taken over; lower --acquirer-timeout or raise --inflight-timeout",
                self.inflight_timeout
            ));
        }
        Ok(())
    }
}

/// CPU count × 4, at least 4 (the contract's default): workers decode,
/// authenticate and read; they wait on readers, never on the writer or the
/// acquirer (those run on the operation pool).
pub fn default_workers() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpus * 4).max(4)
}

/// A duration flag: an integer with one of the suffixes `ms`, `s`, `m`, `h`, `d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("'{s}' has no unit (use ms, s, m, h or d)"))?;
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("'{s}' does not start with a whole number"))?;
    let ms_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "'{s}' has an unknown unit '{unit}' (use ms, s, m, h or d)"
            ))
        }
    };
    n.checked_mul(ms_per_unit)
        .map(Duration::from_millis)
        .filter(|d| *d <= DURATION_MAX)
        .ok_or_else(|| format!("'{s}' is too long (at most 36500d)"))
}

impl fmt::Display for Synchronous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Synchronous::Full => "full",
            Synchronous::Normal => "normal",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_every_unit() {
        let cases = [
            ("250ms", Some(250)),
            ("3s", Some(3_000)),
            ("2m", Some(120_000)),
            ("24h", Some(86_400_000)),
            ("1d", Some(86_400_000)),
            ("0ms", Some(0)),
            ("10", None),
            ("s", None),
            ("1.5s", None),
            ("-1s", None),
            ("5w", None),
            ("99999999999999999999d", None),
        ];
        for (input, want) in cases {
            let got = parse_duration(input).ok().map(|d| d.as_millis() as u64);
            assert_eq!(got, want, "parse_duration({input:?})");
        }
    }
}
