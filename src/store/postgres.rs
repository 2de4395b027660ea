//! The PostgreSQL backend (`--db postgres://…`): a pool of connections,
//! each keeping its prepared statements, and short transactions.
//!
//! There is no writer thread. Every write command runs in its own
//! `SERIALIZABLE` transaction on the calling thread: PostgreSQL's
//! serializable snapshot isolation makes every command behave as if the
//! commands ran one at a time, which is what the domain's SQL (written for
//! SQLite's single writer: read, decide, write) relies on. A command that
//! loses a race gets a serialization failure (or a deadlock) and is run
//! again from the start on a fresh snapshot, up to [`RETRIES_MAX`] times;
//! so a write command must have no effect outside the database. Unique
//! constraints still decide what a retry cannot (two nodes inserting one
//! key). Reads run in a `REPEATABLE READ READ ONLY` transaction: one
//! snapshot.
//!
//! No session state survives a command: no advisory lock outlives its
//! transaction, no temporary table, no `SET` that a later borrower of the
//! connection would inherit. Any node may run any command.

use std::cell::RefCell;
use std::collections::HashMap;
use std::error::Error as StdError;
use std::str::FromStr;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use bytes::BytesMut;
use postgres::error::SqlState;
use postgres::types::{to_sql_checked, IsNull, ToSql, Type};
use postgres::{Client, NoTls, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::sql::{Arg, Db, Dialect, Row, Value};
use super::migrations::{Migrated, SCHEMA_VERSION, STEPS};
use crate::error::{Error, Result};

/// How many times a write command that lost a serialization race runs again
/// before its caller gets the error (a 503: the request may be retried).
pub const RETRIES_MAX: u32 = 64;

/// After this many serialization failures a write command's next attempts
/// run alone in this process (see [`PgStore::write`]).
pub const ESCALATE_AFTER: u32 = 2;

/// Prepared statements one connection keeps; past this the cache is emptied
/// and filled again, so statements built at run time cannot grow it forever.
const STATEMENT_CACHE_MAX: usize = 512;

/// The key of the transaction-scoped advisory lock that serialises schema
/// creation between nodes starting at once ("idem" in ASCII).
const MIGRATION_LOCK: i64 = 0x6964_656d;

/// The schema a new PostgreSQL database is created with.
pub(crate) const SCHEMA_SQL: &str = include_str!("../../schema_postgres.sql");

/// One pooled connection and the statements it has prepared.
pub struct PgConn {
    client: Client,
    statements: HashMap<String, Statement>,
}

impl PgConn {
    fn statement(&mut self, sql: &str) -> Result<Statement> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let prepared = self.client.prepare(&numbered_to_dollar(sql))?;
        if self.statements.len() >= STATEMENT_CACHE_MAX {
            self.statements.clear();
        }
        self.statements.insert(sql.to_owned(), prepared.clone());
        Ok(prepared)
    }
}

struct Manager {
    config: postgres::Config,
    /// TLS, when the URL asks for it (`sslmode=require`).
    tls: Option<MakeRustlsConnect>,
}

impl r2d2::ManageConnection for Manager {
    type Connection = PgConn;
    type Error = postgres::Error;

    fn connect(&self) -> std::result::Result<PgConn, postgres::Error> {
        let client = match &self.tls {
            Some(tls) => self.config.connect(tls.clone())?,
            None => self.config.connect(NoTls)?,
        };
        Ok(PgConn {
            client,
            statements: HashMap::new(),
        })
    }

    fn is_valid(&self, conn: &mut PgConn) -> std::result::Result<(), postgres::Error> {
        conn.client.simple_query("").map(|_| ())
    }

    fn has_broken(&self, conn: &mut PgConn) -> bool {
        conn.client.is_closed()
    }
}

/// A pool of connections to one PostgreSQL database.
#[derive(Clone)]
pub struct PgStore {
    pool: r2d2::Pool<Manager>,
    /// Shared by first attempts, taken alone by escalated retries (see
    /// [`PgStore::write`]).
    gate: Arc<RwLock<()>>,
}

impl PgStore {
    /// Connects to `url` with a pool of at most `size` connections; the
    /// first connection is made now, so a wrong URL or a server that is down
    /// fails here, with the URL's host named (never its password).
    pub fn open(url: &str, size: usize) -> Result<PgStore> {
        let (url, root_file) = take_root_cert(url);
        let config = postgres::Config::from_str(&url).map_err(|e| {
            Error::Config(format!(
                "--db: not a valid PostgreSQL URL ({e}); expected \
                 postgres://user[:password]@host[:port]/database[?sslmode=require\
                 [&sslrootcert=/path/ca.pem]]"
            ))
        })?;
        let tls = match config.get_ssl_mode() {
            postgres::config::SslMode::Require => Some(tls_connector(root_file.as_deref())?),
            _ if root_file.is_some() => {
                return Err(Error::Config(
                    "--db: sslrootcert is given but sslmode is not require; add sslmode=require"
                        .into(),
                ))
            }
            _ => None,
        };
        let target = describe(&config);
        let pool = r2d2::Pool::builder()
            .max_size(size as u32)
            .min_idle(Some(1))
            .connection_timeout(Duration::from_secs(10))
            .build(Manager { config, tls })
            .map_err(|e| {
                Error::Other(format!(
                    "cannot connect to PostgreSQL at {target}: {e}; check that the server is \
                     running, the database exists and the user may log in (with \
                     sslmode=require, that its certificate verifies against sslrootcert=… or \
                     a public CA)"
                ))
            })?;
        Ok(PgStore {
            pool,
            gate: Arc::new(RwLock::new(())),
        })
    }

    /// Runs `f` in a `SERIALIZABLE` transaction and commits; runs it again
    /// on a serialization failure or a deadlock (see the module's text).
    ///
    /// Contention: the commands that touch one hot row (a merchant every
    /// charge credits) all conflict, and under serializable isolation a
    /// conflict is a failure, not a wait; retried blindly, such a command can
    /// lose again and again to fresh ones. So a command that lost
    /// [`ESCALATE_AFTER`] times runs its next attempts alone in this process
    /// (the gate's write side; every first attempt takes the read side): it
    /// then conflicts only with other nodes' commands, of which a few at most
    /// are ever escalated at once, and one of each conflict commits.
    pub fn write<T>(&self, mut f: impl FnMut(&dyn Db) -> Result<T>) -> Result<T> {
        let mut attempt = 0;
        loop {
            let outcome = if attempt < ESCALATE_AFTER {
                let _shared = self.gate.read().unwrap_or_else(PoisonError::into_inner);
                self.transaction("BEGIN ISOLATION LEVEL SERIALIZABLE", &mut f)
            } else {
                let _alone = self.gate.write().unwrap_or_else(PoisonError::into_inner);
                self.transaction("BEGIN ISOLATION LEVEL SERIALIZABLE", &mut f)
            };
            match outcome {
                Err(e) if is_retryable(&e) && attempt < RETRIES_MAX => {
                    attempt += 1;
                    // Spread the retries of the commands that collided.
                    let jitter = u64::from(uuid::Uuid::new_v4().as_bytes()[0]) % 4;
                    std::thread::sleep(Duration::from_millis(u64::from(attempt.min(8)) + jitter));
                }
                other => return other,
            }
        }
    }

    /// Runs `f` on one read-only snapshot.
    pub fn read<T>(&self, f: impl FnOnce(&dyn Db) -> Result<T>) -> Result<T> {
        let mut f = Some(f);
        self.transaction("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", &mut |db| {
            (f.take().expect("a read runs once"))(db)
        })
    }

    fn transaction<T>(
        &self,
        begin: &str,
        f: &mut dyn FnMut(&dyn Db) -> Result<T>,
    ) -> Result<T> {
        let mut conn = self.pool.get()?;
        conn.client.batch_execute(begin)?;
        let outcome = {
            let tx = PgTx {
                conn: RefCell::new(&mut conn),
            };
            f(&tx)
        };
        match outcome {
            Ok(v) => {
                conn.client.batch_execute("COMMIT")?;
                Ok(v)
            }
            Err(e) => {
                // A connection left inside a failed transaction would poison
                // its next borrower: roll back, or drop it if even that fails.
                if conn.client.batch_execute("ROLLBACK").is_err() {
                    let _ = conn.client.simple_query("");
                }
                Err(e)
            }
        }
    }

    /// Brings the database to [`SCHEMA_VERSION`]: creates the schema in an
    /// empty database, accepts one at this version, refuses a newer one and
    /// a database that holds other tables. Several nodes starting at once
    /// on an empty database create it once: the transaction takes an
    /// advisory lock that ends with it (no session state is left behind).
    pub fn migrate(&self) -> Result<Migrated> {
        let mut conn = self.pool.get()?;
        let client = &mut conn.client;
        let mut tx = client.transaction()?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
        let known: bool = tx
            .query_one(
                "SELECT to_regclass('schema_migrations') IS NOT NULL",
                &[],
            )?
            .get(0);
        if known {
            let found: i64 = tx
                .query_one("SELECT coalesce(max(version), 0) FROM schema_migrations", &[])?
                .get(0);
            if found > SCHEMA_VERSION {
                return Err(Error::SchemaTooNew {
                    found,
                    supported: SCHEMA_VERSION,
                });
            }
            if found < SCHEMA_VERSION {
                // The PostgreSQL schema began at version 4; every step after
                // it will be a file of its own, applied here in order.
                return Err(Error::Other(format!(
                    "the database is at schema version {found}, which no idem release \
                     created on PostgreSQL"
                )));
            }
            tx.commit()?;
            return Ok(Migrated {
                from: found,
                to: found,
            });
        }
        let tables: i64 = tx
            .query_one(
                "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()",
                &[],
            )?
            .get(0);
        if tables > 0 {
            return Err(Error::Other(format!(
                "the database has {tables} tables but no idem schema_migrations table: it is \
                 not an idem database; pass the URL of an empty database (createdb) or of an \
                 idem one"
            )));
        }
        tx.batch_execute(SCHEMA_SQL)?;
        let now = crate::time::now_ms();
        for step in STEPS {
            tx.execute(
                "INSERT INTO schema_migrations (version, name, applied_at, applied_by) \
                 VALUES ($1, $2, $3, $4)",
                &[&step.version, &step.name, &now, &env!("CARGO_PKG_VERSION")],
            )?;
        }
        tx.commit()?;
        Ok(Migrated {
            from: 0,
            to: SCHEMA_VERSION,
        })
    }

    /// The schema version of the database (0: none yet).
    #[cfg(any(feature = "cli", feature = "internals"))]
    pub fn version(&self) -> Result<i64> {
        self.read(|db| {
            if !db.query_value::<bool>(
                "SELECT to_regclass('schema_migrations') IS NOT NULL",
                &[],
            )? {
                return Ok(0);
            }
            db.query_value("SELECT coalesce(max(version), 0) FROM schema_migrations", &[])
        })
    }
}

/// The URL without its `sslrootcert=PATH` parameter (which the driver does
/// not know), and that path.
fn take_root_cert(url: &str) -> (String, Option<std::path::PathBuf>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), None);
    };
    let mut root = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("sslrootcert=") {
            Some(path) => {
                root = Some(std::path::PathBuf::from(path));
                false
            }
            None => true,
        })
        .collect();
    if kept.is_empty() {
        (base.to_owned(), root)
    } else {
        (format!("{base}?{}", kept.join("&")), root)
    }
}

/// TLS with rustls (ring), verifying the server's certificate against the
/// PEM file `root_file`, or the Mozilla roots (webpki-roots) without one.
fn tls_connector(root_file: Option<&std::path::Path>) -> Result<MakeRustlsConnect> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    match root_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
                .map_err(|e| {
                    Error::Config(format!("--db: cannot read sslrootcert {}: {e}", path.display()))
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(Error::Config(format!(
                    "--db: sslrootcert {} holds no usable certificate",
                    path.display()
                )));
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

/// Host, port and database of a configuration, for messages (no password).
fn describe(config: &postgres::Config) -> String {
    let host = config
        .get_hosts()
        .first()
        .map(|h| match h {
            postgres::config::Host::Tcp(name) => name.clone(),
            postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".into());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config.get_dbname().unwrap_or("(the user's database)");
    format!("{host}:{port}/{db}")
}

/// Whether running the transaction again may succeed: it lost a race.
pub fn is_retryable(e: &Error) -> bool {
    match e {
        Error::Postgres(e) => matches!(
            e.code(),
            Some(&SqlState::T_R_SERIALIZATION_FAILURE) | Some(&SqlState::T_R_DEADLOCK_DETECTED)
        ),
        _ => false,
    }
}

/// A connection inside a transaction, as the domain sees it.
struct PgTx<'a> {
    conn: RefCell<&'a mut PgConn>,
}

impl Db for PgTx<'_> {
    fn dialect(&self) -> Dialect {
        Dialect::Postgres
    }

    fn execute(&self, sql: &str, args: &[&dyn Arg]) -> Result<usize> {
        let mut conn = self.conn.borrow_mut();
        let stmt = conn.statement(sql)?;
        let binds: Vec<Bind<'_>> = args.iter().map(|a| Bind(a.value())).collect();
        let refs: Vec<&(dyn ToSql + Sync)> = binds.iter().map(|b| b as _).collect();
        Ok(conn.client.execute(&stmt, &refs)? as usize)
    }

    fn query_each(
        &self,
        sql: &str,
        args: &[&dyn Arg],
        each: &mut dyn FnMut(&dyn Row) -> Result<()>,
    ) -> Result<()> {
        let rows = {
            let mut conn = self.conn.borrow_mut();
            let stmt = conn.statement(sql)?;
            let binds: Vec<Bind<'_>> = args.iter().map(|a| Bind(a.value())).collect();
            let refs: Vec<&(dyn ToSql + Sync)> = binds.iter().map(|b| b as _).collect();
            conn.client.query(&stmt, &refs)?
        };
        for r in &rows {
            each(&PgRow(r))?;
        }
        Ok(())
    }
}

/// A parameter as PostgreSQL binds it: converted to the type the server
/// inferred for its placeholder.
#[derive(Debug)]
struct Bind<'a>(Value<'a>);

type BoxError = Box<dyn StdError + Sync + Send>;

impl ToSql for Bind<'_> {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> std::result::Result<IsNull, BoxError> {
        match self.0 {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(i) => match *ty {
                Type::INT8 => i.to_sql(ty, out),
                Type::INT4 => i32::try_from(i)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(i)?.to_sql(ty, out),
                Type::BOOL => (i != 0).to_sql(ty, out),
                Type::FLOAT8 => (i as f64).to_sql(ty, out),
                Type::TEXT | Type::VARCHAR | Type::UNKNOWN => i.to_string().to_sql(ty, out),
                _ => Err(format!("an integer bound where PostgreSQL expects {ty}").into()),
            },
            Value::Real(f) => match *ty {
                Type::FLOAT8 => f.to_sql(ty, out),
                Type::FLOAT4 => (f as f32).to_sql(ty, out),
                _ => Err(format!("a real bound where PostgreSQL expects {ty}").into()),
            },
            Value::Text(s) => match *ty {
                Type::JSONB => {
                    // JSONB's binary form: a version byte, then the text.
                    out.extend_from_slice(&[1]);
                    out.extend_from_slice(s.as_bytes());
                    Ok(IsNull::No)
                }
                Type::JSON => {
                    out.extend_from_slice(s.as_bytes());
                    Ok(IsNull::No)
                }
                _ => s.to_sql(ty, out),
            },
            Value::Blob(b) => b.to_sql(ty, out),
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

struct PgRow<'r>(&'r postgres::Row);

impl Row for PgRow<'_> {
    fn value(&self, i: usize) -> Result<Value<'_>> {
        let r = self.0;
        let column = r
            .columns()
            .get(i)
            .ok_or_else(|| Error::Storage(format!("no column {i}")))?;
        let v = match *column.type_() {
            Type::INT8 => r.try_get::<_, Option<i64>>(i)?.map(Value::Int),
            Type::INT4 => r.try_get::<_, Option<i32>>(i)?.map(|v| Value::Int(v.into())),
            Type::INT2 => r.try_get::<_, Option<i16>>(i)?.map(|v| Value::Int(v.into())),
            Type::BOOL => r
                .try_get::<_, Option<bool>>(i)?
                .map(|v| Value::Int(v.into())),
            Type::FLOAT8 => r.try_get::<_, Option<f64>>(i)?.map(Value::Real),
            Type::BYTEA => r.try_get::<_, Option<&[u8]>>(i)?.map(Value::Blob),
            Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME | Type::UNKNOWN => {
                r.try_get::<_, Option<&str>>(i)?.map(Value::Text)
            }
            ref other => {
                return Err(Error::Storage(format!(
                    "column {i} ({}) has type {other}, which idem does not read; \
                     cast it in the query (a sum: CAST(sum(x) AS BIGINT))",
                    column.name()
                )))
            }
        };
        Ok(v.unwrap_or(Value::Null))
    }
}

/// `?N` placeholders as PostgreSQL's `$N`, outside string literals and
/// quoted identifiers.
pub fn numbered_to_dollar(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quote: Option<char> = None;
    for c in sql.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '\'' || c == '"' => quote = Some(c),
            None if c == '?' => {
                out.push('$');
                continue;
            }
            None => {}
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_outside_quotes_become_dollars() {
        assert_eq!(
            numbered_to_dollar("SELECT '?1', \"a?\" FROM t WHERE a = ?1 AND b = ?12"),
            "SELECT '?1', \"a?\" FROM t WHERE a = $1 AND b = $12"
        );
    }
}
