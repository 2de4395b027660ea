//! The acquirer: the only work that leaves the process. A trait, so that an
//! embedding test can inject a slow or failing one, and the built-in
//! simulator.
//!
//! Every call carries an acquirer-side idempotency key derived from the
//! operation (its `op_id`), so the owner that takes a key over after a crash
//! gets the authorization the first owner got instead of a second one.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use uuid::Uuid;

/// An approved authorization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorization {
    pub id: String,
}

/// The acquirer could not answer (network, timeout, outage): a transient
/// failure, answered 503, after which the key resumes from its recovery point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

pub trait Acquirer: Send + Sync {
    /// Authorizes `amount` of `currency`. Calls with the same `key` return
    /// the same authorization.
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
    ) -> Result<Authorization, Unavailable>;

    /// Captures `amount` (at most what was authorised) of `authorization`;
    /// the rest of the authorization is released. Calls with the same `key`
    /// capture once.
    fn capture(&self, key: &str, authorization: &str, amount: i64) -> Result<(), Unavailable>;

    /// Voids `authorization` (releases the hold on the card). Calls with the
    /// same `key` void once.
    fn void(&self, key: &str, authorization: &str) -> Result<(), Unavailable>;

    /// Refunds `amount` of the captured `authorization`. Calls with the same
    /// `key` refund once.
    fn refund(&self, key: &str, authorization: &str, amount: i64) -> Result<(), Unavailable>;
}

/// Approves everything after a fixed latency, deduplicating by key. When
/// given a journal file it appends one line per new authorization
/// (`key authorization amount currency`) and reloads it at start, so its
/// memory of keys survives a crash of the server, as a real acquirer's would.
/// (Lines are written, not fsynced: the simulator survives a process kill,
/// not a power cut.)
pub struct Simulator {
    latency: Duration,
    authorized: Mutex<HashMap<String, String>>,
    journal: Option<Mutex<File>>,
}

impl Simulator {
    pub fn new(latency: Duration) -> Simulator {
        Simulator {
            latency,
            authorized: Mutex::new(HashMap::new()),
            journal: None,
        }
    }

    /// A simulator that remembers its keys in `journal`.
    pub fn with_journal(latency: Duration, journal: &Path) -> std::io::Result<Simulator> {
        let mut authorized = HashMap::new();
        if let Ok(file) = File::open(journal) {
            for line in BufReader::new(file).lines() {
                let line = line?;
                let mut parts = line.split(' ');
                if let (Some(key), Some(id)) = (parts.next(), parts.next()) {
                    authorized.insert(key.to_string(), id.to_string());
                }
            }
        }
        let file = OpenOptions::new().create(true).append(true).open(journal)?;
        Ok(Simulator {
            latency,
            authorized: Mutex::new(authorized),
            journal: Some(Mutex::new(file)),
        })
    }

    /// Where the journal of a database's simulator lives.
    pub fn journal_path(db: &Path) -> PathBuf {
        let mut path = db.as_os_str().to_owned();
        path.push(".acquirer");
        PathBuf::from(path)
    }
}

impl Acquirer for Simulator {
    fn authorize(
        &self,
        key: &str,
        amount: i64,
        currency: &str,
    ) -> Result<Authorization, Unavailable> {
        if !self.latency.is_zero() {
            std::thread::sleep(self.latency);
        }
        let mut authorized = self.authorized.lock().expect("acquirer lock");
        if let Some(id) = authorized.get(key) {
            return Ok(Authorization { id: id.clone() });
        }
        let id = format!("auth_{}", Uuid::now_v7().simple());
        if let Some(journal) = &self.journal {
            let line = format!("{key} {id} {amount} {currency}\n");
            journal
                .lock()
                .expect("journal lock")
                .write_all(line.as_bytes())
                .map_err(|e| Unavailable(format!("acquirer journal: {e}")))?;
        }
        authorized.insert(key.to_string(), id.clone());
        Ok(Authorization { id })
    }

    fn capture(&self, _key: &str, _authorization: &str, _amount: i64) -> Result<(), Unavailable> {
        Ok(())
    }

    fn void(&self, _key: &str, _authorization: &str) -> Result<(), Unavailable> {
        Ok(())
    }

    fn refund(&self, _key: &str, _authorization: &str, _amount: i64) -> Result<(), Unavailable> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_same_authorization_across_restarts() {
        let dir = std::env::temp_dir().join(format!("idem-acq-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let journal = dir.join("j");
        let first = Simulator::with_journal(Duration::ZERO, &journal).unwrap();
        let a = first.authorize("op_1", 100, "BRL").unwrap();
        assert_eq!(first.authorize("op_1", 100, "BRL").unwrap(), a);
        let b = first.authorize("op_2", 100, "BRL").unwrap();
        assert_ne!(a, b);
        drop(first);
        let again = Simulator::with_journal(Duration::ZERO, &journal).unwrap();
        assert_eq!(again.authorize("op_1", 100, "BRL").unwrap(), a);
        assert_eq!(
            std::fs::read_to_string(&journal).unwrap().lines().count(),
            2
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
