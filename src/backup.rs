//! `idem backup OUT`: a consistent copy of a live database through SQLite's
//! online backup API, safe beside a running `idem serve`.
//!
//! The copy is taken in one `sqlite3_backup_step(-1)`: one read transaction,
//! so one snapshot. In WAL mode a reader never blocks the writer, so the
//! server keeps committing while the pages are copied, and the backup never
//! restarts because of those commits (a step-by-step copy would). The pages
//! go to `OUT.partial`, which is synced and then renamed to `OUT`: a crash or
//! a full disk leaves no half-written file under the final name.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::backup::{Backup, StepResult};
use rusqlite::Connection;

use crate::error::{Error, Result};
use crate::store;
use crate::verify::{self, Report};

/// How long the copy waits for a lock it cannot take (a checkpoint that
/// truncates the WAL, another process's exclusive lock) before giving up.
pub const BACKUP_BUSY_MAX: Duration = Duration::from_secs(30);

/// What a finished backup wrote.
#[derive(Debug)]
pub struct Summary {
    pub pages: i32,
    pub bytes: u64,
    /// `idem verify` run on the copy.
    pub report: Report,
}

/// Copies the database at `db` to `out`, which must not exist, and verifies
/// the copy.
pub fn backup(db: &Path, out: &Path) -> Result<Summary> {
    if out.exists() {
        return Err(Error::Other(format!(
            "{} already exists; refusing to overwrite it",
            out.display()
        )));
    }
    let source = store::open_existing(db)?;
    let partial = partial_path(out);
    let _ = std::fs::remove_file(&partial);
    let pages = copy(&source, &partial).inspect_err(|_| {
        let _ = std::fs::remove_file(&partial);
    })?;
    // The copy is complete and closed: make it durable, then give it its name.
    std::fs::File::open(&partial)?.sync_all()?;
    std::fs::rename(&partial, out)?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    let bytes = std::fs::metadata(out)?.len();
    let report = verify::verify(&store::open_existing(out)?)?;
    Ok(Summary {
        pages,
        bytes,
        report,
    })
}

fn copy(source: &Connection, partial: &Path) -> Result<i32> {
    let mut target = Connection::open(partial)
        .map_err(|e| Error::Other(format!("cannot create {}: {e}", partial.display())))?;
    let started = Instant::now();
    let pages = {
        let backup = Backup::new(source, &mut target)?;
        loop {
            match backup.step(-1)? {
                StepResult::Done => break,
                StepResult::More => {}
                _busy_or_locked => {
                    if started.elapsed() > BACKUP_BUSY_MAX {
                        return Err(Error::Unavailable("the database stayed locked"));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        backup.progress().pagecount
    };
    // The source is in WAL mode and the copy inherits it; fold the copy's own
    // WAL back so that OUT is one self-contained file.
    target.execute_batch("PRAGMA journal_mode = DELETE")?;
    target.close().map_err(|(_, e)| Error::Db(e))?;
    Ok(pages)
}

fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}
