//! The writer thread: the only read-write connection of a running server.
//!
//! Write commands arrive over a bounded channel. The thread takes every
//! command already queued (up to `commit_batch_max`), runs them in ONE
//! `BEGIN IMMEDIATE` transaction with one SAVEPOINT each — a command that
//! fails rolls back alone and gets its own error — commits once, and only then
//! answers all of them: no answer leaves before its commit is durable. A lone
//! command commits at once; nothing waits for a batch to fill.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use rusqlite::Connection;

use crate::config::WRITE_QUEUE_LEN_MAX;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// Prepared statements the writer's connection keeps: more than every
/// distinct statement its commands run (about 90 call sites), so none is
/// prepared twice.
const WRITER_STATEMENT_CACHE: usize = 256;

/// A command for the writer: `run` inside its savepoint, then `finish` with
/// the fate of the whole transaction.
trait Job: Send {
    /// Runs the command; false means it failed and its savepoint rolls back.
    fn run(&mut self, conn: &Connection) -> bool;
    /// Answers the caller: its own result if the batch committed, the batch's
    /// error otherwise.
    fn finish(self: Box<Self>, batch: std::result::Result<(), String>);
}

struct Call<T, F> {
    f: Option<F>,
    result: Option<Result<T>>,
    reply: Sender<Result<T>>,
}

impl<T, F> Job for Call<T, F>
where
    T: Send,
    F: FnOnce(&Connection) -> Result<T> + Send,
{
    fn run(&mut self, conn: &Connection) -> bool {
        let f = self.f.take().expect("a job runs once");
        let result = catch_unwind(AssertUnwindSafe(|| f(conn)))
            .unwrap_or_else(|_| Err(Error::Other("write command panicked".into())));
        let ok = result.is_ok();
        self.result = Some(result);
        ok
    }

    fn finish(self: Box<Self>, batch: std::result::Result<(), String>) {
        let answer = match (batch, self.result) {
            (Ok(()), Some(result)) => result,
            (Err(why), _) => Err(Error::Storage(why)),
            (Ok(()), None) => Err(Error::Storage("command was not run".into())),
        };
        // The caller may have given up (its connection closed): nothing to do.
        let _ = self.reply.send(answer);
    }
}

enum Msg {
    Job(Box<dyn Job>),
    Stop,
}

/// Handle to the writer thread.
pub struct Writer {
    tx: Sender<Msg>,
    /// Holds one message after a commit, until a watcher takes it.
    committed: Receiver<()>,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Writer {
    /// Starts the writer thread on `conn`, which must be the process's only
    /// read-write connection to the database.
    pub fn start(conn: Connection, commit_batch_max: usize, metrics: Arc<Metrics>) -> Writer {
        assert!(commit_batch_max >= 1);
        // Every command runs in its own savepoint, so SQLite copies each
        // page a command touches into the statement journal (to roll that
        // command back alone). That journal is only read to roll back a
        // savepoint inside the open transaction, never by crash recovery
        // (the WAL's), and it holds one command's pages at a time: releasing
        // the savepoint empties it. By default it spills to a temporary file
        // past 64 KiB, which a charge's ledger phase crosses, so every batch
        // created a file and wrote pages to it (a fifth of the writer's time
        // in a profile). Set here, not when the connection is opened: the
        // migrations and the startup check, which may sort or build
        // automatic indexes over whole tables, keep their temporary files.
        if let Err(e) = conn.pragma_update(None, "temp_store", "MEMORY") {
            log::warn!("writer: cannot keep the statement journal in memory: {e}");
        }
        // rusqlite's statement cache is an LRU of 16 by default. A charge
        // alone runs more distinct statements than that, in the same order
        // every time, which is the LRU's worst case: every statement missed
        // and was parsed and planned again (sqlite3_prepare) on every
        // command. Sized to hold every statement the writer runs.
        conn.set_prepared_statement_cache_capacity(WRITER_STATEMENT_CACHE);
        let (tx, rx) = crossbeam_channel::bounded(WRITE_QUEUE_LEN_MAX);
        let (commit_tx, committed) = crossbeam_channel::bounded(1);
        let watchers = Watchers { commit: commit_tx };
        let thread = std::thread::Builder::new()
            .name("idem-writer".into())
            .spawn(move || run(conn, rx, commit_batch_max, &metrics, watchers))
            .expect("spawn writer thread");
        Writer {
            tx,
            committed,
            thread: std::sync::Mutex::new(Some(thread)),
        }
    }

    /// Runs `f` in the writer's transaction and waits for the commit.
    /// `f` must not block: it holds the database's only write lock.
    pub fn call<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T> + Send + 'static,
    {
        let (reply, answer) = crossbeam_channel::bounded(1);
        let job = Box::new(Call {
            f: Some(f),
            result: None,
            reply,
        });
        match self.tx.try_send(Msg::Job(job)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(Error::Unavailable("write queue is full")),
            Err(TrySendError::Disconnected(_)) => {
                return Err(Error::Unavailable("writer has stopped"))
            }
        }
        answer
            .recv()
            .unwrap_or(Err(Error::Unavailable("writer has stopped")))
    }

    /// A channel that receives a message after a commit: one waiting
    /// message stands for every commit since it was last taken, and it
    /// disconnects when the writer stops. For a thread that acts on what
    /// commits make visible (the webhook dispatcher), instead of polling.
    pub fn commits(&self) -> Receiver<()> {
        self.committed.clone()
    }

    /// Applies what is queued, checkpoints the WAL and stops the thread.
    pub fn stop(&self) {
        let Some(thread) = self.thread.lock().expect("writer lock").take() else {
            return;
        };
        let _ = self.tx.send(Msg::Stop);
        let _ = thread.join();
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Who hears of each commit, without ever making the writer wait.
struct Watchers {
    commit: Sender<()>,
}

impl Watchers {
    fn committed(&self) {
        // Full: a message is already waiting, and it covers this commit.
        let _ = self.commit.try_send(());
    }
}

fn run(
    conn: Connection,
    rx: Receiver<Msg>,
    batch_max: usize,
    metrics: &Metrics,
    watchers: Watchers,
) {
    let mut stopping = false;
    while !stopping {
        let mut batch: Vec<Box<dyn Job>> = Vec::new();
        match rx.recv() {
            Ok(Msg::Job(job)) => batch.push(job),
            Ok(Msg::Stop) | Err(_) => break,
        }
        while batch.len() < batch_max {
            match rx.try_recv() {
                Ok(Msg::Job(job)) => batch.push(job),
                Ok(Msg::Stop) => {
                    stopping = true;
                    break;
                }
                Err(_) => break,
            }
        }
        let started = Instant::now();
        let outcome = apply_batch(&conn, &mut batch);
        metrics.commit_batch_size.observe(batch.len() as f64);
        metrics
            .commit_duration_seconds
            .observe(started.elapsed().as_secs_f64());
        match &outcome {
            Ok(()) => watchers.committed(),
            Err(why) => log::warn!("write batch of {} failed: {why}", batch.len()),
        }
        for job in batch {
            job.finish(outcome.clone());
        }
    }
    // Commands that raced with Stop still get an answer.
    while let Ok(Msg::Job(job)) = rx.try_recv() {
        job.finish(Err("server is shutting down".into()));
    }
    if let Err(e) = conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)") {
        log::warn!("final checkpoint failed: {e}");
    }
}

/// Runs one transaction-control statement through the statement cache, so
/// the hot path parses none of them.
fn control(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// One transaction for the whole batch, one savepoint per command.
fn apply_batch(conn: &Connection, batch: &mut [Box<dyn Job>]) -> std::result::Result<(), String> {
    control(conn, "BEGIN IMMEDIATE").map_err(|e| format!("begin: {e}"))?;
    for job in batch.iter_mut() {
        if let Err(e) = control(conn, "SAVEPOINT cmd") {
            rollback(conn);
            return Err(format!("savepoint: {e}"));
        }
        let ok = job.run(conn);
        // Some errors (SQLITE_FULL, SQLITE_IOERR, …) roll the whole
        // transaction back on their own; running the next command would then
        // autocommit it outside the batch, so the batch fails as a whole.
        if conn.is_autocommit() {
            return Err("the transaction was rolled back by the database".into());
        }
        let end = if ok {
            control(conn, "RELEASE cmd")
        } else {
            control(conn, "ROLLBACK TO cmd").and_then(|()| control(conn, "RELEASE cmd"))
        };
        if let Err(e) = end {
            rollback(conn);
            return Err(format!("savepoint end: {e}"));
        }
    }
    control(conn, "COMMIT").map_err(|e| {
        rollback(conn);
        format!("commit: {e}")
    })
}

fn rollback(conn: &Connection) {
    if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
}
