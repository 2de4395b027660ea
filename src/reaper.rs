//! The reaper thread: every `--reaper-interval` it drives orphans (keys whose
//! owner has been silent past `--inflight-timeout`) to completion from their
//! recovery point, so the ledger converges even if no client retries; voids
//! and releases holds past `--authorization-ttl`; and deletes completed keys
//! past `--key-retention` and events past `--event-retention` in small
//! batches, each its own short write transaction.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::app::App;
use crate::config::{
    REAPER_DELETE_BATCH_LEN, REAPER_EXPIRIES_PER_PASS_MAX, REAPER_ORPHANS_PER_PASS_MAX,
};

pub struct Reaper {
    stop: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Reaper {
    pub fn start(app: Arc<App>) -> Reaper {
        let (stop, stopped) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name("idem-reaper".into())
            .spawn(move || run(&app, &stopped))
            .expect("spawn reaper thread");
        Reaper {
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = self.stop.send(());
            let _ = thread.join();
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(app: &App, stopped: &Receiver<()>) {
    loop {
        match stopped.recv_timeout(app.config.reaper_interval) {
            Err(RecvTimeoutError::Timeout) => pass(app),
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// One pass: orphans first (they hold money in flight), then expired holds,
/// then retention.
pub fn pass(app: &App) {
    let _one_at_a_time = app.reaper_pass();
    match app.orphans(REAPER_ORPHANS_PER_PASS_MAX) {
        Ok(ids) => {
            for id in ids {
                if let Err(e) = app.complete_orphan(id) {
                    log::warn!("reaper: orphan {id}: {e}");
                }
            }
        }
        Err(e) => log::warn!("reaper: cannot list orphans: {e}"),
    }
    if let Err(e) = app.expire_holds(REAPER_EXPIRIES_PER_PASS_MAX) {
        log::warn!("reaper: cannot expire holds: {e}");
    }
    loop {
        match app.delete_expired(REAPER_DELETE_BATCH_LEN) {
            Ok(n) if n == REAPER_DELETE_BATCH_LEN => continue,
            Ok(_) => break,
            Err(e) => {
                log::warn!("reaper: cannot delete expired keys: {e}");
                break;
            }
        }
    }
    loop {
        match app.delete_expired_events(REAPER_DELETE_BATCH_LEN) {
            Ok(n) if n == REAPER_DELETE_BATCH_LEN => continue,
            Ok(_) => break,
            Err(e) => {
                log::warn!("reaper: cannot delete expired events: {e}");
                break;
            }
        }
    }
}
