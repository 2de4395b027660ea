//! # idem
//!
//! An embedded, single-node payment ledger on SQLite whose reason to exist is
//! that a client may send the same request twice and the money moves once:
//! N executions of one request are observably equal to one — same effect,
//! same status, same body.
//!
//! The binary (`idem serve`) is one way in; this library is the other. A
//! developer testing a client's retry logic starts a server in-process on a
//! temporary database, points the client at [`Server::url`], provokes
//! timeouts and conflicts, and drops the server:
//!
//! ```
//! let server = idem::Server::start_temporary(|config| {
//!     config.acquirer_latency = std::time::Duration::from_millis(200);
//! })?;
//! let key = server.create_consumer("my-client-test")?;
//! println!("POST {}/v1/charges with Authorization: Bearer {key}", server.url());
//! server.shutdown();
//! # Ok::<(), idem::Error>(())
//! ```
//!
//! # What an embedder sees
//!
//! - [`Server`]: start (on a database of yours or a temporary one, with the
//!   built-in acquirer simulator or an [`acquirer::Acquirer`] of yours),
//!   [`Server::url`], consumers, one reaper pass on demand, shutdown.
//! - [`Config`] and its parts ([`HttpLimits`], [`Synchronous`], [`Hooks`],
//!   [`FaultPoint`]); the named limits in [`config`].
//! - [`acquirer`]: the [`acquirer::Acquirer`] trait, its types, and the
//!   built-in [`acquirer::Simulator`] (its journal, for a test's
//!   assertions).
//! - [`Error`] and [`Result`].
//!
//! Clients speak to the server over HTTP (the contract is `openapi.json`,
//! served at `/openapi.json`), so the ledger's own types stay inside.
//!
//! # Features
//!
//! - `cli` (default): the `idem` binary and [`cli`]. An embedder depends on
//!   idem with `default-features = false` and gets neither clap nor
//!   env_logger:
//!   `idem = { path = "…", default-features = false }`.
//! - `internals`: idem's internal modules made public, hidden from these
//!   docs, for idem's own integration tests, benches and fuzz targets. Not an
//!   interface; it changes with any commit.
//!
//! See ARCHITECTURE.md for the code map and the invariants.

#![deny(missing_docs)]

/// Declares the crate's internal modules: private in the library an embedder
/// sees; public but hidden from the documentation with the `internals`
/// feature, which only idem's own integration tests, benches and fuzz
/// targets turn on (through the dev-dependency of the crate on itself, and
/// `fuzz/Cargo.toml`). Nothing under them is a stable interface.
macro_rules! internal {
    ($($name:ident),* $(,)?) => {$(
        #[cfg(feature = "internals")]
        #[doc(hidden)]
        pub mod $name;
        #[cfg(not(feature = "internals"))]
        mod $name;
    )*};
}

pub mod acquirer;
#[cfg(feature = "cli")]
pub mod cli;
pub mod config;
pub mod sandbox;

internal! {
    api,
    app,
    consumers,
    delivery,
    error,
    events,
    http,
    idempotency,
    ids,
    inbound,
    json,
    ledger,
    metrics,
    model,
    pool,
    reaper,
    signature,
    store,
    time,
    verify,
    webhooks,
}

// The operators' tools: only the command line uses them.
#[cfg(any(feature = "cli", feature = "internals"))]
internal! {
    backup,
    keys,
}

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use acquirer::{Acquirer, Simulator};
use api::Answer;
use app::App;
use config::OPERATION_THREADS;
use delivery::Delivery;
use http::server::{Handler, HttpServer};
use metrics::Metrics;
use reaper::Reaper;
use store::{PgStore, ProcessLock, Readers, Store, Writer};

pub use config::{Config, FaultPoint, Hooks, HttpLimits, Synchronous};
pub use error::{Error, Result};

/// A running idem server: HTTP front end, workers, writer, reaper. Shuts down
/// cleanly on [`Server::shutdown`] or when dropped.
pub struct Server {
    app: Arc<App>,
    http: Option<HttpServer>,
    reaper: Option<Reaper>,
    /// The webhook delivery engine.
    delivery: Option<Delivery>,
    url: String,
    initial_key: Option<String>,
    _lock: Option<ProcessLock>,
    /// Declared last: the temporary directory outlives everything above.
    _temp: Option<TempDir>,
}

impl Server {
    /// Starts a server as configured, with the built-in acquirer simulator
    /// (its memory of keys kept next to the database, in
    /// `<db>.acquirer.sqlite`; see [`Simulator`]).
    pub fn start(config: Config) -> Result<Server> {
        check_config(&config)?;
        // Before the lock and the simulator create files beside the
        // database: a wrong --db is reported with its path, not as a bare
        // I/O error.
        if store::is_postgres(&config.db) {
            let Some(path) = &config.acquirer_store else {
                return Err(Error::Usage(
                    "--db is a PostgreSQL URL: name the acquirer simulator's file with \
                     --acquirer-store PATH, the same for every server sharing the database"
                        .into(),
                ));
            };
            let acquirer = Simulator::open_file(
                path,
                config.acquirer_latency,
                config.key_retention,
                Arc::new(time::now_ms),
            )?;
            return Server::start_locked(config, None, Arc::new(acquirer));
        }
        store::preflight(&config.db)?;
        // The lock first: the simulator's file (and the import of a v1
        // journal) belongs to the one server of this database.
        let lock = ProcessLock::acquire(&config.db)?;
        let acquirer = match &config.acquirer_store {
            Some(path) => Simulator::open_file(
                path,
                config.acquirer_latency,
                config.key_retention,
                Arc::new(time::now_ms),
            )?,
            None => Simulator::open(&config.db, config.acquirer_latency, config.key_retention)?,
        };
        Server::start_locked(config, Some(lock), Arc::new(acquirer))
    }

    /// Starts a server on `127.0.0.1:0` (a free port) on a fresh database in
    /// a temporary directory that is removed when the server stops;
    /// `configure` may change any other option. Servers started so never
    /// collide, however many tests run at once.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// let server = idem::Server::start_temporary(|config| {
    ///     config.inflight_timeout = Duration::from_secs(2);
    ///     config.reaper_interval = Duration::from_millis(100);
    /// })?;
    /// assert!(server.url().starts_with("http://127.0.0.1:"));
    /// assert_ne!(server.addr().port(), 0);
    /// let db = server.db_path().to_path_buf();
    /// assert!(db.exists());
    /// // The first start on a new database creates the `default` consumer.
    /// assert!(server.initial_key().unwrap().starts_with("sk_"));
    /// server.shutdown();
    /// assert!(!db.exists(), "the temporary directory is gone");
    /// # Ok::<(), idem::Error>(())
    /// ```
    pub fn start_temporary(configure: impl FnOnce(&mut Config)) -> Result<Server> {
        let (temp, config) = temporary_config(configure)?;
        let mut server = Server::start(config)?;
        server._temp = Some(temp);
        Ok(server)
    }

    /// [`Server::start_temporary`] with `acquirer` instead of the simulator:
    /// a temporary database, a free port, and a third party of the test's
    /// making (slow, failing, counting).
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    /// use std::time::{Duration, Instant};
    ///
    /// use idem::acquirer::{Acquirer, AuthorizeOutcome, Simulator, Unavailable};
    ///
    /// /// The simulator, failing its first `failures` authorizations as an
    /// /// outage would: the server answers 503 and the retry succeeds.
    /// struct Flaky {
    ///     inner: Simulator,
    ///     failures: AtomicUsize,
    /// }
    ///
    /// impl Acquirer for Flaky {
    ///     fn authorize(&self, key: &str, amount: i64, currency: &str, capture: bool,
    ///                  deadline: Instant) -> Result<AuthorizeOutcome, Unavailable> {
    ///         let left = self.failures.load(Ordering::SeqCst);
    ///         if left > 0 {
    ///             self.failures.store(left - 1, Ordering::SeqCst);
    ///             return Err(Unavailable("connection reset".into()));
    ///         }
    ///         self.inner.authorize(key, amount, currency, capture, deadline)
    ///     }
    ///     fn capture(&self, key: &str, authorization: &str, amount: i64,
    ///                deadline: Instant) -> Result<(), Unavailable> {
    ///         self.inner.capture(key, authorization, amount, deadline)
    ///     }
    ///     fn void(&self, key: &str, authorization: &str, deadline: Instant)
    ///             -> Result<(), Unavailable> {
    ///         self.inner.void(key, authorization, deadline)
    ///     }
    ///     fn refund(&self, key: &str, authorization: &str, amount: i64,
    ///               deadline: Instant) -> Result<(), Unavailable> {
    ///         self.inner.refund(key, authorization, amount, deadline)
    ///     }
    /// }
    ///
    /// let flaky = Arc::new(Flaky {
    ///     inner: Simulator::new(Duration::ZERO),
    ///     failures: AtomicUsize::new(1),
    /// });
    /// let server = idem::Server::start_temporary_with_acquirer(flaky, |config| {
    ///     config.workers = 4;
    /// })?;
    /// println!("a flaky acquirer behind {}", server.url());
    /// server.shutdown();
    /// # Ok::<(), idem::Error>(())
    /// ```
    pub fn start_temporary_with_acquirer(
        acquirer: Arc<dyn Acquirer>,
        configure: impl FnOnce(&mut Config),
    ) -> Result<Server> {
        let (temp, config) = temporary_config(configure)?;
        let mut server = Server::start_with_acquirer(config, acquirer)?;
        server._temp = Some(temp);
        Ok(server)
    }

    /// Starts a server that calls `acquirer` instead of the simulator (to
    /// inject a slow or failing third party).
    pub fn start_with_acquirer(config: Config, acquirer: Arc<dyn Acquirer>) -> Result<Server> {
        check_config(&config)?;
        if store::is_postgres(&config.db) {
            return Server::start_locked(config, None, acquirer);
        }
        store::preflight(&config.db)?;
        let lock = ProcessLock::acquire(&config.db)?;
        Server::start_locked(config, Some(lock), acquirer)
    }

    /// Starts a server on a validated `config` whose database `lock` holds
    /// (SQLite; none on PostgreSQL, which servers share).
    fn start_locked(
        config: Config,
        lock: Option<ProcessLock>,
        acquirer: Arc<dyn Acquirer>,
    ) -> Result<Server> {
        if config.sandbox {
            log::warn!(
                "sandbox mode: Idem-Simulate faults are honoured (dropped answers, crashes, \
                 declines); never serve real clients like this"
            );
        }
        let metrics = Arc::new(Metrics::default());
        let store = open_store(&config, &metrics)?;
        let app = App::start(config.clone(), store, acquirer, metrics);
        let handler_app = Arc::clone(&app);
        let handler: Handler = Arc::new(move |req| {
            let started = Instant::now();
            let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if let Some(hook) = &handler_app.config.hooks.before_handler {
                    hook(&req.method, &req.path);
                }
                http::router::handle(&handler_app, req)
            }));
            // A panic is answered 500 by the worker; count it here.
            let (route, answer) = handled.unwrap_or_else(|_| {
                let route =
                    http::router::match_route(&req.path).map_or("unmatched", |r| r.template());
                log::error!("handler panicked on {} {route}", req.method);
                (route, Answer::Now(api::Problem::Internal.reply()))
            });
            let metrics = Arc::clone(&handler_app.metrics);
            // The method is copied only when the access log will print it.
            let method = log::log_enabled!(log::Level::Debug).then(|| req.method.clone());
            answer.inspect(move |reply| {
                let seconds = started.elapsed().as_secs_f64();
                // A sandbox fault that leaves no answer has no status to count.
                if reply.handover == api::Handover::Abandon {
                    log::debug!("{route}: answer abandoned (sandbox)");
                    return;
                }
                metrics.record_request(route, reply.status, seconds);
                // The access log names the route template, never the raw
                // path, a header or the body: nothing a client sends that
                // could be a secret reaches the log.
                if let Some(method) = method {
                    log::debug!(
                        "{method} {route} -> {} in {:.1} ms",
                        reply.status,
                        seconds * 1e3
                    );
                }
            })
        });
        let metrics = Arc::clone(&app.metrics);
        let http =
            match HttpServer::start(config.addr, config.workers, config.http, handler, metrics) {
                Ok(http) => http,
                Err(e) => {
                    app.stop();
                    return Err(e);
                }
            };
        // The `default` consumer is created only now that the server can
        // run: its key is shown once, so a start that fails (the port is
        // taken) must not have created it.
        let initial_key = match app.create_first_consumer("default") {
            Ok(key) => key,
            Err(e) => {
                let mut http = http;
                http.shutdown();
                app.stop();
                return Err(e);
            }
        };
        let url = format!("http://{}", http.addr());
        let reaper = Reaper::start(Arc::clone(&app));
        let delivery = Delivery::start(Arc::clone(&app));
        Ok(Server {
            app,
            http: Some(http),
            reaper: Some(reaper),
            delivery: Some(delivery),
            url,
            initial_key,
            _lock: lock,
            _temp: None,
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The address the server listens on (the port the system chose for
    /// port 0).
    pub fn addr(&self) -> SocketAddr {
        self.http.as_ref().expect("running").addr()
    }

    /// The database file (for a temporary server, inside its temporary
    /// directory: gone once the server stops).
    pub fn db_path(&self) -> &Path {
        &self.app.config.db
    }

    /// The key of the `default` consumer if this start created it (the first
    /// start that got as far as listening, on a database with no consumer);
    /// `None` ever after.
    pub fn initial_key(&self) -> Option<&str> {
        self.initial_key.as_deref()
    }

    /// Creates a consumer and returns its secret key.
    pub fn create_consumer(&self, name: &str) -> Result<String> {
        self.app.create_consumer(name)
    }

    /// The application behind the HTTP front end: every operation as a
    /// synchronous call, for benches (the no-HTTP floor). Internal: only
    /// with the `internals` feature.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn app(&self) -> &Arc<App> {
        &self.app
    }

    /// Scripts sandbox faults for the next requests that match
    /// `simulation` (see [`sandbox::Simulation`]), as if they had carried
    /// them in `Idem-Simulate`, so a test can provoke faults on requests a
    /// client library makes without setting headers. Refused
    /// ([`Error::Usage`]) unless the server runs in sandbox mode
    /// ([`Config::sandbox`]), and for faults that contradict each other or
    /// that the matched route cannot take.
    ///
    /// ```no_run
    /// use idem::sandbox::{Directive, Simulation};
    /// let server = idem::Server::start_temporary(|c| c.sandbox = true)?;
    /// server.simulate(
    ///     Simulation::new()
    ///         .matching("/v1/charges")
    ///         .fault(Directive::ResponseDrop),
    /// )?;
    /// // The next charge commits, and its connection closes unanswered.
    /// # Ok::<(), idem::Error>(())
    /// ```
    pub fn simulate(&self, simulation: sandbox::Simulation) -> Result<()> {
        self.app.sandbox().add(simulation)
    }

    /// Forgets every scripted fault not used yet.
    pub fn clear_simulations(&self) {
        self.app.sandbox().clear();
    }

    /// How many scripted faults are still waiting for a matching request.
    pub fn pending_simulations(&self) -> u64 {
        self.app.sandbox().pending()
    }

    /// Runs one reaper pass now (orphans, then retention), as the reaper
    /// thread does every `--reaper-interval`.
    pub fn reap_now(&self) {
        reaper::pass(&self.app);
    }

    /// Stops accepting, finishes in-flight requests and queued async work,
    /// stops the reaper, then the writer, which checkpoints the WAL.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(mut http) = self.http.take() {
            http.shutdown();
        }
        if let Some(mut reaper) = self.reaper.take() {
            reaper.stop();
        }
        // Before the writer: attempts on the wire record their outcome.
        if let Some(mut delivery) = self.delivery.take() {
            delivery.stop();
        }
        self.app.stop();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Refuses to serve a database that fails `idem verify`'s checks: serving
/// it would answer replays and balances from a ledger already wrong, and
/// every new charge would be written on top of the damage.
/// Opens the database of `config` for serving: SQLite's writer thread and
/// readers, or a PostgreSQL pool sized for every thread that may hold a
/// connection at once; the schema brought up to date, and the startup check.
fn open_store(config: &Config, metrics: &Arc<Metrics>) -> Result<Store> {
    let readers_max = config.workers + OPERATION_THREADS + 2;
    if let Some(url) = store::postgres_url(&config.db) {
        let pg = PgStore::open(url, config::PG_POOL_MAX)?;
        pg.migrate()?;
        if config.verify_on_start {
            refuse_unless_verified(&config.db, pg.read(verify::verify_invariants)?)?;
        }
        return Ok(Store::postgres(pg));
    }
    let conn = store::open_rw(&config.db, config.synchronous, config.fault)?;
    if config.verify_on_start {
        refuse_unless_verified(&config.db, verify::verify(&conn)?)?;
    }
    let readers = Readers::open(&config.db, readers_max)?;
    let writer = Writer::start(conn, config.commit_batch_max, Arc::clone(metrics));
    Ok(Store::Sqlite { writer, readers })
}

/// The startup check's verdict: a database that fails `idem verify`'s
/// checks is not served.
fn refuse_unless_verified(db: &Path, report: verify::Report) -> Result<()> {
    if report.ok() {
        return Ok(());
    }
    Err(Error::Config(format!(
        "refusing to serve {}: it fails its startup check\n{report}\
         restore it from a backup (`idem backup`), or inspect it with `idem verify`; \
         `idem serve --skip-verify` serves it anyway",
        db.display()
    )))
}

/// Refuses a configuration the server cannot run with, before anything is
/// opened or created.
fn check_config(config: &Config) -> Result<()> {
    refuse_memory(config)?;
    config.validate().map_err(Error::Usage)?;
    config.http.validate().map_err(Error::Config)
}

/// `:memory:` cannot be shared by the writer and the readers.
fn refuse_memory(config: &Config) -> Result<()> {
    if config.db.as_os_str() == ":memory:" {
        return Err(Error::Usage(
            "--db :memory: cannot be shared by the writer and the readers; \
             use a file (the embedding API offers a temporary one)"
                .into(),
        ));
    }
    Ok(())
}

/// A new temporary directory and the configuration of a server on a database
/// in it, listening on a free port, after `configure`.
fn temporary_config(configure: impl FnOnce(&mut Config)) -> Result<(TempDir, Config)> {
    let temp = TempDir::new()?;
    let mut config = Config::new(temp.path().join("idem.db"));
    config.addr = SocketAddr::from(([127, 0, 0, 1], 0));
    configure(&mut config);
    Ok((temp, config))
}

/// A directory removed (with its contents) on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        let path = std::env::temp_dir().join(format!("idem-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&path)?;
        Ok(TempDir(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
