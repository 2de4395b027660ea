//! `idem backup OUT`: a consistent copy of a live database through SQLite's
//! online backup API, safe beside a running `idem serve`.
//!
//! The copy is taken in one `sqlite3_backup_step(-1)`: one read transaction,
//! so one snapshot. In WAL mode a reader never blocks the writer, so the
//! server keeps committing while the pages are copied, and the backup never
//! restarts because of those commits (a step-by-step copy would). The pages
//! go to a file of this run's own (`OUT.partial-<random>`), which is synced
//! and then hard-linked to `OUT` — a link, unlike a rename, fails if `OUT`
//! appeared meanwhile — so a crash, a full disk or a second backup running at
//! the same time never leaves a half-written or overwritten file under the
//! final name.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::backup::{Backup, StepResult};
use rusqlite::Connection;

use crate::config::BACKUP_BUSY_MAX;
use crate::error::{Error, Result};
use crate::store;
use crate::verify::{self, Report};

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
    let published =
        copy(&source, &partial).and_then(|pages| publish(&partial, out).map(|()| pages));
    let _ = std::fs::remove_file(&partial);
    let pages = published?;
    let bytes = std::fs::metadata(out)?.len();
    let report = verify::verify(&store::open_existing(out)?)?;
    Ok(Summary {
        pages,
        bytes,
        report,
    })
}

fn copy(source: &Connection, partial: &Path) -> Result<i32> {
    // Created here, exclusively: no other run can be writing this file.
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(partial)
        .map_err(|e| Error::Other(format!("cannot create {}: {e}", partial.display())))?;
    let mut target = Connection::open(partial)
        .map_err(|e| Error::Other(format!("cannot open {}: {e}", partial.display())))?;
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

/// Makes the finished copy durable and gives it its name, unless `out`
/// exists by now.
fn publish(partial: &Path, out: &Path) -> Result<()> {
    std::fs::File::open(partial)?.sync_all()?;
    std::fs::hard_link(partial, out).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => Error::Other(format!(
            "{} appeared while the backup ran; refusing to overwrite it",
            out.display()
        )),
        _ => Error::Other(format!("cannot create {}: {e}", out.display())),
    })?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(format!(".partial-{}", uuid::Uuid::new_v4().simple()));
    PathBuf::from(name)
}
