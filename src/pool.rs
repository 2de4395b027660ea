//! Bounded thread pools for work that must not hold an HTTP worker: each task
//! gets a [`Deliver`] and hands its reply to it when done.
//!
//! The application runs two: the reservation pool (one write command each:
//! reserve a key, or create an account without one) and the operation pool
//! (an owned operation's long part: pre-check, acquirer, recovery point,
//! ledger phase). Two pools, so that 64 charges waiting for a slow acquirer
//! never delay the reservation — and so the 202 or the 409 — of the next
//! request.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use crate::api::{Deliver, Problem};

/// A unit of work: computes a reply and hands it to its `Deliver`.
pub type Task = Box<dyn FnOnce(Deliver) + Send>;

enum Msg {
    Run(Task, Deliver),
    Stop,
}

pub struct Pool {
    name: &'static str,
    tx: Sender<Msg>,
    rx: Receiver<Msg>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    stopping: AtomicBool,
}

impl Pool {
    pub fn start(name: &'static str, threads: usize, queue_len: usize) -> Pool {
        let (tx, rx) = crossbeam_channel::bounded(queue_len);
        let handles = (0..threads)
            .map(|i| {
                let rx: Receiver<Msg> = rx.clone();
                std::thread::Builder::new()
                    .name(format!("idem-{name}-{i}"))
                    .spawn(move || run(name, &rx))
                    .expect("spawn pool thread")
            })
            .collect();
        Pool {
            name,
            tx,
            rx,
            threads: Mutex::new(handles),
            stopping: AtomicBool::new(false),
        }
    }

    /// Queues `task`. A full queue or a stopping pool hands `deliver` back,
    /// unused, so the caller can answer (and undo what it must).
    pub fn submit(&self, task: Task, deliver: Deliver) -> Result<(), Deliver> {
        if self.stopping.load(Ordering::Acquire) {
            return Err(deliver);
        }
        self.tx
            .try_send(Msg::Run(task, deliver))
            .map_err(|e| match e.into_inner() {
                Msg::Run(_, deliver) => deliver,
                Msg::Stop => unreachable!("submit sends only tasks"),
            })
    }

    /// Runs what is queued, stops the threads, and answers 503 to whatever
    /// slipped in after the stop (nothing waits forever on a stopped pool).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        let threads = std::mem::take(&mut *self.threads.lock().expect("pool lock"));
        for _ in &threads {
            let _ = self.tx.send(Msg::Stop);
        }
        for thread in threads {
            let _ = thread.join();
        }
        while let Ok(msg) = self.rx.try_recv() {
            if let Msg::Run(_, deliver) = msg {
                deliver(Problem::TemporarilyUnavailable("shutting down".into()).reply());
            }
        }
        log::debug!("{} pool stopped", self.name);
    }
}

fn run(name: &str, rx: &Receiver<Msg>) {
    while let Ok(Msg::Run(task, deliver)) = rx.recv() {
        // A panic drops `deliver` (the client gets a 500) and must not take
        // the thread with it; operations unlock their keys themselves.
        if catch_unwind(AssertUnwindSafe(|| task(deliver))).is_err() {
            log::error!("a task of the {name} pool panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Reply;
    use std::time::Duration;

    fn deliver_to(tx: crossbeam_channel::Sender<u16>) -> Deliver {
        Box::new(move |reply: Reply| {
            let _ = tx.send(reply.status);
        })
    }

    /// A panicking task costs its reply (dropped, so its waiter sees the
    /// sender gone), never its thread: after more panics than threads the
    /// pool still runs tasks.
    #[test]
    fn threads_survive_panicking_tasks() {
        let pool = Pool::start("test", 2, 16);
        let (tx, rx) = crossbeam_channel::unbounded();
        for _ in 0..6 {
            let boom: Task = Box::new(|_| panic!("test: a bug in a task"));
            assert!(pool.submit(boom, deliver_to(tx.clone())).is_ok());
        }
        for status in [200, 201, 202] {
            let fine: Task = Box::new(move |d| d(Reply::raw(status, "text/plain", vec![])));
            assert!(pool.submit(fine, deliver_to(tx.clone())).is_ok());
        }
        let mut got: Vec<u16> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).expect("a reply"))
            .collect();
        got.sort_unstable();
        assert_eq!(got, vec![200, 201, 202]);
        pool.stop();
        assert!(rx.try_recv().is_err(), "a panicked task delivered nothing");
    }

    #[test]
    fn a_full_queue_hands_deliver_back_and_stop_answers_leftovers() {
        let pool = Pool::start("test", 1, 1);
        let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(0);
        let (tx, rx) = crossbeam_channel::unbounded();
        // Occupy the only thread (known to have started, not guessed with a
        // sleep), then fill the one queue slot.
        let (started_tx, started_rx) = crossbeam_channel::bounded::<()>(1);
        let blocker: Task = Box::new(move |d| {
            let _ = started_tx.send(());
            let _ = gate_rx.recv();
            d(Reply::raw(200, "text/plain", vec![]));
        });
        assert!(pool.submit(blocker, deliver_to(tx.clone())).is_ok());
        started_rx.recv().expect("the blocker started");
        let queued: Task = Box::new(|d| d(Reply::raw(201, "text/plain", vec![])));
        assert!(pool.submit(queued, deliver_to(tx.clone())).is_ok());
        let refused: Task = Box::new(|d| d(Reply::raw(202, "text/plain", vec![])));
        let back = pool.submit(refused, deliver_to(tx.clone()));
        assert!(back.is_err(), "the queue is full");
        gate_tx.send(()).unwrap();
        pool.stop();
        let mut got: Vec<u16> = rx.try_iter().collect();
        got.sort_unstable();
        assert_eq!(got, vec![200, 201], "queued work runs before the stop");
        let late: Task = Box::new(|d| d(Reply::raw(203, "text/plain", vec![])));
        assert!(
            pool.submit(late, deliver_to(tx)).is_err(),
            "a stopped pool refuses"
        );
    }
}
