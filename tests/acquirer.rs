//! The built-in acquirer simulator: what it remembers stays bounded (no
//! memory per charge, rows past the retention pruned), and a v1 text
//! journal is imported once.
//!
//! The memory test counts this thread's heap with a counting global
//! allocator and SQLite's own heap, which is process-wide: every test of
//! this file holds `SERIAL`, so no other test allocates SQLite memory
//! meanwhile.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idem::acquirer::{Acquirer, Clock, Simulator};
use idem::config::{SIMULATOR_PRUNE_BATCH_LEN, SIMULATOR_PRUNE_EVERY_CALLS};
use support::TempDir;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts, per thread, the bytes allocated and not yet freed by that thread.
struct Counting;

thread_local! {
    static LIVE_BYTES: Cell<i64> = const { Cell::new(0) };
}

fn count(delta: i64) {
    // `try_with`: a thread being torn down has no counter any more.
    let _ = LIVE_BYTES.try_with(|live| live.set(live.get() + delta));
}

// SAFETY: every method forwards to `System` with the caller's arguments and
// only adds bookkeeping in a const-initialised thread local (no allocation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as i64));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Rust heap bytes this thread holds.
fn live_bytes() -> i64 {
    LIVE_BYTES.with(Cell::get)
}

/// SQLite's heap bytes, all connections of this process.
fn sqlite_bytes() -> i64 {
    // SAFETY: a read of SQLite's memory statistics, no arguments.
    unsafe { rusqlite::ffi::sqlite3_memory_used() }
}

/// A clock a test moves by hand.
fn manual_clock(start_ms: i64) -> (Arc<AtomicI64>, Clock) {
    let now = Arc::new(AtomicI64::new(start_ms));
    let read = Arc::clone(&now);
    (now, Arc::new(move || read.load(Ordering::SeqCst)))
}

fn authorize(sim: &Simulator, key: &str) -> String {
    sim.authorize(key, 100, "BRL")
        .unwrap_or_else(|e| panic!("{key}: {e:?}"))
        .id
}

fn rows(db: &Path) -> (usize, usize) {
    (
        Simulator::authorizations(db).unwrap().len(),
        Simulator::journal(db).unwrap().len(),
    )
}

/// The v1 simulator kept every authorization in a HashMap (about 200 bytes
/// per charge ever made); this one keeps them on disk. After a warm-up,
/// 20,000 more charges grow neither this thread's heap nor SQLite's.
#[test]
fn the_simulator_holds_no_memory_per_charge() {
    let _serial = serial();
    const WARM_UP: usize = 1_000;
    const CHARGES: usize = 20_000;
    let dir = TempDir::new("sim-memory");
    let sim = Simulator::open(&dir.db(), Duration::ZERO, Duration::from_secs(3600)).unwrap();
    for i in 0..WARM_UP {
        authorize(&sim, &format!("op_warm_{i}"));
    }
    let (heap, sqlite) = (live_bytes(), sqlite_bytes());
    for i in 0..CHARGES {
        authorize(&sim, &format!("op_{i}"));
    }
    let heap_growth = live_bytes() - heap;
    let sqlite_growth = sqlite_bytes() - sqlite;
    assert_eq!(
        rows(&dir.db()),
        (WARM_UP + CHARGES, WARM_UP + CHARGES),
        "all remembered (on disk)"
    );
    assert!(
        heap_growth < 16 * 1024,
        "the heap grew by {heap_growth} bytes over {CHARGES} charges"
    );
    assert!(
        sqlite_growth < 256 * 1024,
        "SQLite's heap grew by {sqlite_growth} bytes over {CHARGES} charges"
    );
}

/// Rows older than the retention are forgotten: by `prune`, and by the
/// simulator itself every `SIMULATOR_PRUNE_EVERY_CALLS` calls, so a long
/// run keeps a bounded number of rows and a file that stops growing.
#[test]
fn the_simulator_forgets_what_is_past_its_retention() {
    let _serial = serial();
    const RETENTION_MS: i64 = 1_000;
    let dir = TempDir::new("sim-prune");
    let db = dir.db();
    let (now, clock) = manual_clock(1_000_000);
    let retention = Duration::from_millis(RETENTION_MS as u64);
    let sim = Simulator::open_with_clock(&db, Duration::ZERO, retention, clock).unwrap();

    let old = authorize(&sim, "op_old");
    assert_eq!(authorize(&sim, "op_old"), old, "deduplicated by key");
    now.fetch_add(600, Ordering::SeqCst);
    let young = authorize(&sim, "op_young");
    now.fetch_add(RETENTION_MS - 100, Ordering::SeqCst);
    assert_eq!(
        sim.prune().unwrap(),
        3,
        "op_old: its authorization and two calls"
    );
    let kept = Simulator::authorizations(&db).unwrap();
    assert_eq!(kept.len(), 1);
    assert_eq!(
        (kept[0].key.as_str(), kept[0].id.as_str()),
        ("op_young", young.as_str())
    );
    assert!(Simulator::journal(&db)
        .unwrap()
        .iter()
        .all(|c| c.key == "op_young"));

    // A long run, one call per millisecond: at most a retention's worth of
    // rows, plus what arrived since the last prune.
    let bound = RETENTION_MS as usize + SIMULATOR_PRUNE_EVERY_CALLS as usize;
    let size = |sim: &Simulator| {
        drop(sim.prune());
        let conn = rusqlite::Connection::open(Simulator::store_path(&db)).unwrap();
        conn.query_row("PRAGMA page_count", [], |r| r.get::<_, i64>(0))
            .unwrap()
    };
    let mut pages = Vec::new();
    for round in 0..3 {
        for i in 0..10_000 {
            now.fetch_add(1, Ordering::SeqCst);
            authorize(&sim, &format!("op_{round}_{i}"));
        }
        let (authorizations, calls) = rows(&db);
        assert!(
            authorizations <= bound && calls <= bound,
            "round {round}: {authorizations} authorizations, {calls} calls kept (bound {bound})"
        );
        pages.push(size(&sim));
    }
    assert!(
        pages[2] <= pages[1],
        "freed pages are reused, the file stops growing: {pages:?} pages"
    );
    assert!(SIMULATOR_PRUNE_BATCH_LEN >= SIMULATOR_PRUNE_EVERY_CALLS as usize);
}

/// A v1 text journal is imported once: its authorizations are given again
/// for their keys, journaled once as the calls that made them, and the file
/// is renamed. Importing it again (a crash after the commit, before the
/// rename) changes nothing; malformed (torn) lines are skipped.
#[test]
fn a_v1_journal_is_imported_once() {
    let _serial = serial();
    let dir = TempDir::new("sim-import");
    let db = dir.db();
    let v1 = Simulator::v1_journal_path(&db);
    let text = "op_a auth_0001 700 BRL\nop_b auth_0002 55 USD\nop_c auth_00";
    std::fs::write(&v1, text).unwrap();
    let imported = dir.0.join("idem.db.acquirer.imported");

    let sim = Simulator::open(&db, Duration::ZERO, Duration::from_secs(3600)).unwrap();
    assert!(!v1.exists() && imported.exists(), "renamed once imported");
    let journal = Simulator::journal(&db).unwrap();
    let made: Vec<_> = journal
        .iter()
        .map(|c| {
            (
                c.key.as_str(),
                c.authorization.as_str(),
                c.amount,
                c.currency.as_str(),
            )
        })
        .collect();
    assert_eq!(
        made,
        [
            ("op_a", "auth_0001", 700, "BRL"),
            ("op_b", "auth_0002", 55, "USD")
        ]
    );
    assert!(journal.iter().all(|c| c.created && !c.timed_out));
    assert_eq!(authorize(&sim, "op_a"), "auth_0001");
    drop(sim);
    let journal = Simulator::journal(&db).unwrap();
    assert_eq!(journal.len(), 3, "the repeated call is journaled");
    assert!(!journal[2].created);

    // Undo the rename, as a crash right after the import's commit would:
    // the next start imports the file again, and nothing changes.
    std::fs::rename(&imported, &v1).unwrap();
    let sim = Simulator::open(&db, Duration::ZERO, Duration::from_secs(3600)).unwrap();
    assert!(!v1.exists());
    assert_eq!(Simulator::journal(&db).unwrap(), journal);
    assert_eq!(Simulator::authorizations(&db).unwrap().len(), 2);
    assert_eq!(authorize(&sim, "op_b"), "auth_0002");
}
