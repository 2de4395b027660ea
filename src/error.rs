//! The crate's one error type: failures of the machinery (database, I/O,
//! configuration), never business outcomes, which are values of their own.

use std::fmt;

/// What went wrong in the machinery: the database, I/O, the configuration.
/// A business outcome (a decline, insufficient funds) is never an `Error`.
#[derive(Debug)]
pub enum Error {
    /// SQLite answered with an error.
    Db(rusqlite::Error),
    /// PostgreSQL answered with an error, or the connection to it failed.
    Postgres(postgres::Error),
    /// The reader pool could not hand out a connection.
    Pool(String),
    /// A file or socket operation failed.
    Io(std::io::Error),
    /// The writer thread is gone or its queue is full: retry later.
    Unavailable(&'static str),
    /// A write transaction failed as a whole (its commit, or a failure that
    /// rolled it back); carried as text to every command of the batch.
    Storage(String),
    /// The acquirer did not answer.
    Acquirer(String),
    /// The database was written by a newer idem.
    SchemaTooNew {
        /// The database's schema version.
        found: i64,
        /// The newest this build knows.
        supported: i64,
    },
    /// Another `idem serve` holds the database.
    Locked(String),
    /// A configuration the program cannot run with (exit 1).
    Config(String),
    /// A command line that makes no sense (exit 2, like a parse error),
    /// or a configuration whose settings contradict each other.
    Usage(String),
    /// Anything else, with a one-line reason.
    Other(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A failure that may pass on its own (busy database, full disk, full
    /// queue): the request is answered 503 and the key unlocked.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Db(_)
            | Error::Postgres(_)
            | Error::Pool(_)
            | Error::Io(_)
            | Error::Unavailable(_)
            | Error::Storage(_)
            | Error::Acquirer(_) => true,
            Error::SchemaTooNew { .. }
            | Error::Locked(_)
            | Error::Config(_)
            | Error::Usage(_)
            | Error::Other(_) => false,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Db(e) => write!(f, "database error: {e}"),
            // The client's own text of a server error is only "db error":
            // name what the server said, and its SQLSTATE.
            Error::Postgres(e) => match e.as_db_error() {
                Some(db) => write!(
                    f,
                    "PostgreSQL error: {} (SQLSTATE {})",
                    db.message(),
                    db.code().code()
                ),
                None => write!(f, "PostgreSQL error: {e}"),
            },
            Error::Pool(e) => write!(f, "database pool error: {e}"),
            Error::Io(e) => write!(f, "i/o error: {e}"),
            Error::Unavailable(why) => write!(f, "temporarily unavailable: {why}"),
            Error::Storage(why) => write!(f, "write transaction failed: {why}"),
            Error::Acquirer(why) => write!(f, "acquirer unavailable: {why}"),
            Error::SchemaTooNew { found, supported } => write!(
                f,
                "database schema version {found} is newer than this idem supports ({supported}); \
                 upgrade idem"
            ),
            Error::Locked(why) => f.write_str(why),
            Error::Config(why) | Error::Usage(why) => f.write_str(why),
            Error::Other(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Db(e) => Some(e),
            Error::Postgres(e) => Some(e),
            Error::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Error {
        Error::Db(e)
    }
}

impl From<postgres::Error> for Error {
    fn from(e: postgres::Error) -> Error {
        Error::Postgres(e)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::Io(e)
    }
}

impl From<r2d2::Error> for Error {
    fn from(e: r2d2::Error) -> Error {
        Error::Pool(e.to_string())
    }
}
