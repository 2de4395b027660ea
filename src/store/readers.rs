//! The pool of read-only connections: GETs, replays, authentication and the
//! pre-checks of a charge read here and never queue behind the writer.

use std::path::Path;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{Connection, OpenFlags};

use crate::config::BUSY_TIMEOUT;
use crate::error::Result;

#[derive(Clone)]
pub struct Readers {
    pool: r2d2::Pool<SqliteConnectionManager>,
}

impl Readers {
    pub fn open(path: &Path, size: usize) -> Result<Readers> {
        let manager = SqliteConnectionManager::file(path)
            .with_flags(OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
            .with_init(|c| {
                // Per connection, once: nothing of this runs per request.
                c.busy_timeout(BUSY_TIMEOUT)?;
                c.pragma_update(None, "foreign_keys", "ON")?;
                c.set_prepared_statement_cache_capacity(64);
                Ok(())
            });
        let pool = r2d2::Pool::builder()
            .max_size(size as u32)
            .min_idle(Some(1))
            .build(manager)?;
        Ok(Readers { pool })
    }

    /// Runs `f` on a pooled read-only connection (one snapshot if `f` opens a
    /// transaction; each statement is its own snapshot otherwise).
    pub fn read<T>(&self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let conn = self.pool.get()?;
        f(&conn)
    }
}
