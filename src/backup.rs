//! `idem backup OUT`: a consistent copy of a live database through SQLite's
//! online backup API, safe beside a running `idem serve`.
//!
//! The copy is taken inside one read transaction on the source, so from one
//! snapshot. In WAL mode a reader never blocks the writer, so the server
//! keeps committing while the pages are copied, and the copy never restarts
//! because of those commits: the snapshot does not move between its steps
//! (`BACKUP_STEP_PAGES` pages each, so that a signal is answered between two
//! of them). The pages go to a file of this run's own
//! (`OUT.partial-<random>`), which is synced and then hard-linked to `OUT` —
//! a link, unlike a rename, fails if `OUT` appeared meanwhile — so a crash, a
//! full disk or a second backup running at the same time never leaves a
//! half-written or overwritten file under the final name.
//!
//! The run holds an exclusive lock (`flock`) on its partial file for as long
//! as it exists, and removes it on every way out, SIGINT and SIGTERM
//! included (the CLI turns them into [`Cancel::cancel`]). A partial file of
//! `OUT` that nobody holds locked was left by a run that was killed outright
//! (SIGKILL, a crash, a power cut): the next backup to `OUT` removes it. A
//! partial that is locked belongs to a backup still running, and is left
//! alone.

use std::fs::{File, OpenOptions, TryLockError};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rusqlite::backup::{Backup, StepResult};
use rusqlite::{Connection, ErrorCode, InterruptHandle};

use crate::config::{
    BACKUP_BUSY_MAX, BACKUP_BUSY_RETRY_DELAY, BACKUP_PARTIAL_CREATE_ATTEMPTS, BACKUP_STEP_PAGES,
};
use crate::error::{Error, Result};
use crate::store;
use crate::verify::{self, Report};

/// What a finished backup wrote.
#[derive(Debug)]
pub struct Summary {
    /// Pages copied (the source's size in pages at its snapshot).
    pub pages: i32,
    /// Size of `OUT` in bytes.
    pub bytes: u64,
    /// Partial files of `OUT` left by earlier runs that were killed, and
    /// removed by this one.
    pub stale_removed: Vec<PathBuf>,
    /// `idem verify` run on the copy.
    pub report: Report,
}

/// How a backup runs; the default is what `idem backup` does.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// A pause before each step of the copy, with the snapshot held and the
    /// partial file open. For tests only (`IDEM_BACKUP_STEP_DELAY`): it makes
    /// a small backup slow enough to be signalled or killed mid-copy, and to
    /// hold back the server's checkpoints meanwhile.
    pub step_delay: Duration,
}

/// Stops a running backup from another thread (the CLI's signal handler).
/// The backup notices between two steps of the copy, in a pause, or while
/// it verifies the copy, removes its partial file and fails with the reason.
#[derive(Default)]
pub struct Cancel {
    state: Mutex<CancelState>,
    wake: Condvar,
}

#[derive(Default)]
struct CancelState {
    reason: Option<String>,
    /// The connection verifying the copy, interrupted on cancel.
    verifying: Option<InterruptHandle>,
}

impl Cancel {
    /// Asks the backup to stop; `reason` (e.g. "SIGTERM") ends up in its
    /// error. The first reason wins.
    pub fn cancel(&self, reason: &str) {
        let mut state = self.lock();
        state.reason.get_or_insert_with(|| reason.to_string());
        if let Some(verifying) = &state.verifying {
            verifying.interrupt();
        }
        self.wake.notify_all();
    }

    /// Why the backup was asked to stop, if it was.
    pub fn reason(&self) -> Option<String> {
        self.lock().reason.clone()
    }

    fn lock(&self) -> MutexGuard<'_, CancelState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fails if the backup was asked to stop.
    fn check(&self) -> Result<()> {
        match self.reason() {
            Some(reason) => Err(Error::Other(format!("interrupted by {reason}"))),
            None => Ok(()),
        }
    }

    /// Sleeps for `pause`, or less if the backup is asked to stop meanwhile.
    fn sleep(&self, pause: Duration) {
        let state = self.lock();
        let _ = self
            .wake
            .wait_timeout_while(state, pause, |s| s.reason.is_none());
    }

    /// Interrupts `conn`'s statements on cancel, until `stop_interrupting`.
    fn interrupt_on_cancel(&self, conn: &Connection) {
        self.lock().verifying = Some(conn.get_interrupt_handle());
    }

    fn stop_interrupting(&self) {
        self.lock().verifying = None;
    }
}

/// Copies the database at `db` to `out`, which must not exist, and verifies
/// the copy. First removes the partial files of `out` that earlier, killed
/// runs left behind.
pub fn backup(db: &Path, out: &Path, options: &Options, cancel: &Cancel) -> Result<Summary> {
    if out.exists() {
        return Err(Error::Other(format!(
            "{} already exists; refusing to overwrite it",
            out.display()
        )));
    }
    let source = store::open_existing(db)?;
    let stale_removed = remove_stale_partials(out)?;
    let partial = Partial::create(out)?;
    let published = copy(&source, &partial.path, options, cancel).and_then(|pages| {
        cancel.check()?;
        publish(&partial.path, out).map(|()| pages)
    });
    let partial_path = partial.path.clone();
    drop(partial);
    let pages = match (published, cancel.reason()) {
        (Err(_), Some(reason)) => {
            return Err(Error::Other(format!(
                "backup interrupted by {reason}: removed its partial copy {}; {} was not written",
                partial_path.display(),
                out.display()
            )))
        }
        (published, _) => published?,
    };
    let bytes = std::fs::metadata(out)?.len();
    let report = verify_copy(out, cancel)?;
    Ok(Summary {
        pages,
        bytes,
        stale_removed,
        report,
    })
}

/// Runs `idem verify` on the published copy; a cancel interrupts it.
fn verify_copy(out: &Path, cancel: &Cancel) -> Result<Report> {
    let conn = store::open_existing(out)?;
    cancel.interrupt_on_cancel(&conn);
    let checked = verify::verify_unless(&conn, &|| cancel.reason().is_some());
    cancel.stop_interrupting();
    match (checked, cancel.reason()) {
        // A check that ran to its end stands, even if a signal came late.
        (Ok(report), _) => Ok(report),
        (Err(_), Some(reason)) => Err(Error::Other(format!(
            "verifying {} interrupted by {reason}; the copy is complete but unverified \
             (idem verify --db {} checks it)",
            out.display(),
            out.display()
        ))),
        (Err(e), None) => Err(e),
    }
}

/// The copy being written: `OUT.partial-<32 hex digits>`, locked by this
/// run for as long as it exists, and removed (with any file SQLite kept
/// beside it) when dropped — on success, on error and on cancel alike.
struct Partial {
    path: PathBuf,
    /// Holds the lock that tells other runs this file is not stale.
    _lock: File,
}

impl Partial {
    fn create(out: &Path) -> Result<Partial> {
        for _ in 0..BACKUP_PARTIAL_CREATE_ATTEMPTS {
            let path = partial_path(out);
            // Created here, exclusively: no other run can be writing this file.
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| Error::Other(format!("cannot create {}: {e}", path.display())))?;
            match file.try_lock() {
                Ok(()) => {}
                // A run cleaning up stale partials locked it first, and
                // removes it: take another name.
                Err(TryLockError::WouldBlock) => continue,
                Err(TryLockError::Error(e)) => {
                    let _ = std::fs::remove_file(&path);
                    return Err(Error::Other(format!("cannot lock {}: {e}", path.display())));
                }
            }
            // Such a run may also have locked, removed and released it
            // before this run's lock: then the name is gone.
            if is_same_file(&file, &path) {
                return Ok(Partial { path, _lock: file });
            }
        }
        Err(Error::Other(format!(
            "cannot create a partial copy of {}: its names kept being removed",
            out.display()
        )))
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        remove_partial(&self.path);
    }
}

/// Removes a partial file and the files SQLite may have left beside it.
fn remove_partial(path: &Path) {
    for suffix in ["-journal", "-wal", "-shm", ""] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        let _ = std::fs::remove_file(PathBuf::from(name));
    }
}

fn is_same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(open), Ok(named)) => open.dev() == named.dev() && open.ino() == named.ino(),
        _ => false,
    }
}

/// Removes every partial file of `out` that no running backup holds locked:
/// each was left by a run that was killed before it could clean up.
fn remove_stale_partials(out: &Path) -> Result<Vec<PathBuf>> {
    let (Some(dir), Some(name)) = (out.parent(), out.file_name()) else {
        return Ok(Vec::new());
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let mut prefix = name.to_owned();
    prefix.push(".partial-");
    let prefix = prefix.as_encoded_bytes();
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        // Creating the partial file will say what is wrong with `dir`.
        Err(_) => return Ok(removed),
    };
    for entry in entries {
        let entry = entry?;
        let file_name = entry.file_name();
        let Some(suffix) = file_name.as_encoded_bytes().strip_prefix(prefix) else {
            continue;
        };
        // Exactly what `partial_path` makes; SQLite's `-journal`, `-wal`
        // and `-shm` beside it go with their partial file.
        if suffix.len() != 32
            || !suffix
                .iter()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            continue;
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else {
            continue;
        };
        if file.try_lock().is_ok() {
            // Removed while locked, so no new run can take it meanwhile.
            remove_partial(&path);
            removed.push(path);
        }
    }
    Ok(removed)
}

fn copy(source: &Connection, partial: &Path, options: &Options, cancel: &Cancel) -> Result<i32> {
    let mut target = Connection::open(partial)
        .map_err(|e| Error::Other(format!("cannot open {}: {e}", partial.display())))?;
    begin_snapshot(source, cancel)?;
    let copied = copy_pages(source, &mut target, options, cancel);
    let _ = source.execute_batch("COMMIT");
    let pages = copied?;
    // The source is in WAL mode and the copy inherits it; fold the copy's own
    // WAL back so that OUT is one self-contained file.
    target.execute_batch("PRAGMA journal_mode = DELETE")?;
    target.close().map_err(|(_, e)| Error::Db(e))?;
    Ok(pages)
}

/// Opens the read transaction whose snapshot the whole copy is taken from,
/// waiting up to `BACKUP_BUSY_MAX` for a lock it cannot take.
fn begin_snapshot(source: &Connection, cancel: &Cancel) -> Result<()> {
    let started = Instant::now();
    loop {
        source.execute_batch("BEGIN")?;
        // BEGIN is deferred: the first read takes the snapshot.
        match source.query_row("SELECT count(*) FROM sqlite_schema", [], |_| Ok(())) {
            Ok(()) => return Ok(()),
            Err(e) if is_busy(&e) && started.elapsed() < BACKUP_BUSY_MAX => {
                let _ = source.execute_batch("ROLLBACK");
                cancel.check()?;
                std::thread::sleep(BACKUP_BUSY_RETRY_DELAY);
            }
            Err(e) => {
                let _ = source.execute_batch("ROLLBACK");
                return Err(e.into());
            }
        }
    }
}

fn copy_pages(
    source: &Connection,
    target: &mut Connection,
    options: &Options,
    cancel: &Cancel,
) -> Result<i32> {
    let started = Instant::now();
    let backup = Backup::new(source, target)?;
    loop {
        if !options.step_delay.is_zero() {
            cancel.sleep(options.step_delay);
        }
        cancel.check()?;
        match backup.step(BACKUP_STEP_PAGES)? {
            StepResult::Done => break,
            StepResult::More => {}
            _busy_or_locked => {
                if started.elapsed() > BACKUP_BUSY_MAX {
                    return Err(Error::Unavailable("the database stayed locked"));
                }
                std::thread::sleep(BACKUP_BUSY_RETRY_DELAY);
            }
        }
    }
    Ok(backup.progress().pagecount)
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
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
