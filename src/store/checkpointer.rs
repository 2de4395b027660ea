//! The checkpointer thread: copies the WAL back into the database file off
//! the writer's thread.
//!
//! By default SQLite checkpoints inside the commit that takes the WAL past
//! 1000 pages, on the committing connection: the writer thread, which then
//! copies about 4 MiB into the database file and fsyncs it (under
//! `synchronous=FULL`) while every queued command waits. Under load that
//! happened several times a second, each a stall of milliseconds that showed
//! as the tail of every latency. Here the writer's own automatic checkpoint
//! is only a backstop ([`WAL_AUTOCHECKPOINT_BACKSTOP_PAGES`], for a
//! checkpointer that cannot keep up), and this thread, on its own
//! connection, runs a `PASSIVE` checkpoint after commits, at most once per
//! [`CHECKPOINT_PAUSE`]. A passive checkpoint takes no lock the writer
//! waits for: it copies the frames no reader still needs, and the writer
//! starts the WAL over at its next transaction once all are copied.
//!
//! Durability does not change: a commit is durable in the WAL when it is
//! acknowledged, whoever copies it later, and a crash in the middle of a
//! checkpoint is recovered by SQLite like any other.

use std::path::Path;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use rusqlite::Connection;

use crate::config::BUSY_TIMEOUT;

/// Least time between two checkpoints: pages rewritten by many batches in
/// between (an account's row, the upper levels of every index) are copied
/// once, not once per commit.
pub const CHECKPOINT_PAUSE: Duration = Duration::from_millis(100);
/// The writer's own automatic checkpoint, in WAL pages (64 MiB of 4 KiB
/// pages): reached only if this thread falls behind or has stopped.
pub const WAL_AUTOCHECKPOINT_BACKSTOP_PAGES: i64 = 16_384;

/// Handle to the checkpointer thread; the writer [`nudge`](Self::nudge)s it
/// after each commit.
pub struct Checkpointer {
    nudge: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Opens a connection to `path` and starts the thread, or says why not
    /// (the writer then keeps checkpointing itself).
    pub fn start(path: &Path) -> rusqlite::Result<Checkpointer> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        let (nudge, nudged) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name("idem-checkpoint".into())
            .spawn(move || run(&conn, &nudged))
            .expect("spawn checkpointer thread");
        Ok(Checkpointer {
            nudge,
            thread: Some(thread),
        })
    }

    /// Tells the thread that a commit added to the WAL. Never blocks: one
    /// pending nudge stands for any number of commits.
    pub fn nudge(&self) {
        match self.nudge.try_send(()) {
            Ok(()) | Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => {}
        }
    }

    /// Stops the thread after the checkpoint it is running, if any.
    pub fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        // Dropping the only sender wakes the thread with `Disconnected`.
        let (closed, _) = crossbeam_channel::bounded(1);
        drop(std::mem::replace(&mut self.nudge, closed));
        let _ = thread.join();
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(conn: &Connection, nudged: &Receiver<()>) {
    // `Disconnected`: the writer has stopped.
    while nudged.recv().is_ok() {
        checkpoint(conn);
        // Commits during the pause leave one nudge behind: the next
        // checkpoint covers all of them.
        std::thread::sleep(CHECKPOINT_PAUSE);
    }
}

/// One passive checkpoint; a failure is logged and the next nudge tries
/// again (the writer's backstop bounds the WAL meanwhile).
fn checkpoint(conn: &Connection) {
    let done = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
        Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
    });
    match done {
        Ok((busy, log, copied)) => {
            log::trace!("checkpoint: busy={busy} wal={log} copied={copied}");
        }
        Err(e) => log::warn!("checkpoint failed: {e}"),
    }
}
