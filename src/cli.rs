//! The command line: `serve`, `consumers create|list`, `keys
//! list|show|evict`, `verify`, `backup`, `migrate`. Raw flags
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
use crate::idempotency::IdempotencyKey;
use crate::keys::{self, Eviction, KeyInfo};
use crate::store::Admin;
use crate::{backup, consumers, store, verify, Server};

#[derive(Parser, Debug)]
#[command(
    name = "idem",
    version,
    about = "A payment ledger where a retried request moves money once",
    propagate_version = true
)]
struct Cli {
    /// The database: an SQLite file, or a PostgreSQL URL
    /// (`postgres://user[:password]@host[:port]/database`, an existing
    /// database). `serve` and `consumers create` create an SQLite file (with
    /// the schema) if it does not exist and migrate an older one, and give
    /// an empty PostgreSQL database the schema; `verify`, `backup`,
    /// `consumers list` and `migrate` need an existing one.
    #[arg(long, env = "IDEM_DB", default_value = "./idem.db", global = true)]
    db: PathBuf,
    /// The built-in acquirer simulator's file. Default: `<db>.acquirer.sqlite`
    /// beside an SQLite database. Required with a PostgreSQL `--db`: every
    /// server sharing the database names the same file (they stand in front
    /// of one acquirer); `verify` and `keys evict` read it.
    #[arg(long, env = "IDEM_ACQUIRER_STORE", global = true)]
    acquirer_store: Option<PathBuf>,
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
    /// Inspect and evict idempotency keys, safely while `idem serve` runs.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
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

#[derive(Subcommand, Debug)]
enum KeysCommand {
    /// List idempotency keys, newest first: state, owner, recovery point,
    /// stored status, scope. Never a request's or an answer's body.
    List {
        /// Only this consumer's keys.
        #[arg(long)]
        consumer: Option<String>,
        /// Only keys in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        /// At most this many keys.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        limit: u32,
        /// One JSON object on stdout: {"object": "list", "data": [...], "has_more": bool}.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        inflight: InflightArg,
    },
    /// Show one key: state, owner, fingerprint, recovery point, operation,
    /// times, the stored status. Never the request kept with it nor the
    /// stored answer's body (which may hold a webhook secret).
    Show {
        #[command(flatten)]
        scope: KeyScope,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        inflight: InflightArg,
    },
    /// Delete a key, so that the next request with it is new. A completed
    /// key: always — its effect stays, and a retry with the same key and body
    /// makes a second one (a second charge). A key in progress: refused while
    /// its owner is alive (it proved so within --inflight-timeout); an orphan
    /// only while it is at recovery point `reserved` and the acquirer has not
    /// seen its operation — otherwise money has moved or is held at the
    /// acquirer, and a retry under a new operation would authorize, capture
    /// or void again; let a server finish such a key (a retry with it, or the
    /// reaper), then evict the completed key. Evicting an orphaned capture or
    /// cancel releases its claim on the hold. Exit 0 when evicted, 1 when
    /// refused or not found.
    Evict {
        #[command(flatten)]
        scope: KeyScope,
        /// One JSON object on stdout: the key as it was, and the hold released.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        inflight: InflightArg,
    },
}

/// Which key: consumer, path and key (the method is always POST).
#[derive(Args, Debug)]
struct KeyScope {
    /// The consumer whose key it is (by name).
    #[arg(long)]
    consumer: String,
    /// The concrete path the key was sent to, e.g.
    /// /v1/charges/ch_…/capture.
    #[arg(long, default_value = "/v1/charges", value_parser = parse_key_path)]
    path: String,
    /// The Idempotency-Key.
    #[arg(value_parser = parse_idempotency_key)]
    key: String,
}

/// `--inflight-timeout` of `idem keys`: which keys in progress are orphans.
#[derive(Args, Debug)]
struct InflightArg {
    /// The running server's --inflight-timeout: a key in progress whose owner
    /// has been silent this long is an orphan (set it as `idem serve`'s, e.g.
    /// through the same IDEM_INFLIGHT_TIMEOUT).
    #[arg(long = "inflight-timeout", env = "IDEM_INFLIGHT_TIMEOUT", default_value = "60s", value_parser = parse_positive_duration)]
    timeout: Duration,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum StateArg {
    #[value(name = "in_progress")]
    InProgress,
    #[value(name = "completed")]
    Completed,
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

/// A key as a client could have sent it (1–255 characters in 0x21–0x7E).
fn parse_idempotency_key(s: &str) -> std::result::Result<String, String> {
    IdempotencyKey::parse(s.as_bytes())
        .map(|k| k.as_str().to_string())
        .map_err(|_| "not an Idempotency-Key (1-255 printable ASCII characters, no space)".into())
}

/// A route path that takes an Idempotency-Key.
fn parse_key_path(s: &str) -> std::result::Result<String, String> {
    if s.starts_with("/v1/") && !s.contains(['?', '#']) && !s.chars().any(char::is_whitespace) {
        Ok(s.to_string())
    } else {
        Err("a path such as /v1/charges or /v1/charges/ch_…/capture".into())
    }
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
        Command::Serve(args) => serve(cli.db, cli.acquirer_store, *args),
        Command::Consumers {
            command: ConsumersCommand::Create { name },
        } => {
            let (consumer, key) =
                Admin::create(&cli.db)?.write(|db| consumers::create(db, &name))?;
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
            let found = existing(&cli.db)?.read(consumers::list)?;
            println!("{:<24} {:<40} created_at", "name", "id");
            for c in found {
                println!("{:<24} {:<40} {}", c.name, c.public_id, c.created_at);
            }
            Ok(0)
        }
        Command::Keys { command } => {
            let simulator = acquirer_store(&cli.db, cli.acquirer_store.as_deref())?;
            keys_command(&cli.db, &simulator, command)
        }
        Command::Verify => {
            let simulator = acquirer_store(&cli.db, cli.acquirer_store.as_deref())?;
            let report = match Admin::current(&cli.db)? {
                Admin::Sqlite(conn) => verify::verify_with_acquirer(&conn, &simulator)?,
                mut admin => {
                    admin.read(|db| verify::verify_invariants_with_acquirer(db, &simulator))?
                }
            };
            print!("{report}");
            Ok(if report.ok() { 0 } else { 1 })
        }
        Command::Migrate => migrate(&cli.db),
        Command::Backup { .. } if store::is_postgres(&cli.db) => Err(Error::Usage(
            "idem backup copies an SQLite file; a PostgreSQL database is backed up with \
             PostgreSQL's own tools: `pg_dump --format=custom --file=idem.dump <url>` (a \
             consistent snapshot while servers run), restored with `pg_restore` into an empty \
             database, then checked with `idem verify --db <its url>`"
                .into(),
        )),
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

/// `idem keys`: on an existing database at the current schema (the key
/// columns it reads), beside a running server if there is one.
fn keys_command(
    db: &std::path::Path,
    simulator: &std::path::Path,
    command: KeysCommand,
) -> Result<i32> {
    let mut admin = Admin::current(db)?;
    let now = crate::time::now_ms();
    match command {
        KeysCommand::List {
            consumer,
            state,
            limit,
            json,
            inflight,
        } => {
            let filter = keys::Filter {
                consumer,
                in_progress: state.map(|s| matches!(s, StateArg::InProgress)),
                limit: limit as usize,
            };
            let (found, more) = admin.read(|db| keys::list(db, &filter, now, inflight.timeout))?;
            if json {
                /// The list as the HTTP API's lists are shaped.
                #[derive(serde::Serialize)]
                struct List<'a> {
                    object: &'static str,
                    data: &'a [KeyInfo],
                    has_more: bool,
                }
                let list = List {
                    object: "list",
                    data: &found,
                    has_more: more,
                };
                println!("{}", serde_json::to_string(&list).expect("serialisable"));
                return Ok(0);
            }
            println!(
                "{:<24} {:<16} {:<11} {:<8} {:<14} {:<6} {:<40} key",
                "created_at", "consumer", "state", "owner", "recovery_point", "status", "path"
            );
            for k in &found {
                println!(
                    "{:<24} {:<16} {:<11} {:<8} {:<14} {:<6} {:<40} {}",
                    k.created_at,
                    k.consumer,
                    k.state,
                    k.owner.unwrap_or("-"),
                    k.recovery_point,
                    k.response_status.map_or("-".into(), |s| s.to_string()),
                    k.path,
                    k.key
                );
            }
            if more {
                eprintln!("more keys match; raise --limit to see them");
            }
            Ok(0)
        }
        KeysCommand::Show {
            scope,
            json,
            inflight,
        } => {
            let Some(info) = admin.read(|db| {
                keys::show(
                    db,
                    &scope.consumer,
                    &scope.path,
                    &scope.key,
                    now,
                    inflight.timeout,
                )
            })?
            else {
                return Err(no_such_key(&scope));
            };
            if json {
                println!("{}", serde_json::to_string(&info).expect("serialisable"));
            } else {
                print_key(&info);
            }
            Ok(0)
        }
        KeysCommand::Evict {
            scope,
            json,
            inflight,
        } => match keys::evict(
            &mut admin,
            simulator,
            &scope.consumer,
            &scope.path,
            &scope.key,
            now,
            inflight.timeout,
        )? {
            Eviction::Evicted {
                key,
                released_charge,
            } => {
                if json {
                    /// What was evicted, and the hold whose claim was released.
                    #[derive(serde::Serialize)]
                    struct Evicted<'a> {
                        evicted: &'a KeyInfo,
                        released_charge: Option<&'a str>,
                    }
                    let out = Evicted {
                        evicted: &key,
                        released_charge: released_charge.as_deref(),
                    };
                    println!("{}", serde_json::to_string(&out).expect("serialisable"));
                } else {
                    println!(
                        "evicted key '{}' of consumer '{}' on POST {} ({}, {}); \
                         the next request with it is new",
                        key.key,
                        key.consumer,
                        key.path,
                        key.state,
                        key.operation.as_deref().unwrap_or("unknown operation"),
                    );
                    if let Some(charge) = released_charge {
                        println!("released the claim on charge {charge}");
                    }
                }
                Ok(0)
            }
            Eviction::NotFound => Err(no_such_key(&scope)),
            Eviction::Refused(why) => Err(Error::Other(format!("refused: {why}"))),
        },
    }
}

fn no_such_key(scope: &KeyScope) -> Error {
    Error::Other(format!(
        "no key '{}' of consumer '{}' on POST {} (see `idem keys list`; --path names \
         the route the key was sent to)",
        scope.key, scope.consumer, scope.path
    ))
}

/// `idem keys show` as text: one field per line.
fn print_key(k: &KeyInfo) {
    let none = || "-".to_string();
    let fields = [
        ("consumer", k.consumer.clone()),
        ("method", k.method.clone()),
        ("path", k.path.clone()),
        ("key", k.key.clone()),
        ("operation", k.operation.clone().unwrap_or_else(none)),
        ("op_id", k.op_id.clone()),
        ("state", k.state.clone()),
        ("owner", k.owner.map_or_else(none, str::to_string)),
        ("recovery_point", k.recovery_point.clone()),
        ("generation", k.generation.to_string()),
        ("fingerprint", k.fingerprint.clone()),
        (
            "authorization",
            k.authorization.clone().unwrap_or_else(none),
        ),
        ("created_at", k.created_at.clone()),
        ("locked_at", k.locked_at.clone().unwrap_or_else(none)),
        ("completed_at", k.completed_at.clone().unwrap_or_else(none)),
        (
            "response_status",
            k.response_status.map_or_else(none, |s| s.to_string()),
        ),
    ];
    for (name, value) in fields {
        println!("{name:<16} {value}");
    }
}

/// The database of a command that reads or checks an existing one: an
/// SQLite file at any schema this build knows ([`store::open_existing`]), a
/// PostgreSQL database at this build's.
fn existing(db: &std::path::Path) -> Result<Admin> {
    if store::is_postgres(db) {
        Admin::current(db)
    } else {
        Ok(Admin::Sqlite(store::open_existing(db)?))
    }
}

/// The acquirer simulator's file: `--acquirer-store`, else the one beside
/// an SQLite database; a PostgreSQL database has nothing beside it.
fn acquirer_store(db: &std::path::Path, named: Option<&std::path::Path>) -> Result<PathBuf> {
    match named {
        Some(path) => Ok(path.to_path_buf()),
        None if store::is_postgres(db) => Err(Error::Usage(
            "--db is a PostgreSQL URL: name the acquirer simulator's file with \
             --acquirer-store PATH (the one the servers use)"
                .into(),
        )),
        None => Ok(crate::acquirer::Simulator::store_path(db)),
    }
}

/// `idem migrate`: under the process lock, so never beneath a running server.
/// On PostgreSQL, beside running servers: creating the schema of an empty
/// database is one transaction, which servers starting at once wait for.
fn migrate(db: &std::path::Path) -> Result<i32> {
    if let Some(url) = store::postgres_url(db) {
        let done = store::PgStore::open(url, 1)?.migrate()?;
        if done.from == done.to {
            println!(
                "the PostgreSQL database is at schema version {}: nothing to do",
                done.to
            );
        } else {
            println!(
                "created the idem schema (version {}) in the PostgreSQL database",
                done.to
            );
        }
        return Ok(0);
    }
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

/// The server's logger, less the PostgreSQL driver's debug and trace
/// records, whatever `RUST_LOG` says: `tokio_postgres` logs every
/// statement's parameters at debug (idempotency keys, request bodies,
/// metadata, key hashes) and its SQL text, which the log must never carry.
/// Its warnings and errors still pass.
struct NoDriverDebug(env_logger::Logger);

impl NoDriverDebug {
    fn is_driver_detail(metadata: &log::Metadata<'_>) -> bool {
        let target = metadata.target();
        metadata.level() > log::Level::Info
            && ["tokio_postgres", "postgres"]
                .iter()
                .any(|c| target == *c || target.starts_with(&format!("{c}::")))
    }
}

impl log::Log for NoDriverDebug {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        !Self::is_driver_detail(metadata) && self.0.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if !Self::is_driver_detail(record.metadata()) {
            self.0.log(record);
        }
    }

    fn flush(&self) {
        self.0.flush();
    }
}

fn serve(db: PathBuf, acquirer_store: Option<PathBuf>, args: ServeArgs) -> Result<i32> {
    // Warnings and errors (failed batches, panics, refused connections) go
    // to stderr; RUST_LOG=info or =debug shows more.
    let logger =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).build();
    log::set_max_level(logger.filter());
    log::set_boxed_logger(Box::new(NoDriverDebug(logger))).expect("the logger is set once");
    let mut config = Config::new(db);
    config.acquirer_store = acquirer_store;
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
