//! The command line: `serve`, `consumers create|list`, `verify`, `backup`,
//! `migrate`. Raw flags
//! (each also read from an `IDEM_*` environment variable) become a validated
//! [`Config`] here, once.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{
    self, parse_duration, Config, FaultPoint, HttpLimits, Synchronous, WRITE_QUEUE_LEN_MAX,
};
use crate::error::{Error, Result};
use crate::{backup, consumers, store, verify, Server};

#[derive(Parser, Debug)]
#[command(
    name = "idem",
    version,
    about = "A payment ledger where a retried request moves money once",
    propagate_version = true
)]
struct Cli {
    /// SQLite database file. `serve` and `consumers create` create it (with
    /// the schema) if it does not exist and migrate an older one; `verify`,
    /// `backup`, `consumers list` and `migrate` need an existing one.
    #[arg(long, env = "IDEM_DB", default_value = "./idem.db", global = true)]
    db: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the ledger server.
    Serve(Box<ServeArgs>),
    /// Manage API consumers and their secret keys.
    Consumers {
        #[command(subcommand)]
        command: ConsumersCommand,
    },
    /// Check the database: integrity, foreign keys and every ledger invariant,
    /// and, where the built-in acquirer's file (`<db>.acquirer.sqlite`) is
    /// beside it, the acquirer's books against the ledger's. Exit 0 if all
    /// hold, 1 with a report if not.
    Verify,
    /// Copy the database to OUT with SQLite's online backup API, safely while
    /// `idem serve` runs, then verify the copy. Exit 0 if the copy verifies.
    /// SIGINT or SIGTERM stops it: its partial copy is removed, exit 1.
    Backup {
        /// Where to write the copy (must not exist): one self-contained
        /// SQLite file, to restore by starting `idem serve --db OUT`.
        out: PathBuf,
    },
    /// Bring an existing database's schema up to this idem's version (what
    /// `idem serve` also does at start), one numbered step per transaction,
    /// then exit. Refuses while `idem serve` runs on it, and refuses a
    /// database written by a newer idem.
    Migrate,
}

#[derive(Subcommand, Debug)]
enum ConsumersCommand {
    /// Create a consumer and print its secret key once on stdout (only its
    /// SHA-256 is stored).
    Create {
        /// 1–64 characters of A-Z a-z 0-9 _ - .
        name: String,
    },
    /// List consumers (name, id, created_at); never keys.
    List,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Listen address, HOST:PORT (an IP address or a host name such as
    /// localhost); port 0 picks a free port.
    #[arg(long, env = "IDEM_ADDR", default_value = "127.0.0.1:8080", value_parser = parse_addr)]
    addr: SocketAddr,
    /// HTTP worker threads [default: CPU count × 4, at least 4].
    #[arg(long, env = "IDEM_WORKERS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    workers: Option<u16>,
    /// How long a completed idempotency key is kept and replayed (ms, s, m, h, d).
    #[arg(long, env = "IDEM_KEY_RETENTION", default_value = "24h", value_parser = parse_positive_duration)]
    key_retention: Duration,
    /// An in-progress key whose owner is silent this long is an orphan and may be taken over.
    #[arg(long, env = "IDEM_INFLIGHT_TIMEOUT", default_value = "60s", value_parser = parse_positive_duration)]
    inflight_timeout: Duration,
    /// How often the reaper completes orphans and deletes expired keys.
    #[arg(long, env = "IDEM_REAPER_INTERVAL", default_value = "10s", value_parser = parse_positive_duration)]
    reaper_interval: Duration,
    /// How long an uncaptured hold (`capture: false`) lives before the reaper
    /// voids its authorization and releases it (`cancellation_reason: expired`).
    #[arg(long, env = "IDEM_AUTHORIZATION_TTL", default_value = "7d", value_parser = parse_authorization_ttl)]
    authorization_ttl: Duration,
    /// How long events are kept (and listed at /v1/events) before the reaper deletes them.
    #[arg(long, env = "IDEM_EVENT_RETENTION", default_value = "30d", value_parser = parse_positive_duration)]
    event_retention: Duration,
    /// Deadline of one webhook delivery attempt: connect, response headers and body.
    #[arg(long, env = "IDEM_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    webhook_timeout: Duration,
    /// A failed delivery is retried after a random wait of up to this, doubling with every attempt (full jitter), capped at 1h.
    #[arg(long, env = "IDEM_WEBHOOK_RETRY_BASE", default_value = "5s", value_parser = parse_positive_duration)]
    webhook_retry_base: Duration,
    /// Attempts of one delivery before it is marked failed.
    #[arg(long, env = "IDEM_WEBHOOK_ATTEMPTS_MAX", default_value_t = config::WEBHOOK_ATTEMPTS_MAX_DEFAULT,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    webhook_attempts_max: u32,
    /// How far an inbound notification's webhook-timestamp may be from now (older or newer: 401).
    #[arg(long, env = "IDEM_NOTIFICATION_TOLERANCE", default_value = "5m", value_parser = parse_positive_duration)]
    notification_tolerance: Duration,
    /// Latency of the built-in simulated acquirer: how long it takes to decide a new authorization (a repeated call for the same operation answers once it is decided).
    #[arg(long, env = "IDEM_ACQUIRER_LATENCY", default_value = "0ms", value_parser = parse_duration)]
    acquirer_latency: Duration,
    /// Deadline of every acquirer call; one not answered by then is a transient failure (503, key unlocked, the retry asks again). At most half of --inflight-timeout [default: 30s, or half of --inflight-timeout if that is shorter].
    #[arg(long, env = "IDEM_ACQUIRER_TIMEOUT", value_parser = parse_positive_duration)]
    acquirer_timeout: Option<Duration>,
    /// SQLite synchronous mode: `full` loses no acknowledged charge on power
    /// loss; `normal` is faster and may lose the last commits on power loss.
    #[arg(long, env = "IDEM_SYNCHRONOUS", value_enum, default_value = "full")]
    synchronous: SyncArg,
    /// Most write commands committed in one transaction (1 = one transaction per command).
    #[arg(long, env = "IDEM_COMMIT_BATCH_MAX", default_value_t = config::COMMIT_BATCH_MAX_DEFAULT as u16,
          value_parser = clap::value_parser!(u16).range(1..=WRITE_QUEUE_LEN_MAX as i64))]
    commit_batch_max: u16,
    /// Serve without first checking the database (integrity, foreign keys,
    /// every ledger invariant: what `idem verify` checks). Only to get at the
    /// data of a damaged database; the server may then serve wrong balances.
    #[arg(long, env = "IDEM_SKIP_VERIFY")]
    skip_verify: bool,
    /// Sandbox mode, for testing clients: honour the Idem-Simulate header
    /// (declines, acquirer outages, lost and late answers, crashes at each
    /// step). Never for real money: a client could make the server drop its
    /// answers.
    #[arg(long, env = "IDEM_SANDBOX")]
    sandbox: bool,
    /// A client must send a request's headers within this; it also bounds how long a keep-alive connection waits for the next request.
    #[arg(long, env = "IDEM_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    header_read_timeout: Duration,
    /// A declared body must arrive within this once the headers are in (else 400 and close).
    #[arg(long, env = "IDEM_BODY_READ_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    body_read_timeout: Duration,
    /// A connection with no request in flight and no byte moving for this long is closed.
    #[arg(long, env = "IDEM_IDLE_TIMEOUT", default_value = "5s", value_parser = parse_positive_duration)]
    idle_timeout: Duration,
    /// Header bytes per request, request line included (more: 431).
    #[arg(long, env = "IDEM_HEADER_BYTES_MAX", default_value_t = config::HEADER_BYTES_MAX as u32,
          value_parser = clap::value_parser!(u32).range(config::HEADER_BYTES_MAX_FLOOR as i64..=1 << 20))]
    header_bytes_max: u32,
    /// Open connections; the next one is answered 503 and closed.
    #[arg(long, env = "IDEM_CONNECTIONS_MAX", default_value_t = config::CONNECTIONS_MAX as u32,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    connections_max: u32,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum SyncArg {
    Full,
    Normal,
}

fn parse_positive_duration(s: &str) -> std::result::Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be longer than 0ms".into());
    }
    Ok(d)
}

/// `HOST:PORT` with an IP address or a host name. A name is resolved once,
/// here; of its addresses the first IPv4 one is taken (so `localhost` means
/// 127.0.0.1, as on most machines' clients), else the first.
fn parse_addr(s: &str) -> std::result::Result<SocketAddr, String> {
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if s.rsplit_once(':').is_none_or(|(host, _)| host.is_empty()) {
        return Err(format!(
            "'{s}' is not HOST:PORT (e.g. 127.0.0.1:8080, localhost:8080)"
        ));
    }
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve '{s}': {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("'{s}' resolves to no address"))
}

/// `IDEM_FAULT` (tests only): where to abort, to simulate a crash, and for
/// which kind of operation (`KIND:POINT`).
fn fault_from_env() -> Result<Option<(FaultPoint, Option<String>)>> {
    match std::env::var("IDEM_FAULT") {
        Ok(fault) => FaultPoint::parse_scoped(&fault)
            .map(Some)
            .ok_or_else(|| Error::Usage(format!("IDEM_FAULT: unknown fault point '{fault}'"))),
        Err(_) => Ok(None),
    }
}

fn parse_authorization_ttl(s: &str) -> std::result::Result<Duration, String> {
    let d = parse_positive_duration(s)?;
    if d > config::AUTHORIZATION_TTL_MAX {
        return Err("must be at most 365d".into());
    }
    Ok(d)
}

/// Runs the command line; `Ok` carries the exit code.
pub fn run() -> Result<i32> {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    match cli.command {
        Command::Serve(args) => serve(cli.db, *args),
        Command::Consumers {
            command: ConsumersCommand::Create { name },
        } => {
            let conn = store::open_rw(&cli.db, Synchronous::Full, None)?;
            let (consumer, key) = consumers::create(&conn, &name)?;
            eprintln!(
                "created consumer '{}' ({}); its secret key, shown once:",
                consumer.name, consumer.public_id
            );
            println!("{key}");
            Ok(0)
        }
        Command::Consumers {
            command: ConsumersCommand::List,
        } => {
            let conn = store::open_existing(&cli.db)?;
            println!("{:<24} {:<40} created_at", "name", "id");
            for c in consumers::list(&conn)? {
                println!("{:<24} {:<40} {}", c.name, c.public_id, c.created_at);
            }
            Ok(0)
        }
        Command::Verify => {
            let conn = store::open_current(&cli.db)?;
            let simulator = crate::acquirer::Simulator::store_path(&cli.db);
            let report = verify::verify_with_acquirer(&conn, &simulator)?;
            print!("{report}");
            Ok(if report.ok() { 0 } else { 1 })
        }
        Command::Migrate => migrate(&cli.db),
        Command::Backup { out } => {
            let mut options = backup::Options::default();
            if let Ok(delay) = std::env::var("IDEM_BACKUP_STEP_DELAY") {
                options.step_delay = parse_duration(&delay)
                    .map_err(|e| Error::Usage(format!("IDEM_BACKUP_STEP_DELAY: {e}")))?;
            }
            let cancel = Arc::new(backup::Cancel::default());
            cancel_on_signals(Arc::clone(&cancel))?;
            let summary = backup::backup(&cli.db, &out, &options, &cancel)?;
            for stale in &summary.stale_removed {
                eprintln!(
                    "removed {}, left by a backup that was killed",
                    stale.display()
                );
            }
            eprintln!(
                "copied {} pages ({} bytes) of {} to {}",
                summary.pages,
                summary.bytes,
                cli.db.display(),
                out.display()
            );
            print!("{}", summary.report);
            Ok(if summary.report.ok() { 0 } else { 1 })
        }
    }
}

/// `idem migrate`: under the process lock, so never beneath a running server.
fn migrate(db: &std::path::Path) -> Result<i32> {
    let mut conn = store::open_existing(db)?;
    let _lock = store::ProcessLock::acquire(db)?;
    let fault = fault_from_env()?.map(|(point, _)| point);
    let done = store::migrate(&mut conn, fault).map_err(|e| match e {
        Error::Db(e) => Error::Other(format!("database {}: {e}", db.display())),
        Error::Other(why) => Error::Other(format!("database {}: {why}", db.display())),
        other => other,
    })?;
    if done.from == done.to {
        println!(
            "database {} is at schema version {}: nothing to do",
            db.display(),
            done.to
        );
    } else {
        println!(
            "migrated database {} from schema version {} to {}",
            db.display(),
            done.from,
            done.to
        );
    }
    Ok(0)
}

fn serve(db: PathBuf, args: ServeArgs) -> Result<i32> {
    // Warnings and errors (failed batches, panics, refused connections) go
    // to stderr; RUST_LOG=info or =debug shows more.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let mut config = Config::new(db);
    config.addr = args.addr;
    if let Some(workers) = args.workers {
        config.workers = usize::from(workers);
    }
    config.key_retention = args.key_retention;
    config.inflight_timeout = args.inflight_timeout;
    config.reaper_interval = args.reaper_interval;
    config.acquirer_latency = args.acquirer_latency;
    config.acquirer_timeout = args.acquirer_timeout;
    config.synchronous = match args.synchronous {
        SyncArg::Full => Synchronous::Full,
        SyncArg::Normal => Synchronous::Normal,
    };
    config.commit_batch_max = usize::from(args.commit_batch_max);
    config.verify_on_start = !args.skip_verify;
    config.sandbox = args.sandbox;
    config.http = HttpLimits {
        header_read_timeout: args.header_read_timeout,
        body_read_timeout: args.body_read_timeout,
        idle_timeout: args.idle_timeout,
        header_bytes_max: args.header_bytes_max as usize,
        connections_max: args.connections_max as usize,
    };
    if let Some((point, operation)) = fault_from_env()? {
        config.fault = Some(point);
        config.fault_operation = operation;
    }
    config.authorization_ttl = args.authorization_ttl;
    config.event_retention = args.event_retention;
    config.webhook_timeout = args.webhook_timeout;
    config.webhook_retry_base = args.webhook_retry_base;
    config.webhook_attempts_max = args.webhook_attempts_max;
    config.notification_tolerance = args.notification_tolerance;
    // Signal handlers are installed before the server starts, so a signal
    // that arrives right after "listening" is never the default (fatal) one.
    let (signals, mut interrupt, mut terminate) = install_signal_handlers()?;
    budget_descriptors(&config);
    let server = Server::start(config)?;
    if let Some(key) = server.initial_key() {
        eprintln!(
            "created consumer 'default'; its secret key, shown this once (only its hash is stored):\n  {key}"
        );
    }
    eprintln!("listening on {}", server.url());
    signals.block_on(async {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    });
    eprintln!("shutting down: finishing in-flight requests");
    server.shutdown();
    eprintln!("stopped");
    Ok(0)
}

/// Installs SIGINT and SIGTERM handlers (from now on neither signal ends
/// the process), with the runtime that waits for them.
fn install_signal_handlers() -> Result<(
    tokio::runtime::Runtime,
    tokio::signal::unix::Signal,
    tokio::signal::unix::Signal,
)> {
    use tokio::signal::unix::{signal, SignalKind};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (interrupt, terminate) = {
        let _guard = runtime.enter();
        (
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        )
    };
    Ok((runtime, interrupt, terminate))
}

/// Turns the first SIGINT or SIGTERM into `cancel`, on a thread of its own:
/// `idem backup` then removes its partial file and exits 1 instead of dying
/// with the file left behind. Installed before the backup creates any file.
fn cancel_on_signals(cancel: Arc<backup::Cancel>) -> Result<()> {
    let (runtime, mut interrupt, mut terminate) = install_signal_handlers()?;
    std::thread::Builder::new()
        .name("idem-signals".into())
        .spawn(move || {
            let name = runtime.block_on(async {
                tokio::select! {
                    _ = interrupt.recv() => "SIGINT",
                    _ = terminate.recv() => "SIGTERM",
                }
            });
            cancel.cancel(name);
        })?;
    Ok(())
}

/// Raises the soft descriptor limit to the hard one (commonly 1024 → far
/// more), and warns when `--connections-max` plus what the server opens
/// itself (readers, the writer, WAL and journal files, the lock) still does
/// not fit: connections beyond the limit then wait in the accept queue, and
/// a reader that needs a new database connection may fail with EMFILE.
fn budget_descriptors(config: &Config) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    // A reader connection holds the database and its WAL open.
    let readers = config.workers + config::OPERATION_THREADS + 2;
    let own = 2 * readers + config::DESCRIPTORS_RESERVED;
    let needed = (config.http.connections_max + own) as u64;
    if limit.rlim_cur < needed {
        log::warn!(
            "the descriptor limit is {}, below the {needed} that --connections-max {} and \
             the server's own files need; raise it (ulimit -n) or lower --connections-max",
            limit.rlim_cur,
            config.http.connections_max
        );
    }
}
