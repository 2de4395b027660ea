//! Opening the database: pragmas, the schema and its migrations, the process
//! lock; and the two ways in: the single writer thread ([`Writer`]) and the
//! pool of read-only connections ([`Readers`]).

mod readers;
mod writer;

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use crate::config::{Synchronous, BUSY_TIMEOUT, WAL_SIZE_LIMIT_BYTES};
use crate::error::{Error, Result};

pub use readers::Readers;
pub use writer::Writer;

/// The schema, embedded at build time.
pub const SCHEMA_SQL: &str = include_str!("../../schema.sql");
/// The `PRAGMA user_version` this build writes and understands.
pub const SCHEMA_VERSION: i64 = 1;

/// Opens (creating if needed) a read-write connection with the pragmas every
/// writing connection needs, and brings the schema up to date.
pub fn open_rw(path: &Path, synchronous: Synchronous) -> Result<Connection> {
    let mut conn = Connection::open(path)
        .map_err(|e| Error::Other(format!("cannot open database {}: {e}", path.display())))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
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
    conn.pragma_update(None, "foreign_keys", "ON")?;
    migrate(&mut conn)?;
    Ok(conn)
}

/// Opens an existing database read-write without creating it (for `verify`).
pub fn open_existing(path: &Path) -> Result<Connection> {
    if !path.exists() {
        return Err(Error::Other(format!("no database at {}", path.display())));
    }
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE)
        .map_err(|e| Error::Other(format!("cannot open database {}: {e}", path.display())))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    check_version(&conn)?;
    Ok(conn)
}

fn check_version(conn: &Connection) -> Result<i64> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(Error::SchemaTooNew {
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    Ok(version)
}

/// Applies the schema in one IMMEDIATE transaction when the database is new;
/// refuses a database written by a newer idem.
pub fn migrate(conn: &mut Connection) -> Result<()> {
    if check_version(conn)? == SCHEMA_VERSION {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    // Re-read under the write lock: another process may have migrated.
    if check_version(&tx)? == 0 {
        tx.execute_batch(SCHEMA_SQL)?;
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    }
    tx.commit()?;
    Ok(())
}

/// Held for as long as a server runs: a second `idem serve` on the same
/// database fails at start instead of fighting over the write lock.
///
/// It is a separate file because SQLite's own POSIX locks on the database are
/// dropped when any descriptor of that file is closed by the process.
#[derive(Debug)]
pub struct ProcessLock {
    _file: File,
    path: PathBuf,
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
            Ok(()) => Ok(ProcessLock { _file: file, path }),
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

    pub fn path(&self) -> &Path {
        &self.path
    }
}
