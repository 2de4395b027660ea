//! Opening the database: pragmas, the schema and its migrations
//! ([`migrate`], in `migrations.rs`), the process
//! lock; and the two ways in: the single writer thread ([`Writer`]) and the
//! pool of read-only connections ([`Readers`]).

mod migrations;
mod readers;
mod postgres;
mod sql;
mod sqlite;
mod writer;

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use rusqlite::{Connection, ErrorCode};

use crate::config::{FaultPoint, Synchronous, BUSY_TIMEOUT, WAL_SIZE_LIMIT_BYTES};
use crate::error::{Error, Result};

pub use migrations::{migrate, SCHEMA_VERSION};
pub use readers::Readers;
pub(crate) use sql::params;
pub(crate) use postgres::reason as pg_reason;
pub use postgres::PgStore;

/// Whether `--db` names a PostgreSQL database rather than an SQLite file.
pub fn is_postgres(db: &Path) -> bool {
    postgres_url(db).is_some()
}

/// The URL `--db` holds, if it is a PostgreSQL one.
pub fn postgres_url(db: &Path) -> Option<&str> {
    db.to_str()
        .filter(|s| s.starts_with("postgres://") || s.starts_with("postgresql://"))
}
pub use sql::{Arg, Db, Dialect, Row, Value};
pub use writer::Writer;

#[cfg(test)]
pub(crate) use migrations::SCHEMA_SQL;

/// Opens (creating if needed) a read-write connection with the pragmas every
/// writing connection needs, and brings the schema up to date ([`migrate`];
/// `fault` is for the crash test of a migration). Every failure names the
/// path and says what to do.
pub fn open_rw(
    path: &Path,
    synchronous: Synchronous,
    fault: Option<FaultPoint>,
) -> Result<Connection> {
    preflight(path)?;
    let mut conn = Connection::open(path).map_err(|e| cannot_open(path, e))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    // Before anything writes (switching to WAL rewrites the header): a
    // database from a newer idem, or another program's, is refused untouched.
    migrations::refuse_foreign_or_newer(&conn).map_err(|e| in_database(path, e))?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(|e| cannot_open(path, e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(Error::Other(format!(
            "database {} cannot use WAL (journal_mode is {mode})",
            path.display()
        )));
    }
    conn.pragma_update(None, "synchronous", synchronous.pragma())?;
    // A reader that holds an old snapshot (idem backup) keeps checkpoints
    // from resetting the WAL, which grows meanwhile; without a limit the
    // file then stays at its high-water mark. With one, the first commit
    // after a checkpoint has reset the WAL truncates the file to the limit.
    conn.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT_BYTES)?;
    migrate(&mut conn, fault).map_err(|e| in_database(path, e))?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    Ok(conn)
}

/// Opens an existing database read-write without creating it or changing
/// its schema, for the commands that only read or check it (`verify`,
/// `backup`, `consumers list`, `migrate`). A database newer than this build
/// is refused.
#[cfg(any(feature = "cli", feature = "internals"))]
pub fn open_existing(path: &Path) -> Result<Connection> {
    if path.is_dir() {
        return Err(Error::Other(format!(
            "--db {} is a directory; pass the path of an idem database file",
            path.display()
        )));
    }
    if !path.exists() {
        return Err(Error::Other(format!(
            "no database at {} (check --db or IDEM_DB; `idem serve` creates a new one)",
            path.display()
        )));
    }
    let conn = Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE)
        .map_err(|e| cannot_open(path, e))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    let found = migrations::version(&conn).map_err(|e| in_database(path, e))?;
    if found > SCHEMA_VERSION {
        return Err(in_database(
            path,
            Error::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            },
        ));
    }
    Ok(conn)
}

/// [`open_existing`], refusing a database at an older schema version too:
/// the checks of `idem verify` are written for the current schema.
#[cfg(any(feature = "cli", feature = "internals"))]
pub fn open_current(path: &Path) -> Result<Connection> {
    let conn = open_existing(path)?;
    let found = migrations::version(&conn)?;
    if found < SCHEMA_VERSION {
        return Err(Error::Other(format!(
            "database {} is at schema version {found}, older than this idem's {SCHEMA_VERSION}; \
             run `idem migrate --db {}` first (back it up with `idem backup` before, if you like)",
            path.display(),
            path.display()
        )));
    }
    Ok(conn)
}

/// Checks, before anything is created, that `path` can be a database here:
/// its directory exists and is writable (SQLite creates `-wal` and `-shm`
/// files beside it, and the server a `.lock` file), and it is not a
/// directory. The errors say which path is wrong and what to do, instead of
/// a bare "No such file or directory".
pub fn preflight(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let fail = |why: String| {
        Err(Error::Other(format!(
            "cannot open database {}: {why}",
            path.display()
        )))
    };
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return fail(format!(
                "the directory {} does not exist; create it (mkdir -p {}) or pass another --db",
                dir.display(),
                dir.display()
            ))
        }
        Err(e) => return fail(format!("cannot reach the directory {}: {e}", dir.display())),
        Ok(m) if !m.is_dir() => return fail(format!("{} is not a directory", dir.display())),
        Ok(_) => {}
    }
    if path.is_dir() {
        return fail("it is a directory; pass the path of a database file".into());
    }
    if !writable(dir) {
        return fail(format!(
            "the directory {} is not writable by this user (idem keeps the database, its -wal \
             and -shm files and a .lock file there); fix its permissions or pass another --db",
            dir.display()
        ));
    }
    Ok(())
}

/// Whether this process may create files in `dir` (access(2), which also
/// says no on a read-only file system).
fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

/// An SQLite error met while opening `path`, with the path and a hint.
fn cannot_open(path: &Path, e: rusqlite::Error) -> Error {
    let hint = match e.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => {
            "it is not an SQLite database; pass the path of an idem database, or a new path \
             to create one"
        }
        Some(ErrorCode::CannotOpen) => {
            "check that the file and its directory exist and are readable and writable"
        }
        Some(ErrorCode::ReadOnly) | Some(ErrorCode::PermissionDenied) => {
            "the file or its directory is read-only for this user"
        }
        Some(ErrorCode::DatabaseCorrupt) => "the file is damaged; restore it from a backup",
        _ => "",
    };
    let sep = if hint.is_empty() { "" } else { "; " };
    Error::Other(format!(
        "cannot open database {}: {e}{sep}{hint}",
        path.display()
    ))
}

/// An error about the database at `path`, named.
fn in_database(path: &Path, e: Error) -> Error {
    match e {
        Error::SchemaTooNew { found, supported } => Error::Other(format!(
            "database {} has schema version {found}, newer than this idem's {supported}; \
             run the idem release that wrote it (or a newer one), or restore a backup taken \
             before the upgrade",
            path.display()
        )),
        Error::Db(e) => cannot_open(path, e),
        Error::Other(why) => Error::Other(format!("database {}: {why}", path.display())),
        other => other,
    }
}

/// Held for as long as a server runs: a second `idem serve` on the same
/// database fails at start instead of fighting over the write lock.
///
/// It is a separate file because SQLite's own POSIX locks on the database are
/// dropped when any descriptor of that file is closed by the process.
#[derive(Debug)]
pub struct ProcessLock {
    _file: File,
}

impl ProcessLock {
    pub fn acquire(db: &Path) -> Result<ProcessLock> {
        let mut path = db.as_os_str().to_owned();
        path.push(".lock");
        let path = PathBuf::from(path);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::Other(format!("cannot create {}: {e}", path.display())))?;
        match file.try_lock() {
            Ok(()) => Ok(ProcessLock { _file: file }),
            Err(std::fs::TryLockError::WouldBlock) => Err(Error::Locked(format!(
                "database {} is locked by another idem serve (lock file {})",
                db.display(),
                path.display()
            ))),
            Err(std::fs::TryLockError::Error(e)) => Err(Error::Locked(format!(
                "cannot lock {}: {e}",
                path.display()
            ))),
        }
    }
}

/// The database a running server writes and reads, whichever engine it is:
/// the one seam between the application and its storage.
///
/// - SQLite: writes queue for the single writer thread, which runs them in
///   savepoints of one group-commit transaction; reads go to the pool of
///   read-only connections.
/// - PostgreSQL: each write runs in its own serializable transaction on the
///   calling thread (retried when it loses a race; see `postgres.rs`), each
///   read on one read-only snapshot; any number of servers may share the
///   database.
///
/// A write command may run more than once on PostgreSQL, so it must act only
/// on the database (`FnMut`, no other side effect).
pub enum Store {
    /// An SQLite file, held by this process alone.
    Sqlite {
        /// The single writer thread.
        writer: Writer,
        /// The read-only connections.
        readers: Readers,
    },
    /// A PostgreSQL database, shared by any number of servers.
    Postgres {
        /// The connection pool.
        pg: PgStore,
        /// Receives a message after a commit of this process (see
        /// [`Store::commits`]); the sender side.
        commit_tx: crossbeam_channel::Sender<()>,
        /// The receiver side handed to watchers.
        committed: crossbeam_channel::Receiver<()>,
    },
}

impl Store {
    /// A PostgreSQL store on `pg`.
    pub fn postgres(pg: PgStore) -> Store {
        let (commit_tx, committed) = crossbeam_channel::bounded(1);
        Store::Postgres {
            pg,
            commit_tx,
            committed,
        }
    }

    /// Whether other servers may share this database (PostgreSQL): work
    /// that one process may do at a time is then leased in the database,
    /// not only in memory.
    pub fn shared(&self) -> bool {
        matches!(self, Store::Postgres { .. })
    }

    /// Runs `f` in a write transaction and returns once it committed.
    pub fn write<T, F>(&self, mut f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&dyn Db) -> Result<T> + Send + 'static,
    {
        match self {
            Store::Sqlite { writer, .. } => writer.call(move |conn| f(conn)),
            Store::Postgres { pg, commit_tx, .. } => {
                let done = pg.write(f)?;
                let _ = commit_tx.try_send(());
                Ok(done)
            }
        }
    }

    /// [`Store::write`] whose commit wakes no [`Store::commits`] watcher on
    /// PostgreSQL: for a watcher's own writes. The webhook dispatcher claims
    /// due deliveries in a write; heard, that commit woke it to claim again
    /// at once, a loop of thousands of transactions a second on an idle
    /// server. On SQLite it is [`Store::write`] (the writer's commit may
    /// hold others' commands, and is heard as theirs).
    pub fn write_unheard<T, F>(&self, mut f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&dyn Db) -> Result<T> + Send + 'static,
    {
        match self {
            Store::Sqlite { writer, .. } => writer.call(move |conn| f(conn)),
            Store::Postgres { pg, .. } => pg.write(f),
        }
    }

    /// Runs `f` on one consistent read-only view.
    pub fn read<T>(&self, f: impl FnOnce(&dyn Db) -> Result<T>) -> Result<T> {
        match self {
            Store::Sqlite { readers, .. } => readers.read(|conn| f(conn)),
            Store::Postgres { pg, .. } => pg.read(f),
        }
    }

    /// A channel that receives a message after a commit of this process
    /// (one waiting message stands for all commits since it was last
    /// taken). On PostgreSQL other nodes' commits are not heard: whoever
    /// waits on it must also poll.
    pub fn commits(&self) -> crossbeam_channel::Receiver<()> {
        match self {
            Store::Sqlite { writer, .. } => writer.commits(),
            Store::Postgres { committed, .. } => committed.clone(),
        }
    }

    /// Stops the writer thread (SQLite: after applying what is queued, and
    /// a checkpoint). Nothing to stop on PostgreSQL.
    pub fn stop(&self) {
        if let Store::Sqlite { writer, .. } = self {
            writer.stop();
        }
    }
}

/// Runs `f` on the database `db` (a file or a PostgreSQL URL), read-only:
/// for tests that look at rows on either backend.
#[cfg(feature = "internals")]
pub fn inspect<T>(db: &Path, f: impl FnOnce(&dyn Db) -> Result<T>) -> Result<T> {
    if let Some(url) = postgres_url(db) {
        return PgStore::open(url, 1)?.read(f);
    }
    let conn = Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(|e| cannot_open(db, e))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    f(&conn)
}

/// The database as the admin commands (`idem consumers`, `keys`, `verify`,
/// `migrate`) open it: one connection of their own beside any running
/// server, on either backend.
#[cfg(any(feature = "cli", feature = "internals"))]
pub enum Admin {
    /// An SQLite file (its own read-write connection).
    Sqlite(Connection),
    /// A PostgreSQL database (a pool of one).
    Postgres(PgStore),
}

#[cfg(any(feature = "cli", feature = "internals"))]
impl Admin {
    /// Opens `db` for a command that may create it: an SQLite file is
    /// created and migrated ([`open_rw`]); a PostgreSQL database (which must
    /// exist) gets the schema if it is empty.
    pub fn create(db: &Path) -> Result<Admin> {
        match postgres_url(db) {
            Some(url) => {
                let pg = PgStore::open(url, 1)?;
                pg.migrate()?;
                Ok(Admin::Postgres(pg))
            }
            None => Ok(Admin::Sqlite(open_rw(db, crate::config::Synchronous::Full, None)?)),
        }
    }

    /// Opens an existing database at the current schema version ([`open_current`]).
    pub fn current(db: &Path) -> Result<Admin> {
        match postgres_url(db) {
            Some(url) => {
                let pg = PgStore::open(url, 1)?;
                let found = pg.version()?;
                if found != SCHEMA_VERSION {
                    return Err(Error::Other(format!(
                        "the PostgreSQL database is at schema version {found}, not this idem's \
                         {SCHEMA_VERSION}{}",
                        if found == 0 {
                            " (it has no idem schema: `idem serve` or `idem migrate` creates \
                             one in an empty database)"
                        } else {
                            ""
                        }
                    )));
                }
                Ok(Admin::Postgres(pg))
            }
            None => Ok(Admin::Sqlite(open_current(db)?)),
        }
    }

    /// Runs `f` in one write transaction (SQLite: `BEGIN IMMEDIATE`, so it
    /// sees rows as a running server's writer will; PostgreSQL:
    /// serializable, run again if it loses a race).
    pub fn write<T>(&mut self, mut f: impl FnMut(&dyn Db) -> Result<T>) -> Result<T> {
        match self {
            Admin::Sqlite(conn) => {
                let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let done = f(&*tx)?;
                tx.commit()?;
                Ok(done)
            }
            Admin::Postgres(pg) => pg.write(f),
        }
    }

    /// Runs `f` on one consistent read-only view.
    pub fn read<T>(&mut self, f: impl FnOnce(&dyn Db) -> Result<T>) -> Result<T> {
        match self {
            Admin::Sqlite(conn) => {
                let tx = conn.transaction()?;
                let done = f(&*tx)?;
                tx.commit()?;
                Ok(done)
            }
            Admin::Postgres(pg) => pg.read(f),
        }
    }
}
