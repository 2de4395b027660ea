//! Contention benches: `cargo bench --bench contention [-- SCENARIO ...]`.
//!
//! Each scenario starts real `idem serve` child processes (the release
//! binary) on fresh databases, drives them with a keep-alive HTTP/1.1 load
//! generator built into this file (one thread per connection), prints a table
//! and compares against a baseline measured in the same run. Every scenario
//! counts the connections that actually got answers: a load tool reports no
//! error for a connection that is never served.
//!
//! Scenarios, each with its same-run baseline: `unique` (1/16/64
//! connections, group commit vs `--commit-batch-max 1`, peak RSS, commands
//! per commit), `hot_key` (losers' latency vs the owner's), `hot_account`
//! (vs spread accounts), `retry_storm` (vs unique keys), `floor` (the same
//! charges through the library on an in-process server with the default
//! configuration — `IDEM_BENCH_SERVER_ARGS` does not reach it — vs HTTP),
//! `rss` (the server's RSS over a long run of unique charges, sampled at
//! intervals, vs its first sample under load), `webhooks` (unique charges
//! with one subscribed endpoint, a receiver in this process, vs none, and
//! the time from each event's commit to its arrival), and, only when named,
//! `batch_sweep` (how the default
//! `--commit-batch-max` was chosen), `ab` (unique keys, this build's
//! server vs the `idem` binary at `IDEM_BENCH_AB_BIN`, in alternating
//! rounds: a before/after comparison on a busy machine), `open_loop`,
//! `targets` and `backends`.
//!
//! `backends` compares the storage backends (issue 13) in one run: SQLite
//! (one node, the baseline), PostgreSQL with one node, and PostgreSQL with
//! three nodes on one database (connection `i` to node `i % 3`), each for
//! unique keys and for a hot account (every charge debits `card0`), at 64
//! and 256 connections. PostgreSQL comes from `IDEM_BENCH_POSTGRES`, the
//! URL of a database whose user may create databases; every PostgreSQL run
//! gets a fresh database (`idem_bench_*`, dropped afterwards) and a fresh
//! `--acquirer-store` file shared by its nodes, and the cluster's settings
//! are left as they are. Without the variable it measures SQLite alone. Its
//! table: charges/s, p50/p99, the ratio to SQLite for the same load, 5xx
//! answers (a command that keeps losing its serialization race answers
//! 503), the servers' CPU (all nodes) and their PostgreSQL backends' CPU
//! per charge, the machine's busy share, and PostgreSQL's commits and
//! rollbacks per charge (`pg_stat_database`: each serialization failure is
//! a rollback); then what the backends were doing (`pg_stat_activity`
//! sampled through the run: on CPU, waiting on a row lock, on the WAL
//! flush, or idle in a transaction while idem works).
//!
//! `open_loop` offers a constant `IDEM_BENCH_OPEN_RATE` charges/s (default
//! 3000) from a pool of 256 keep-alive senders ([`drive_open`]): request `i`
//! is due at `t0 + i / rate`, and its latency runs from that intended send
//! time to its answer, so time spent queued behind a slow answer counts (no
//! coordinated omission). It reports the offered and achieved rates,
//! p50/p99/p99.9/max, and the requests that started more than 1 ms late —
//! the generator's own limit, told apart from the server's: a late start
//! while every other sender awaited an answer is the server's backlog, any
//! other is the generator not being scheduled in time.
//!
//! `targets` measures every row of issue 12's table in one run, on this
//! machine, each server with its default flags (WAL, `synchronous=FULL`)
//! and one webhook endpoint subscribed to every event at a receiver of its
//! own: unique-key charges/s at 64 and 256 connections, group commit vs
//! `--commit-batch-max 1` at 64, the open loop at `IDEM_BENCH_OPEN_RATE`,
//! one merchant account vs spread at 64 (throughput and p99.9), webhook
//! commit→arrival p99 under the 64-connection load, and RSS over a run of
//! `IDEM_BENCH_RSS_SECONDS` (default 300 here) at 64 connections, sampled
//! 15 times and called flat when the samples from the end of the first
//! fifth on span less than 4 MiB. Rounds alternate the variants; each
//! measure is its median over `IDEM_BENCH_ROUNDS`. It ends with a table
//! `| measure | target | measured | met |`, also stored under "targets".
//! Every run checks one charge per 201.
//!
//! Results go to `target/bench/contention.json`.
//!
//! `IDEM_BENCH_SECONDS` sets each measured run's length (default 5);
//! `IDEM_BENCH_ROUNDS` how many rounds `unique`, `hot_key`, `webhooks`,
//! `ab`, `open_loop`, `targets` and `backends` run (default 3, the median
//! is reported); `IDEM_BENCH_POSTGRES` the PostgreSQL of `backends`, and
//! `IDEM_BENCH_BACKEND_CONNS` its connection counts (default `64,256`);
//! `IDEM_BENCH_SERVER_ARGS` adds flags to every server started;
//! `IDEM_BENCH_UNIQUE_CONNS` picks the connection counts of `unique`;
//! `IDEM_BENCH_RSS_SECONDS` the length of `rss` (default 60) and of the RSS
//! run of `targets` (default 300); `IDEM_BENCH_OPEN_RATE` the offered rate
//! of `open_loop` and of the open-loop row of `targets` (default 3000).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

// ---------------------------------------------------------------------------
// Server child processes

struct ServerProc {
    child: Child,
    addr: SocketAddr,
    key: String,
    _dir: TempDir,
}

impl ServerProc {
    fn start(args: &[&str]) -> ServerProc {
        ServerProc::start_bin(env!("CARGO_BIN_EXE_idem"), args)
    }

    /// [`ServerProc::start`] of the `idem` binary at `bin`.
    fn start_bin(bin: &str, args: &[&str]) -> ServerProc {
        let dir = TempDir::new();
        let db = dir.0.join("idem.db");
        ServerProc::spawn(bin, db.as_os_str(), args, dir, None)
    }

    /// `idem serve --db DB` (the binary at `bin`) with `args`, owning
    /// `dir`. Its key is the one it prints when it creates the database's
    /// first consumer, else `key` (a later node on a shared database).
    fn spawn(
        bin: &str,
        db: &std::ffi::OsStr,
        args: &[&str],
        dir: TempDir,
        given: Option<&str>,
    ) -> ServerProc {
        let mut child = Command::new(bin)
            .arg("serve")
            .arg("--db")
            .arg(db)
            .args(["--addr", "127.0.0.1:0"])
            .args(server_args(args))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idem serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut key = None;
        let addr = loop {
            let line = lines.next().expect("idem serve exited").unwrap();
            if let Some(k) = line.split_whitespace().find(|w| w.starts_with("sk_")) {
                key = Some(k.to_string());
            }
            if let Some(url) = line.strip_prefix("listening on http://") {
                break url.trim().parse().unwrap();
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        ServerProc {
            child,
            addr,
            key: key
                .or_else(|| given.map(str::to_string))
                .expect("first start prints the default key"),
            _dir: dir,
        }
    }

    /// Peak resident set size so far (VmHWM), in KiB.
    fn peak_rss_kib(&self) -> u64 {
        self.status_kib("VmHWM:")
    }

    /// CPU time the server process has used so far (user + system), in ms.
    fn cpu_ms(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        stat_cpu_ms(&stat).map_or(0.0, |(_, ms)| ms)
    }

    /// CPU time (user + system, ms) each group of the server's threads has
    /// used so far: threads named alike but for a trailing number
    /// (`idem-op-12`) are one group (`idem-op-N`). A thread that has
    /// exited is missing, so take the difference of two readings under
    /// steady load.
    fn thread_cpu_ms(&self) -> BTreeMap<String, f64> {
        let mut groups = BTreeMap::new();
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.child.id())) else {
            return groups;
        };
        for task in tasks.flatten() {
            let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
                continue;
            };
            let Some((name, ms)) = stat_cpu_ms(&stat) else {
                continue;
            };
            let base = name.trim_end_matches(|c: char| c.is_ascii_digit());
            let group = if base.len() < name.len() {
                format!("{base}N")
            } else {
                name.to_string()
            };
            *groups.entry(group).or_insert(0.0) += ms;
        }
        groups
    }

    /// Resident set size now (VmRSS), in KiB.
    fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// A `kB` field of `/proc/PID/status`.
    fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// Bytes on disk of the file `name` in the server's directory, with its
    /// `-wal`.
    fn file_bytes(&self, name: &str) -> u64 {
        [name.to_string(), format!("{name}-wal")]
            .iter()
            .map(|f| std::fs::metadata(self._dir.0.join(f)).map_or(0, |m| m.len()))
            .sum()
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The command name and the CPU time (user + system, ms) of a process's or
/// thread's `/proc/.../stat` line; `None` if it is not one.
fn stat_cpu_ms(stat: &str) -> Option<(&str, f64)> {
    // The name may hold spaces and parentheses: it runs to the last ')'.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of stat(5), 11 and 12 here;
    // clock ticks of 10 ms (USER_HZ = 100 on Linux).
    Some((stat.get(open + 1..close)?, (ticks(11) + ticks(12)) * 10.0))
}

/// `IDEM_BENCH_UNIQUE_CONNS`: the connection counts of `unique` (default
/// `1,16,64`).
fn unique_conns() -> Vec<usize> {
    std::env::var("IDEM_BENCH_UNIQUE_CONNS")
        .unwrap_or_else(|_| "1,16,64".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// The flags of a bench server: the defaults, then `IDEM_BENCH_SERVER_ARGS`
/// (to explore settings from the command line), then the scenario's own.
/// A flag given by a later source replaces the earlier one.
fn server_args(scenario: &[&str]) -> Vec<String> {
    let extra: Vec<String> = std::env::var("IDEM_BENCH_SERVER_ARGS")
        .map(|s| s.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default();
    let sources = [extra, scenario.iter().map(|s| s.to_string()).collect()];
    let mut flags: Vec<(String, Option<String>)> = Vec::new();
    for source in sources {
        let mut it = source.into_iter().peekable();
        while let Some(flag) = it.next() {
            let value = it.next_if(|v| !v.starts_with("--"));
            flags.retain(|(f, _)| *f != flag);
            flags.push((flag, value));
        }
    }
    flags
        .into_iter()
        .flat_map(|(f, v)| std::iter::once(f).chain(v))
        .collect()
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let p = std::env::temp_dir().join(format!("idem-bench-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------
// A keep-alive HTTP/1.1 connection

struct Conn {
    addr: SocketAddr,
    key: String,
    stream: Option<BufReader<TcpStream>>,
}

struct Answer {
    status: u16,
    replayed: bool,
    body: Vec<u8>,
}

impl Conn {
    fn new(addr: SocketAddr, key: &str) -> Conn {
        Conn {
            addr,
            key: key.to_string(),
            stream: None,
        }
    }

    fn request(
        &mut self,
        method: &str,
        path: &str,
        idem_key: Option<&str>,
        body: &str,
    ) -> std::io::Result<Answer> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            self.stream = Some(BufReader::new(s));
        }
        let result = self.exchange(method, path, idem_key, body);
        if result.is_err() {
            self.stream = None;
        }
        result
    }

    fn exchange(
        &mut self,
        method: &str,
        path: &str,
        idem_key: Option<&str>,
        body: &str,
    ) -> std::io::Result<Answer> {
        let reader = self.stream.as_mut().unwrap();
        let extra = idem_key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {}\r\n{extra}Content-Length: {}\r\n\r\n",
            self.key,
            body.len()
        );
        let stream = reader.get_mut();
        stream.write_all(head.as_bytes())?;
        stream.write_all(body.as_bytes())?;
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let status: u16 = line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("bad status line {line:?}")))?;
        let (mut len, mut replayed, mut close) = (0usize, false, false);
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let lower = l.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            } else if lower.starts_with("idempotent-replayed: true") {
                replayed = true;
            } else if lower.starts_with("connection: close") {
                close = true;
            }
        }
        let mut body = vec![0; len];
        reader.read_exact(&mut body)?;
        if close {
            self.stream = None;
        }
        Ok(Answer {
            status,
            replayed,
            body,
        })
    }
}

fn setup_accounts(addr: SocketAddr, key: &str, n: usize) {
    let mut c = Conn::new(addr, key);
    for i in 0..n {
        for (id, neg) in [(format!("card{i}"), true), (format!("shop{i}"), false)] {
            let body = json!({"id": id, "currency": "BRL", "allow_negative": neg}).to_string();
            let a = c.request("POST", "/v1/accounts", None, &body).unwrap();
            assert!(
                a.status == 201 || a.status == 200,
                "account {id}: {}",
                a.status
            );
        }
    }
}

fn charge_body(amount: i64, src: usize, dst: usize) -> String {
    format!(
        r#"{{"amount":{amount},"currency":"BRL","source":"card{src}","destination":"shop{dst}"}}"#
    )
}

/// Mean write commands per commit so far, from the server's metrics.
/// (write commands, commits) so far, from the server's metrics.
fn commit_counters(addr: SocketAddr, key: &str) -> (f64, f64) {
    let metrics = Conn::new(addr, key)
        .request("GET", "/metrics", None, "")
        .unwrap();
    let text = String::from_utf8(metrics.body).unwrap();
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(f64::NAN)
    };
    (
        value("idem_commit_batch_size_sum "),
        value("idem_commit_batch_size_count "),
    )
}

/// Charges answered 201 so far, from the server's metrics.
fn charges_created(addr: SocketAddr, key: &str) -> u64 {
    let metrics = Conn::new(addr, key)
        .request("GET", "/metrics", None, "")
        .unwrap();
    String::from_utf8(metrics.body)
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("idem_http_requests_total{route=\"/v1/charges\",status=\"201\"} ")
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn assert_one_charge_per_201(server: &ServerProc, run: &Run) {
    let charges = charge_count(server.addr, &server.key) as u64;
    assert_eq!(
        charges,
        run.ok(),
        "one charge per 201, none lost or doubled"
    );
}

fn charge_count(addr: SocketAddr, key: &str) -> usize {
    let mut c = Conn::new(addr, key);
    let mut n = 0;
    let mut after = String::new();
    loop {
        let path = if after.is_empty() {
            "/v1/charges?limit=100".to_string()
        } else {
            format!("/v1/charges?limit=100&starting_after={after}")
        };
        let page: Value =
            serde_json::from_slice(&c.request("GET", &path, None, "").unwrap().body).unwrap();
        let data = page["data"].as_array().unwrap();
        n += data.len();
        match data.last() {
            Some(last) if page["has_more"] == json!(true) => {
                after = last["id"].as_str().unwrap().to_string()
            }
            _ => return n,
        }
    }
}

// ---------------------------------------------------------------------------
// Measurement

#[derive(Default)]
struct Tally {
    latencies_us: Vec<u64>,
    by_status: BTreeMap<u16, u64>,
    replays: u64,
    errors: u64,
    answered: bool,
    /// Open loop only: requests sent more than [`LATE`] after their
    /// intended send time, those of them sent while every other sender was
    /// awaiting an answer, and the largest lateness (µs).
    late_starts: u64,
    late_all_busy: u64,
    max_late_us: u64,
}

struct Run {
    seconds: f64,
    tallies: Vec<Tally>,
    /// Mean write commands per commit during the run (set-up excluded).
    commands_per_commit: Option<f64>,
}

impl Run {
    fn latencies(&self) -> Vec<u64> {
        let mut all: Vec<u64> = self
            .tallies
            .iter()
            .flat_map(|t| t.latencies_us.iter().copied())
            .collect();
        all.sort_unstable();
        all
    }
    fn ok(&self) -> u64 {
        self.tallies
            .iter()
            .map(|t| {
                t.by_status
                    .iter()
                    .filter(|(s, _)| **s < 300)
                    .map(|(_, n)| n)
                    .sum::<u64>()
            })
            .sum()
    }
    fn total(&self) -> u64 {
        self.tallies
            .iter()
            .map(|t| t.latencies_us.len() as u64)
            .sum()
    }
    fn answered(&self) -> usize {
        self.tallies.iter().filter(|t| t.answered).count()
    }
    fn errors(&self) -> u64 {
        self.tallies.iter().map(|t| t.errors).sum()
    }
    fn status(&self, s: u16) -> u64 {
        self.tallies
            .iter()
            .map(|t| t.by_status.get(&s).copied().unwrap_or(0))
            .sum()
    }
    fn replays(&self) -> u64 {
        self.tallies.iter().map(|t| t.replays).sum()
    }
    fn rate(&self) -> f64 {
        self.ok() as f64 / self.seconds
    }
    fn late_starts(&self) -> u64 {
        self.tallies.iter().map(|t| t.late_starts).sum()
    }
    fn late_all_busy(&self) -> u64 {
        self.tallies.iter().map(|t| t.late_all_busy).sum()
    }
    fn max_late_us(&self) -> u64 {
        self.tallies
            .iter()
            .map(|t| t.max_late_us)
            .max()
            .unwrap_or(0)
    }
}

/// The server's CPU by thread group over a run (`thread_cpu_ms` of a row
/// from `subscribed_run`): share of the server's total, and per 2xx answer.
fn print_thread_cpu(title: &str, r: &Value) {
    let Some(threads) = r["thread_cpu_ms"].as_object() else {
        return;
    };
    let mut threads: Vec<(&String, f64)> = threads
        .iter()
        .map(|(t, ms)| (t, ms.as_f64().unwrap_or(0.0)))
        .filter(|(_, ms)| *ms > 0.0)
        .collect();
    threads.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = threads.iter().map(|(_, ms)| ms).sum();
    let ok = r["ok"].as_f64().unwrap_or(0.0).max(1.0);
    println!("\n## {title}\n");
    println!("| thread | CPU ms | share | µs per charge |");
    println!("|---|---|---|---|");
    for (t, ms) in &threads {
        println!(
            "| `{t}` | {ms:.0} | {:.1} % | {:.0} |",
            100.0 * ms / total.max(1.0),
            ms * 1000.0 / ok
        );
    }
    println!("| all | {total:.0} | 100 % | {:.0} |", total * 1000.0 / ok);
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1000.0
}

/// Runs `conns` connection threads for `duration`; each calls `next(conn
/// index, request index)` for (idempotency key, body) and sends a charge.
fn drive(addr: SocketAddr, key: &str, conns: usize, duration: Duration, next: Next) -> Run {
    drive_spread(&[addr], key, conns, duration, next)
}

/// [`drive`] over several servers: connection `i` goes to `addrs[i %
/// addrs.len()]`.
fn drive_spread(
    addrs: &[SocketAddr],
    key: &str,
    conns: usize,
    duration: Duration,
    next: Next,
) -> Run {
    let barrier = Arc::new(Barrier::new(conns + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..conns)
        .map(|i| {
            let (barrier, stop, next, key) =
                (barrier.clone(), stop.clone(), next.clone(), key.to_string());
            let addr = addrs[i % addrs.len()];
            std::thread::spawn(move || {
                let mut conn = Conn::new(addr, &key);
                let mut t = Tally::default();
                barrier.wait();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let (k, body) = next(i, n);
                    n += 1;
                    let started = Instant::now();
                    match conn.request("POST", "/v1/charges", Some(&k), &body) {
                        Ok(a) => {
                            t.latencies_us.push(started.elapsed().as_micros() as u64);
                            *t.by_status.entry(a.status).or_default() += 1;
                            t.replays += u64::from(a.replayed);
                            t.answered = true;
                        }
                        Err(_) => t.errors += 1,
                    }
                }
                t
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    let tallies: Vec<Tally> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    Run {
        seconds: started.elapsed().as_secs_f64(),
        tallies,
        commands_per_commit: None,
    }
}

/// How late (after its intended send time) an open-loop request may start
/// before it counts as a late start: the load generator fell behind.
const LATE: Duration = Duration::from_millis(1);

/// Open-loop load: a constant `rate` of charges for `duration`, whatever
/// the server's latency. Request `i` is due at `t0 + i / rate`; a pool of
/// `conns` keep-alive connection threads takes the next index from a shared
/// counter, sleeps until that request is due (sends at once if it is
/// already late), sends it, and records latency = completion − intended
/// send time. A slow answer therefore delays no later request's clock:
/// the time a request spends waiting for a free sender counts in its
/// latency (no coordinated omission). Each sender opens its connection
/// before the clock starts. `next(sender index, request index)` gives
/// (idempotency key, body).
///
/// A late start (more than [`LATE`]) means the generator did not send on
/// time: if every other sender was awaiting an answer, the pool was
/// exhausted by a slow server (`late_all_busy`); otherwise the generator's
/// threads were not scheduled in time (a generator limit, its CPU).
/// `Run::seconds` runs from `t0` to the last answer, so `Run::rate` is the
/// achieved rate.
fn drive_open(
    addr: SocketAddr,
    key: &str,
    conns: usize,
    rate: f64,
    duration: Duration,
    next: Next,
) -> Run {
    let total = (rate * duration.as_secs_f64()).round() as u64;
    let ready = Arc::new(Barrier::new(conns + 1));
    let go = Arc::new(Barrier::new(conns + 1));
    let t0: Arc<OnceLock<Instant>> = Arc::default();
    let index = Arc::new(AtomicU64::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..conns)
        .map(|i| {
            let (ready, go, t0, index, in_flight, next, key) = (
                ready.clone(),
                go.clone(),
                t0.clone(),
                index.clone(),
                in_flight.clone(),
                next.clone(),
                key.to_string(),
            );
            std::thread::spawn(move || {
                let mut conn = Conn::new(addr, &key);
                let mut t = Tally::default();
                // Connect now: the schedule measures charges, not handshakes.
                let _ = conn.request("GET", "/v1/accounts/card0", None, "");
                ready.wait();
                go.wait();
                let t0 = *t0.get().unwrap();
                loop {
                    let n = index.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        break;
                    }
                    let (k, body) = next(i, n);
                    let due = t0 + Duration::from_secs_f64(n as f64 / rate);
                    let wait = due.saturating_duration_since(Instant::now());
                    if !wait.is_zero() {
                        std::thread::sleep(wait);
                    }
                    let late = Instant::now().saturating_duration_since(due);
                    let others_busy = in_flight.fetch_add(1, Ordering::Relaxed);
                    if late > LATE {
                        t.late_starts += 1;
                        t.late_all_busy += u64::from(others_busy + 1 >= conns);
                    }
                    t.max_late_us = t.max_late_us.max(late.as_micros() as u64);
                    let answer = conn.request("POST", "/v1/charges", Some(&k), &body);
                    let done = Instant::now();
                    in_flight.fetch_sub(1, Ordering::Relaxed);
                    match answer {
                        Ok(a) => {
                            t.latencies_us.push((done - due).as_micros() as u64);
                            *t.by_status.entry(a.status).or_default() += 1;
                            t.replays += u64::from(a.replayed);
                            t.answered = true;
                        }
                        Err(_) => t.errors += 1,
                    }
                }
                t
            })
        })
        .collect();
    ready.wait();
    let start = Instant::now() + Duration::from_millis(20);
    t0.set(start).unwrap();
    go.wait();
    let tallies: Vec<Tally> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    Run {
        seconds: start.elapsed().as_secs_f64(),
        tallies,
        commands_per_commit: None,
    }
}

/// `IDEM_BENCH_OPEN_RATE`: the charges per second `open_loop` (and the
/// open-loop row of `targets`) offers (default 3000).
fn open_rate() -> f64 {
    std::env::var("IDEM_BENCH_OPEN_RATE")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|r: &f64| *r > 0.0)
        .unwrap_or(3000.0)
}

/// `IDEM_BENCH_RSS_SECONDS`, or `default`.
fn rss_seconds(default: f64) -> f64 {
    std::env::var("IDEM_BENCH_RSS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn unique_keys(
    conns: usize,
    hot_account: bool,
) -> Arc<dyn Fn(usize, u64) -> (String, String) + Send + Sync> {
    let run = uuid::Uuid::new_v4().simple().to_string();
    Arc::new(move |i, n| {
        let dst = if hot_account { 0 } else { i };
        let _ = conns;
        (
            format!("{run}-{i}-{n}"),
            charge_body(1 + (n % 1000) as i64, i, dst),
        )
    })
}

fn row(name: &str, r: &Run, conns: usize) -> Value {
    let lat = r.latencies();
    json!({
        "name": name,
        "connections": conns,
        "answered_connections": r.answered(),
        "requests": r.total(),
        "ok": r.ok(),
        "errors": r.errors(),
        "status_409": r.status(409),
        "status_503": r.status(503),
        "replays": r.replays(),
        "per_second": r.rate(),
        "p50_ms": pct(&lat, 0.50),
        "p99_ms": pct(&lat, 0.99),
        "p999_ms": pct(&lat, 0.999),
        "max_ms": pct(&lat, 1.0),
    })
}

/// [`row`] of an open-loop run, with the offered rate and the generator's
/// late starts; `per_second` is the achieved rate.
fn open_row(name: &str, r: &Run, conns: usize, rate: f64) -> Value {
    let mut v = row(name, r, conns);
    v["offered_per_second"] = json!(rate);
    v["late_starts"] = json!(r.late_starts());
    v["late_all_senders_busy"] = json!(r.late_all_busy());
    v["max_late_ms"] = json!(r.max_late_us() as f64 / 1000.0);
    v
}

fn print_open_table(title: &str, rows: &[Value]) {
    println!("\n## {title}\n");
    println!(
        "| run | senders answered | offered/s | achieved/s | p50 ms | p99 ms | p99.9 ms | max ms | late starts (> {LATE:?}) | of which all senders busy | max late ms | non-2xx | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {} | {:.0}/{:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} |",
            r["name"].as_str().unwrap(),
            f("answered_connections"),
            f("connections"),
            f("offered_per_second"),
            f("per_second"),
            f("p50_ms"),
            f("p99_ms"),
            f("p999_ms"),
            f("max_ms"),
            f("late_starts"),
            f("late_all_senders_busy"),
            f("max_late_ms"),
            f("requests") - f("ok"),
            f("errors"),
        );
    }
}

/// A row whose every numeric field is the median of that field over
/// `rounds` (each measure its own median, possibly from different rounds).
fn median_row(name: &str, rounds: &[Value]) -> Value {
    let mut m = rounds[0].clone();
    for (k, v) in m.as_object_mut().unwrap() {
        if v.is_number() {
            *v = json!(median(
                rounds.iter().filter_map(|r| r[k].as_f64()).collect()
            ));
        }
    }
    m["name"] = json!(name);
    m
}

/// Commit→arrival of each run's webhook events, as the `webhooks` scenario
/// prints it.
fn print_deliveries(rows: &[Value]) {
    println!(
        "\n| run | events | delivered | drain after load s | commit→arrival p50 ms | p99 ms | max ms |"
    );
    println!("|---|---|---|---|---|---|---|");
    for a in rows {
        let f = |k: &str| a[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {} | {} | {} | {:.2} | {:.1} | {:.1} | {:.1} |",
            a["name"].as_str().unwrap(),
            a["events"],
            a["delivered"],
            f("drain_s_after_load"),
            f("delivery_p50_ms"),
            f("delivery_p99_ms"),
            f("delivery_max_ms"),
        );
    }
}

/// The median (the upper one of an even count) of `v`; NaN if empty.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The round with the median throughput, annotated with the spread.
fn median_by_rate(mut runs: Vec<Value>) -> Value {
    runs.sort_by(|a, b| {
        a["per_second"]
            .as_f64()
            .unwrap()
            .total_cmp(&b["per_second"].as_f64().unwrap())
    });
    let rates: Vec<f64> = runs
        .iter()
        .map(|r| r["per_second"].as_f64().unwrap())
        .collect();
    let mut median = runs[runs.len() / 2].clone();
    median["rounds_per_second"] = json!(rates);
    if runs.len() > 1 {
        let name = median["name"].as_str().unwrap().to_string();
        median["name"] = json!(format!("{name} (median of {})", runs.len()));
    }
    median
}

fn print_table(title: &str, rows: &[Value]) {
    println!("\n## {title}\n");
    println!(
        "| run | conns answered | ok/s | p50 ms | p99 ms | p99.9 ms | 409 | 503 | replays | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {}/{} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} |",
            r["name"].as_str().unwrap(),
            r["answered_connections"],
            r["connections"],
            r["per_second"].as_f64().unwrap(),
            r["p50_ms"].as_f64().unwrap_or(f64::NAN),
            r["p99_ms"].as_f64().unwrap_or(f64::NAN),
            r["p999_ms"].as_f64().unwrap_or(f64::NAN),
            r["status_409"],
            r["status_503"],
            r["replays"],
            r["errors"],
        );
    }
}

fn ratio(a: f64, b: f64) -> String {
    if b == 0.0 || !a.is_finite() || !b.is_finite() {
        "n/a".into()
    } else {
        format!("{:.2}x", a / b)
    }
}

// ---------------------------------------------------------------------------
// A webhook receiver

/// A local webhook receiver: keep-alive HTTP/1.1, one thread per
/// connection, answering 200 at once; records each distinct `webhook-id`
/// with how long after its event's `created_at` it first arrived.
struct Receiver {
    addr: SocketAddr,
    /// webhook-id → (arrival − created_at in µs, created_at in ms).
    seen: Arc<Mutex<BTreeMap<String, (u64, i64)>>>,
}

fn wall_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// Milliseconds since the epoch of an RFC 3339 UTC time as idem writes it
/// (`2026-11-30T18:11:01.350Z`).
fn rfc3339_ms(t: &str) -> Option<i64> {
    let num = |a: usize, b: usize| t.get(a..b)?.parse::<i64>().ok();
    let (y, mo, d) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (h, mi, s, ms) = (num(11, 13)?, num(14, 16)?, num(17, 19)?, num(20, 23)?);
    // Days from the civil date (Howard Hinnant's algorithm).
    let (y2, m2) = if mo <= 2 {
        (y - 1, mo + 9)
    } else {
        (y, mo - 3)
    };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * m2 + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((((days * 24 + h) * 60 + mi) * 60 + s) * 1000 + ms)
}

impl Receiver {
    fn start() -> Receiver {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<BTreeMap<String, (u64, i64)>>> = Arc::default();
        let shared = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let seen = shared.clone();
                std::thread::spawn(move || Receiver::serve(stream, &seen));
            }
        });
        Receiver { addr, seen }
    }

    fn serve(stream: TcpStream, seen: &Mutex<BTreeMap<String, (u64, i64)>>) {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let (mut len, mut id) = (0usize, String::new());
            loop {
                line.clear();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                let l = line.trim_end();
                if l.is_empty() {
                    break;
                }
                let lower = l.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                } else if lower.starts_with("webhook-id:") {
                    id = l["webhook-id:".len()..].trim().to_string();
                }
            }
            let mut body = vec![0; len];
            if reader.read_exact(&mut body).is_err() {
                return;
            }
            let arrived_us = wall_us();
            let created_ms = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|e| rfc3339_ms(e["created_at"].as_str()?));
            if let Some(created_ms) = created_ms {
                let delay = (arrived_us - created_ms * 1000).max(0) as u64;
                seen.lock()
                    .unwrap()
                    .entry(id)
                    .or_insert((delay, created_ms));
            }
            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
            if reader.get_mut().write_all(ok).is_err() {
                return;
            }
        }
    }

    fn distinct(&self) -> u64 {
        self.seen.lock().unwrap().len() as u64
    }

    /// Waits (at most 120 s) until every event of a server with
    /// `accounts` account pairs has arrived — an `account.created` per
    /// account, a `charge.succeeded` per charge of `run` — and adds to `r`
    /// the events, how many arrived, how long the backlog took to drain
    /// after the load, and the commit→arrival percentiles of the events
    /// created from `from_ms` to `to_ms` (the load's start and end).
    fn report(&self, accounts: usize, run: &Run, from_ms: i64, to_ms: i64, r: &mut Value) {
        let events = 2 * accounts as u64 + run.ok();
        let drained = Instant::now();
        while self.distinct() < events && drained.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let delays = self.delays_us_between(from_ms, to_ms);
        r["events"] = json!(events);
        r["delivered"] = json!(self.distinct());
        r["drain_s_after_load"] = json!(drained.elapsed().as_secs_f64());
        r["delivery_p50_ms"] = json!(pct(&delays, 0.50));
        r["delivery_p99_ms"] = json!(pct(&delays, 0.99));
        r["delivery_max_ms"] = json!(pct(&delays, 1.0));
    }

    /// Delays (µs) of the events created from `from_ms` to `to_ms` (ms
    /// since the epoch, the load's own start and end), sorted.
    fn delays_us_between(&self, from_ms: i64, to_ms: i64) -> Vec<u64> {
        let mut delays: Vec<u64> = self
            .seen
            .lock()
            .unwrap()
            .values()
            .filter(|(_, at)| (from_ms..=to_ms).contains(at))
            .map(|(d, _)| *d)
            .collect();
        delays.sort_unstable();
        delays
    }
}

/// Starts a [`Receiver`] and subscribes one endpoint of `server` to every
/// event at it.
fn subscribe(server: &ServerProc) -> Receiver {
    let receiver = Receiver::start();
    let body = json!({"url": format!("http://{}/hook", receiver.addr), "enabled_events": ["*"]})
        .to_string();
    let made = Conn::new(server.addr, &server.key)
        .request("POST", "/v1/webhook_endpoints", None, &body)
        .unwrap();
    assert_eq!(made.status, 201, "{}", String::from_utf8_lossy(&made.body));
    receiver
}

/// A server as every run of `targets` has it: `idem serve` (default flags
/// but the run's own), one webhook endpoint subscribed to every event at a
/// receiver of its own, and `accounts` account pairs.
struct Subscribed {
    server: ServerProc,
    receiver: Receiver,
    accounts: usize,
}

impl Subscribed {
    fn start(args: &[&str], accounts: usize) -> Subscribed {
        let server = ServerProc::start(args);
        let receiver = subscribe(&server);
        setup_accounts(server.addr, &server.key, accounts);
        Subscribed {
            server,
            receiver,
            accounts,
        }
    }

    /// [`Receiver::report`] of this server's run.
    fn deliveries(&self, run: &Run, from_ms: i64, to_ms: i64, r: &mut Value) {
        self.receiver.report(self.accounts, run, from_ms, to_ms, r);
    }
}

/// Unique charges from `conns` connections for `duration` (the server has
/// their accounts), sampling the server `samples` times at equal intervals
/// and once before: seconds into the run, charges made, VmRSS, and the
/// ledger's and the acquirer simulator's files on disk.
fn load_sampling_rss(
    server: &ServerProc,
    conns: usize,
    duration: Duration,
    samples: u32,
) -> (Run, Vec<Value>) {
    let sample = |at: Duration| {
        json!({
            "seconds": at.as_secs_f64(),
            "charges": charges_created(server.addr, &server.key),
            "rss_kib": server.rss_kib(),
            "ledger_bytes": server.file_bytes("idem.db"),
            "acquirer_bytes": server.file_bytes("idem.db.acquirer.sqlite"),
        })
    };
    let mut taken = vec![sample(Duration::ZERO)];
    let (addr, key) = (server.addr, server.key.clone());
    let next = unique_keys(conns, false);
    let driver = std::thread::spawn(move || drive(addr, &key, conns, duration, next));
    let started = Instant::now();
    for i in 1..=samples {
        std::thread::sleep((duration * i / samples).saturating_sub(started.elapsed()));
        taken.push(sample(started.elapsed()));
    }
    (driver.join().unwrap(), taken)
}

// ---------------------------------------------------------------------------
// Storage backends: SQLite against PostgreSQL with one node and with three

/// `IDEM_BENCH_POSTGRES`: the URL of a PostgreSQL database whose user may
/// create databases (`postgres://postgres@127.0.0.1:55432/postgres`). The
/// `backends` scenario creates a database of its own from it for every
/// PostgreSQL run and drops it afterwards; it changes no setting of the
/// cluster.
fn postgres_admin() -> Option<String> {
    std::env::var("IDEM_BENCH_POSTGRES")
        .ok()
        .filter(|s| !s.is_empty())
}

fn admin_client(admin: &str) -> postgres::Client {
    postgres::Client::connect(admin, postgres::NoTls).expect("connect to IDEM_BENCH_POSTGRES")
}

/// The cluster's settings that bound a commit, as the runs found them.
fn postgres_settings(admin: &str) -> String {
    let row = admin_client(admin)
        .query_one(
            "SELECT current_setting('server_version'), current_setting('fsync'), \
             current_setting('synchronous_commit'), current_setting('wal_sync_method'), \
             current_setting('shared_buffers'), current_setting('max_connections'), \
             current_setting('commit_delay')",
            &[],
        )
        .expect("read the cluster's settings");
    let s = |i: usize| row.get::<_, String>(i);
    format!(
        "PostgreSQL {}, fsync={}, synchronous_commit={}, wal_sync_method={}, shared_buffers={}, \
         max_connections={}, commit_delay={}",
        s(0),
        s(1),
        s(2),
        s(3),
        s(4),
        s(5),
        s(6)
    )
}

/// What PostgreSQL counted for one database (`pg_stat_database`).
#[derive(Clone, Copy, Default)]
struct PgCounters {
    commits: i64,
    rollbacks: i64,
    deadlocks: i64,
}

/// A fresh PostgreSQL database for one run, and the acquirer simulator
/// file its nodes share (`--acquirer-store`); both removed on drop (the
/// database `WITH (FORCE)`, so a node still connected cannot keep it).
struct PgDatabase {
    admin: String,
    name: String,
    url: String,
    /// Holds the acquirer simulator's file.
    dir: TempDir,
}

impl PgDatabase {
    fn create(admin: &str) -> PgDatabase {
        let name = format!("idem_bench_{}", uuid::Uuid::new_v4().simple());
        admin_client(admin)
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .expect("create the bench database");
        let (base, _) = admin
            .rsplit_once('/')
            .expect("IDEM_BENCH_POSTGRES: a postgres:// URL with a database");
        PgDatabase {
            admin: admin.to_string(),
            url: format!("{base}/{name}"),
            name,
            dir: TempDir::new(),
        }
    }

    /// `idem serve` on this database; `key` for every node but the first.
    fn start_node(&self, key: Option<&str>) -> ServerProc {
        let store = self.dir.0.join("acquirer.sqlite");
        let store = store.to_str().expect("a UTF-8 temp dir");
        ServerProc::spawn(
            env!("CARGO_BIN_EXE_idem"),
            std::ffi::OsStr::new(&self.url),
            &["--acquirer-store", store],
            TempDir::new(),
            key,
        )
    }

    fn counters(&self) -> PgCounters {
        let row = admin_client(&self.admin)
            .query_one(
                "SELECT xact_commit, xact_rollback, deadlocks FROM pg_stat_database \
                 WHERE datname = $1",
                &[&self.name],
            )
            .expect("read pg_stat_database");
        PgCounters {
            commits: row.get(0),
            rollbacks: row.get(1),
            deadlocks: row.get(2),
        }
    }

    /// Per table of this database: (name, sequential scans, index scans,
    /// rows inserted, rows updated), the tables scanned at all, most
    /// sequential scans first (`pg_stat_user_tables`; complete once the
    /// backends that did them have exited). A sequential scan of a
    /// SERIALIZABLE transaction locks the whole table for SSI: any write
    /// to it by a concurrent transaction is then a read-write conflict.
    fn table_scans(&self) -> Vec<(String, i64, i64, i64, i64)> {
        let mut client = postgres::Client::connect(&self.url, postgres::NoTls)
            .expect("connect to the bench database");
        let mut tables: Vec<(String, i64, i64, i64, i64)> = client
            .query(
                "SELECT relname::text, coalesce(seq_scan, 0), coalesce(idx_scan, 0), \
                 n_tup_ins, n_tup_upd FROM pg_stat_user_tables \
                 WHERE coalesce(seq_scan, 0) + coalesce(idx_scan, 0) > 0",
                &[],
            )
            .expect("read pg_stat_user_tables")
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
            .collect();
        tables.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.cmp(&a.2)));
        tables
    }

    /// CPU time (user + system, ms) so far of each backend process serving
    /// this database, by pid (from /proc, so on this machine only).
    fn backend_cpu_ms(&self) -> BTreeMap<i32, f64> {
        admin_client(&self.admin)
            .query(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1",
                &[&self.name],
            )
            .expect("read pg_stat_activity")
            .iter()
            .filter_map(|r| {
                let pid: i32 = r.get(0);
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                Some((pid, stat_cpu_ms(&stat)?.1))
            })
            .collect()
    }

    /// Waits (at most 20 s) until no backend serves this database. A
    /// backend sends its statistics when it exits, so `pg_stat_database`
    /// is complete afterwards (a live one sends them at most once a second
    /// while busy, and only after 10 s once idle).
    fn wait_disconnected(&self) {
        let mut admin = admin_client(&self.admin);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let n: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
                    &[&self.name],
                )
                .expect("read pg_stat_activity")
                .get(0);
            if n == 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("{}: backends still connected after 20 s", self.name);
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        // Only the database this run created.
        let _ = admin_client(&self.admin).batch_execute(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ));
    }
}

/// What the backends of one database are doing, sampled from
/// `pg_stat_activity` every [`PG_SAMPLE_EVERY`] until stopped: counts of
/// "state: wait event" (an active backend with no wait event is on a CPU or
/// waiting for one) over all samples.
struct WaitSampler {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<(u64, BTreeMap<String, u64>)>,
}

const PG_SAMPLE_EVERY: Duration = Duration::from_millis(25);

impl WaitSampler {
    fn start(db: &PgDatabase) -> WaitSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let (admin, name, flag) = (db.admin.clone(), db.name.clone(), stop.clone());
        let handle = std::thread::spawn(move || {
            let mut client = admin_client(&admin);
            let statement = client
                .prepare(
                    "SELECT coalesce(state, '?'), wait_event_type, wait_event \
                     FROM pg_stat_activity WHERE datname = $1",
                )
                .unwrap();
            let (mut samples, mut seen) = (0u64, BTreeMap::new());
            while !flag.load(Ordering::Relaxed) {
                for r in client.query(&statement, &[&name]).unwrap_or_default() {
                    let (state, kind, event): (String, Option<String>, Option<String>) =
                        (r.get(0), r.get(1), r.get(2));
                    let what = match (kind, event) {
                        (Some(k), Some(e)) => format!("{state}: {k}:{e}"),
                        _ if state == "active" => "active: CPU".to_string(),
                        _ => state,
                    };
                    *seen.entry(what).or_insert(0u64) += 1;
                }
                samples += 1;
                std::thread::sleep(PG_SAMPLE_EVERY);
            }
            (samples, seen)
        });
        WaitSampler { stop, handle }
    }

    /// The mean number of backends in each state over the samples, most
    /// first.
    fn finish(self) -> Vec<(String, f64)> {
        self.stop.store(true, Ordering::Relaxed);
        let (samples, seen) = self.handle.join().unwrap();
        let mut mean: Vec<(String, f64)> = seen
            .into_iter()
            .map(|(what, n)| (what, n as f64 / samples.max(1) as f64))
            .collect();
        mean.sort_by(|a, b| b.1.total_cmp(&a.1));
        mean
    }
}

/// (busy, all) clock ticks of every CPU of the machine so far, from
/// /proc/stat; busy is all but idle and iowait.
fn machine_ticks() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let all: f64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3).copied().unwrap_or(0.0) + ticks.get(4).copied().unwrap_or(0.0);
    (all - idle, all)
}

/// This process's CPU time so far (user + system, ms): the load generator.
fn own_cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    stat_cpu_ms(&stat).map_or(0.0, |(_, ms)| ms)
}

/// Charges from `card{i}` to `shop{i}` under unique keys, or, if `hot`,
/// every one debiting `card0` (one account row that every charge updates).
fn debit_load(hot: bool) -> Next {
    let run = uuid::Uuid::new_v4().simple().to_string();
    Arc::new(move |i, n| {
        let source = if hot { 0 } else { i };
        (
            format!("{run}-{i}-{n}"),
            charge_body(1 + (n % 1000) as i64, source, i),
        )
    })
}

/// `IDEM_BENCH_BACKEND_CONNS`: the connection counts of `backends`
/// (default `64,256`).
fn backend_conns() -> Vec<usize> {
    std::env::var("IDEM_BENCH_BACKEND_CONNS")
        .unwrap_or_else(|_| "64,256".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}
/// `backends`: the nodes of its multi-node PostgreSQL runs.
const BACKEND_NODES: usize = 3;

// ---------------------------------------------------------------------------
// Scenarios

struct Bench {
    duration: Duration,
    /// Rounds of `unique` (`IDEM_BENCH_ROUNDS`, default 3).
    rounds: usize,
    results: BTreeMap<String, Value>,
}

/// The hot-key scenario: connections firing one key, and how long a loser
/// waits before it tries again (more impatient than `Retry-After: 1`).
const HOT_KEY_CONNS: usize = 64;
const LOSER_PAUSE: Duration = Duration::from_millis(10);

/// The RSS scenario: connections sending unique charges, and how many times
/// the server's RSS is sampled over the run (plus once before it).
const RSS_CONNS: usize = 16;
const RSS_SAMPLES: u32 = 12;

/// `targets`: the connections of its closed-loop rows.
const TARGET_CONNS: usize = 64;
const TARGET_WIDE_CONNS: usize = 256;
/// Open-loop senders: at 3,000 charges/s the pool runs dry only once
/// answers take longer than 85 ms (256 / 3,000 s), far past the target.
const OPEN_SENDERS: usize = 256;
/// The RSS run of `targets`: samples over the run (every 20 s of 300 s),
/// and the flatness criterion: RSS is flat when the samples taken from the
/// end of the first fifth of the run on (the last 4 minutes of 5) span less
/// than this.
const TARGET_RSS_SAMPLES: u32 = 15;
const RSS_FLAT_MIB: f64 = 4.0;

/// What a connection thread sends next: (idempotency key, body) for the
/// connection's index and its request counter.
type Next = Arc<dyn Fn(usize, u64) -> (String, String) + Send + Sync>;

impl Bench {
    /// Starts a server with `args`, creates `conns` account pairs and drives
    /// it for one run; the server stays up for checks afterwards.
    fn measure(&self, args: &[&str], conns: usize, next: Next) -> (Run, ServerProc) {
        let server = ServerProc::start(args);
        setup_accounts(server.addr, &server.key, conns);
        let (commands, commits) = commit_counters(server.addr, &server.key);
        let mut run = drive(server.addr, &server.key, conns, self.duration, next);
        let (commands_after, commits_after) = commit_counters(server.addr, &server.key);
        run.commands_per_commit = Some((commands_after - commands) / (commits_after - commits));
        (run, server)
    }

    /// `ab` (only when named): unique keys at the first of
    /// `IDEM_BENCH_UNIQUE_CONNS`, this build's server against the `idem`
    /// binary at `IDEM_BENCH_AB_BIN` (another build: the commit before a
    /// change), in `IDEM_BENCH_ROUNDS` alternating rounds, so that a busy
    /// machine slows both alike; the median of each, and their ratio.
    fn ab(&mut self) {
        let other = std::env::var("IDEM_BENCH_AB_BIN").expect("IDEM_BENCH_AB_BIN: an idem binary");
        let conns = unique_conns()[0];
        let bins = [
            ("this", env!("CARGO_BIN_EXE_idem").to_string()),
            ("other", other),
        ];
        let mut rounds: Vec<Vec<Value>> = vec![Vec::new(); 2];
        for (i, (label, bin)) in (0..self.rounds).flat_map(|_| bins.iter().enumerate()) {
            let server = ServerProc::start_bin(bin, &[]);
            setup_accounts(server.addr, &server.key, conns);
            let cpu_before = server.cpu_ms();
            let run = drive(
                server.addr,
                &server.key,
                conns,
                self.duration,
                unique_keys(conns, false),
            );
            // The server's own CPU per charge: what a build costs, whatever
            // else the machine runs meanwhile (throughput is not).
            let cpu_us = (server.cpu_ms() - cpu_before) * 1000.0 / run.ok().max(1) as f64;
            assert_one_charge_per_201(&server, &run);
            println!(
                "round: {label} {:.0}/s, {cpu_us:.0} µs CPU per charge",
                run.rate()
            );
            let mut r = row(&format!("{label}, {conns} conns"), &run, conns);
            r["server_cpu_us_per_charge"] = json!(cpu_us);
            rounds[i].push(r);
        }
        let cpu = |rs: &[Value]| {
            let mut v: Vec<f64> = rs
                .iter()
                .map(|r| r["server_cpu_us_per_charge"].as_f64().unwrap())
                .collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "\nserver CPU per charge (median): this {:.0} µs, other {:.0} µs, this/other {}",
            cpu(&rounds[0]),
            cpu(&rounds[1]),
            ratio(cpu(&rounds[0]), cpu(&rounds[1]))
        );
        // Each round's ratio: neighbours in time share the machine's load.
        let rate = |r: &Value| r["per_second"].as_f64().unwrap();
        let ratios: Vec<String> = rounds[0]
            .iter()
            .zip(&rounds[1])
            .map(|(a, b)| ratio(rate(a), rate(b)))
            .collect();
        let pair: Vec<Value> = rounds.into_iter().map(median_by_rate).collect();
        print_table("ab: this build vs IDEM_BENCH_AB_BIN, alternating", &pair);
        println!("\nthis/other per round: {}", ratios.join(" "));
        println!(
            "\nthis/other throughput: {}",
            ratio(
                pair[0]["per_second"].as_f64().unwrap(),
                pair[1]["per_second"].as_f64().unwrap()
            )
        );
        self.results.insert("ab".into(), json!({"runs": pair}));
    }

    fn unique(&mut self) {
        let mut rows = Vec::new();
        let mut summary = Vec::new();
        for conns in unique_conns() {
            let variants: [(&str, &[&str]); 2] = [
                ("group commit", &[]),
                ("batch-max 1", &["--commit-batch-max", "1"]),
            ];
            // Rounds alternate the variants, so slow spells of the shared
            // disk hit both; each variant reports its median round.
            let mut rounds: Vec<Vec<Value>> = vec![Vec::new(); variants.len()];
            for (i, (label, args)) in (0..self.rounds).flat_map(|_| variants.iter().enumerate()) {
                let (run, server) = self.measure(args, conns, unique_keys(conns, false));
                let mut r = row(&format!("{label}, {conns} conns"), &run, conns);
                r["peak_rss_kib"] = json!(server.peak_rss_kib());
                r["mean_batch"] = json!(run.commands_per_commit);
                assert_one_charge_per_201(&server, &run);
                rounds[i].push(r);
            }
            let pair: Vec<Value> = rounds.into_iter().map(median_by_rate).collect();
            rows.extend(pair.iter().cloned());
            summary.push(json!({
                "connections": conns,
                "throughput_ratio": pair[0]["per_second"].as_f64().unwrap() / pair[1]["per_second"].as_f64().unwrap(),
                "p99_ratio": pair[1]["p99_ms"].as_f64().unwrap() / pair[0]["p99_ms"].as_f64().unwrap(),
                "peak_rss_kib_group": pair[0]["peak_rss_kib"],
                "mean_batch_group": pair[0]["mean_batch"],
            }));
        }
        print_table(
            "unique keys: group commit vs --commit-batch-max 1 (same binary, same run)",
            &rows,
        );
        println!(
            "\n| conns | group/batch-1 throughput | batch-1/group p99 | peak RSS (group) | commands per commit (group) |"
        );
        println!("|---|---|---|---|---|");
        for s in &summary {
            println!(
                "| {} | {:.2}x | {:.2}x | {:.1} MiB | {:.1} |",
                s["connections"],
                s["throughput_ratio"].as_f64().unwrap(),
                s["p99_ratio"].as_f64().unwrap(),
                s["peak_rss_kib_group"].as_f64().unwrap() / 1024.0,
                s["mean_batch_group"].as_f64().unwrap_or(f64::NAN)
            );
        }
        self.results
            .insert("unique".into(), json!({"runs": rows, "summary": summary}));
    }

    /// One hot-key round: 64 connections fire one key at a fresh server
    /// whose acquirer takes 500 ms; every loser retries after 10 ms.
    fn hot_key_round(&self) -> Value {
        let server = ServerProc::start(&["--acquirer-latency", "500ms"]);
        setup_accounts(server.addr, &server.key, 1);
        let barrier = Arc::new(Barrier::new(HOT_KEY_CONNS));
        let key = uuid::Uuid::new_v4().to_string();
        let handles: Vec<_> = (0..HOT_KEY_CONNS)
            .map(|_| {
                let (barrier, key, api) = (barrier.clone(), key.clone(), server.key.clone());
                let addr = server.addr;
                std::thread::spawn(move || {
                    let mut conn = Conn::new(addr, &api);
                    let body = charge_body(500, 0, 0);
                    let mut losers = Vec::new();
                    barrier.wait();
                    loop {
                        let started = Instant::now();
                        // An unanswered connection is counted, not fatal.
                        let Ok(a) = conn.request("POST", "/v1/charges", Some(&key), &body) else {
                            return None;
                        };
                        let us = started.elapsed().as_micros() as u64;
                        match a.status {
                            409 => {
                                losers.push(us);
                                // More impatient than `Retry-After: 1`.
                                std::thread::sleep(LOSER_PAUSE);
                            }
                            201 => return Some((losers, a.replayed, a.body, us)),
                            s => panic!("hot key: unexpected {s}"),
                        }
                    }
                })
            })
            .collect();
        let answers: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let answered = answers.iter().flatten().count();
        let results: Vec<_> = answers.into_iter().flatten().collect();
        let owners = results.iter().filter(|r| !r.1).count();
        let bodies_agree = results.iter().all(|r| r.2 == results[0].2);
        let mut losers: Vec<u64> = results.iter().flat_map(|r| r.0.iter().copied()).collect();
        losers.sort_unstable();
        let charges = charge_count(server.addr, &server.key);
        let owner_ms = results
            .iter()
            .find(|r| !r.1)
            .map_or(f64::NAN, |r| r.3 as f64 / 1000.0);
        assert_eq!(answered, HOT_KEY_CONNS, "every connection got its answer");
        assert_eq!(charges, 1, "exactly one effect");
        assert_eq!(owners, 1);
        assert!(bodies_agree);
        json!({"connections": HOT_KEY_CONNS, "answered_connections": answered, "owner_ms": owner_ms,
               "losers": losers.len(), "loser_p50_ms": pct(&losers, 0.5),
               "loser_p99_ms": pct(&losers, 0.99), "loser_max_ms": pct(&losers, 1.0),
               "charges": charges, "fresh_201s": owners, "replays_agree": bodies_agree})
    }

    fn hot_key(&mut self) {
        let mut rounds: Vec<Value> = (0..self.rounds).map(|_| self.hot_key_round()).collect();
        println!(
            "\n## hot key: {HOT_KEY_CONNS} connections, one key, acquirer 500 ms, \
             each loser retries after {LOSER_PAUSE:?} ({} rounds, median last)\n",
            rounds.len()
        );
        println!("| round | conns answered | owner ms (baseline) | 409 answers | loser p50 ms | loser p99 ms | loser max ms | charges | fresh 201s | replays agree |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        let line = |name: &str, r: &Value| {
            println!(
                "| {name} | {}/{} | {:.1} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {} |",
                r["answered_connections"],
                r["connections"],
                r["owner_ms"].as_f64().unwrap_or(f64::NAN),
                r["losers"],
                r["loser_p50_ms"].as_f64().unwrap_or(f64::NAN),
                r["loser_p99_ms"].as_f64().unwrap_or(f64::NAN),
                r["loser_max_ms"].as_f64().unwrap_or(f64::NAN),
                r["charges"],
                r["fresh_201s"],
                r["replays_agree"]
            )
        };
        for (i, r) in rounds.iter().enumerate() {
            line(&(i + 1).to_string(), r);
        }
        rounds.sort_by(|a, b| {
            a["loser_p99_ms"]
                .as_f64()
                .unwrap()
                .total_cmp(&b["loser_p99_ms"].as_f64().unwrap())
        });
        let median = rounds[rounds.len() / 2].clone();
        line("median", &median);
        self.results.insert(
            "hot_key".into(),
            json!({"rounds": rounds, "median": median}),
        );
    }

    fn hot_account(&mut self) {
        const CONNS: usize = 64;
        let mut rows = Vec::new();
        for (label, hot) in [
            ("spread accounts (baseline)", false),
            ("one merchant account", true),
        ] {
            let (run, server) = self.measure(&[], CONNS, unique_keys(CONNS, hot));
            assert_one_charge_per_201(&server, &run);
            rows.push(row(label, &run, CONNS));
        }
        print_table("hot account: every charge credits one merchant", &rows);
        println!(
            "\nhot/spread throughput: {}; p99.9 hot {:.2} ms, spread {:.2} ms",
            ratio(
                rows[1]["per_second"].as_f64().unwrap(),
                rows[0]["per_second"].as_f64().unwrap()
            ),
            rows[1]["p999_ms"].as_f64().unwrap_or(f64::NAN),
            rows[0]["p999_ms"].as_f64().unwrap_or(f64::NAN),
        );
        self.results.insert("hot_account".into(), json!(rows));
    }

    /// One run of `backends`: `conns` connections of charges (unique keys,
    /// or every one debiting `card0` if `hot`) for the run's length, spread
    /// over `nodes` fresh servers: one on a fresh SQLite file if `admin` is
    /// `None`, else `nodes` on a fresh PostgreSQL database created from
    /// `admin`. Its row, with the servers' CPU per charge (all nodes), the
    /// PostgreSQL backends' CPU per charge, the machine's busy share, what
    /// PostgreSQL counted (commits and rollbacks: a serialization failure
    /// is a rollback, and its command runs again) and what its backends
    /// were doing.
    fn backend_run(&self, admin: Option<&str>, nodes: usize, conns: usize, hot: bool) -> Value {
        let db = admin.map(PgDatabase::create);
        let (servers, before) = match &db {
            None => {
                let server = ServerProc::start(&[]);
                setup_accounts(server.addr, &server.key, conns);
                (vec![server], PgCounters::default())
            }
            Some(db) => {
                // The accounts through a node of their own, gone before the
                // count starts: a live backend reports its counts late, so
                // the run's are only known once its backends have exited.
                let key = {
                    let setup = db.start_node(None);
                    setup_accounts(setup.addr, &setup.key, conns);
                    setup.key.clone()
                };
                db.wait_disconnected();
                let before = db.counters();
                let servers = (0..nodes).map(|_| db.start_node(Some(&key))).collect();
                (servers, before)
            }
        };
        let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
        let key = servers[0].key.clone();
        let idem_cpu = || servers.iter().map(ServerProc::cpu_ms).sum::<f64>();
        let pg_cpu_before = db.as_ref().map(PgDatabase::backend_cpu_ms);
        let sampler = db.as_ref().map(WaitSampler::start);
        let (idem0, own0, machine0) = (idem_cpu(), own_cpu_ms(), machine_ticks());
        let run = drive_spread(&addrs, &key, conns, self.duration, debit_load(hot));
        let (idem1, own1, machine1) = (idem_cpu(), own_cpu_ms(), machine_ticks());
        let waits = sampler.map(WaitSampler::finish);
        let pg_cpu_ms = db.as_ref().zip(pg_cpu_before).map(|(db, before)| {
            db.backend_cpu_ms()
                .iter()
                .map(|(pid, ms)| ms - before.get(pid).copied().unwrap_or(0.0))
                .sum::<f64>()
        });
        let listed = charge_count(addrs[0], &key) as u64;
        let per_charge = |ms: f64| ms * 1000.0 / run.ok().max(1) as f64;

        let backend = if db.is_some() { "PostgreSQL" } else { "SQLite" };
        let load = if hot { "hot account" } else { "unique keys" };
        let mut r = row(
            &format!("{backend}, {nodes} node(s), {load}, {conns} conns"),
            &run,
            conns,
        );
        r["backend"] = json!(backend);
        r["nodes"] = json!(nodes);
        r["load"] = json!(load);
        r["status_5xx"] = json!(run
            .tallies
            .iter()
            .flat_map(|t| t.by_status.iter())
            .filter(|(s, _)| **s >= 500)
            .map(|(_, n)| n)
            .sum::<u64>());
        r["charges_listed"] = json!(listed);
        r["idem_cpu_us_per_charge"] = json!(per_charge(idem1 - idem0));
        r["generator_cpu_us_per_charge"] = json!(per_charge(own1 - own0));
        r["machine_busy_pct"] =
            json!(100.0 * (machine1.0 - machine0.0) / (machine1.1 - machine0.1).max(1.0));
        if listed != run.ok() {
            println!(
                "  {}: {listed} charges listed for {} 2xx answers",
                r["name"].as_str().unwrap(),
                run.ok()
            );
        }
        if let Some(db) = &db {
            drop(servers);
            db.wait_disconnected();
            let after = db.counters();
            let per = |n: i64| n as f64 / run.ok().max(1) as f64;
            r["pg_cpu_us_per_charge"] = json!(per_charge(pg_cpu_ms.unwrap_or(f64::NAN)));
            r["pg_commits"] = json!(after.commits - before.commits);
            r["pg_rollbacks"] = json!(after.rollbacks - before.rollbacks);
            r["pg_deadlocks"] = json!(after.deadlocks - before.deadlocks);
            r["pg_commits_per_charge"] = json!(per(after.commits - before.commits));
            r["pg_rollbacks_per_charge"] = json!(per(after.rollbacks - before.rollbacks));
            r["pg_tables"] =
                json!(db
                .table_scans()
                .iter()
                .map(|(t, seq, idx, ins, upd)| json!({"table": t, "seq_scan": seq, "idx_scan": idx,
                                                     "inserted": ins, "updated": upd}))
                .collect::<Vec<_>>());
            let waits = waits.unwrap_or_default();
            r["pg_backends_by_state"] = json!(waits
                .iter()
                .map(|(what, mean)| json!({"state": what, "mean_backends": mean}))
                .collect::<Vec<_>>());
        }
        r
    }

    /// `backends` (only when named): SQLite (one node, the baseline), then
    /// PostgreSQL with one node and with [`BACKEND_NODES`] nodes sharing one
    /// database (connections spread over them), each at 64 and 256
    /// connections, for unique keys and for one hot account (every charge
    /// debits `card0`). Every run on a fresh database with its default
    /// flags; rounds alternate the configurations, and each cell reports
    /// its median round by throughput. Without `IDEM_BENCH_POSTGRES`, SQLite
    /// alone.
    fn backends(&mut self) {
        let admin = postgres_admin();
        let mut configs: Vec<(Option<&str>, usize)> = vec![(None, 1)];
        match &admin {
            Some(admin) => {
                configs.push((Some(admin.as_str()), 1));
                configs.push((Some(admin.as_str()), BACKEND_NODES));
            }
            None => println!(
                "\nbackends: IDEM_BENCH_POSTGRES is not set (the URL of a PostgreSQL database whose \
                 user may create databases, e.g. postgres://postgres@127.0.0.1:55432/postgres): \
                 SQLite alone"
            ),
        }
        let settings = admin.as_deref().map(postgres_settings);
        let cells: Vec<(bool, usize)> = [false, true]
            .into_iter()
            .flat_map(|hot| backend_conns().into_iter().map(move |c| (hot, c)))
            .collect();
        let mut rounds: Vec<Vec<Value>> = vec![Vec::new(); cells.len() * configs.len()];
        let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        for round in 1..=self.rounds {
            for (c, (hot, conns)) in cells.iter().enumerate() {
                for (k, (admin, nodes)) in configs.iter().enumerate() {
                    let r = self.backend_run(*admin, *nodes, *conns, *hot);
                    println!(
                        "round {round}: {}: {:.0}/s, p99 {:.1} ms, 5xx {}, idem CPU {:.0} µs/charge{}",
                        r["name"].as_str().unwrap(),
                        f(&r, "per_second"),
                        f(&r, "p99_ms"),
                        r["status_5xx"],
                        f(&r, "idem_cpu_us_per_charge"),
                        if admin.is_some() {
                            format!(
                                ", PostgreSQL CPU {:.0} µs/charge, {:.2} commits and {:.2} rollbacks per charge",
                                f(&r, "pg_cpu_us_per_charge"),
                                f(&r, "pg_commits_per_charge"),
                                f(&r, "pg_rollbacks_per_charge"),
                            )
                        } else {
                            String::new()
                        },
                    );
                    rounds[c * configs.len() + k].push(r);
                }
            }
        }
        let medians: Vec<Value> = rounds.iter().cloned().map(median_by_rate).collect();

        let flags = server_args(&[]).join(" ");
        println!(
            "\n## backends: SQLite vs PostgreSQL, one node and {BACKEND_NODES} (issue 13); {} s runs, \
             median of {} rounds by charges/s; server flags: {}\n",
            self.duration.as_secs_f64(),
            self.rounds,
            if flags.is_empty() { "defaults" } else { &flags },
        );
        if let Some(settings) = &settings {
            println!("{settings} (as found; the bench changes none)\n");
        }
        println!(
            "| backend | nodes | load | conns (answered) | charges/s | p50 ms | p99 ms | vs SQLite | 5xx | \
             idem CPU µs/charge | PostgreSQL CPU µs/charge | machine CPU busy | PG commits/charge | \
             PG rollbacks/charge | charges/s per round |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for (c, _) in cells.iter().enumerate() {
            let sqlite_rate = f(&medians[c * configs.len()], "per_second");
            for r in &medians[c * configs.len()..(c + 1) * configs.len()] {
                let pg = |k: &str, digits: usize| {
                    if r["backend"] == "PostgreSQL" {
                        format!("{:.*}", digits, f(r, k))
                    } else {
                        "–".into()
                    }
                };
                let per_round: Vec<String> = r["rounds_per_second"]
                    .as_array()
                    .map(|v| {
                        v.iter()
                            .map(|x| format!("{:.0}", x.as_f64().unwrap()))
                            .collect()
                    })
                    .unwrap_or_else(|| vec![format!("{:.0}", f(r, "per_second"))]);
                println!(
                    "| {} | {} | {} | {}/{} | {:.0} | {:.2} | {:.2} | {} | {} | {:.0} | {} | {:.0} % | {} | {} | {} |",
                    r["backend"].as_str().unwrap(),
                    r["nodes"],
                    r["load"].as_str().unwrap(),
                    r["answered_connections"],
                    r["connections"],
                    f(r, "per_second"),
                    f(r, "p50_ms"),
                    f(r, "p99_ms"),
                    ratio(f(r, "per_second"), sqlite_rate),
                    r["status_5xx"],
                    f(r, "idem_cpu_us_per_charge"),
                    pg("pg_cpu_us_per_charge", 0),
                    f(r, "machine_busy_pct"),
                    pg("pg_commits_per_charge", 2),
                    pg("pg_rollbacks_per_charge", 2),
                    per_round.join(", "),
                );
            }
        }
        println!(
            "\n(hot account: every charge debits card0; 5xx: answers of 500 and more, a command that \
             still lost its serialization race after its retries (RETRIES_MAX in \
             src/store/postgres.rs) is a 503; CPU per charge: the servers' (all nodes) \
             and their PostgreSQL backends' user+system time from /proc over the run, divided by the \
             2xx answers; machine CPU busy: all CPUs, this load generator and anything else running \
             included; commits and rollbacks: pg_stat_database of the run's database, read after its \
             nodes exited, a node's startup and background passes included)"
        );
        if admin.is_some() {
            println!(
                "\n### what the PostgreSQL backends were doing (median round; mean backends in each \
                 state, pg_stat_activity sampled every {PG_SAMPLE_EVERY:?}; `active: CPU` is running or \
                 runnable, `idle in transaction` is waiting for idem between statements)\n"
            );
            println!("| nodes | load | conns | backends by state | sequential / index scans per charge, by table |");
            println!("|---|---|---|---|---|");
            for r in medians.iter().filter(|r| r["backend"] == "PostgreSQL") {
                let states: Vec<String> = r["pg_backends_by_state"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|s| f(s, "mean_backends") >= 0.05)
                    .map(|s| {
                        format!(
                            "{} {:.1}",
                            s["state"].as_str().unwrap(),
                            f(s, "mean_backends")
                        )
                    })
                    .collect();
                let ok = f(r, "ok").max(1.0);
                let scans: Vec<String> = r["pg_tables"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|t| (f(t, "seq_scan") + f(t, "idx_scan")) / ok >= 0.05)
                    .map(|t| {
                        format!(
                            "{} {:.2}/{:.2}",
                            t["table"].as_str().unwrap(),
                            f(t, "seq_scan") / ok,
                            f(t, "idx_scan") / ok
                        )
                    })
                    .collect();
                println!(
                    "| {} | {} | {} | {} | {} |",
                    r["nodes"],
                    r["load"].as_str().unwrap(),
                    r["connections"],
                    states.join("; "),
                    scans.join("; ")
                );
            }
        }
        self.results.insert(
            "backends".into(),
            json!({"seconds": self.duration.as_secs_f64(), "rounds": self.rounds,
                   "postgres": settings, "flags": flags, "runs": medians,
                   "all_rounds": rounds}),
        );
    }

    /// Unique charges at 64 connections with one webhook endpoint subscribed
    /// to every event (a local receiver in this process) vs none, rounds
    /// alternating; and the time from each event's commit to its arrival.
    fn webhooks(&mut self) {
        const CONNS: usize = 64;
        let mut rounds: Vec<Vec<Value>> = vec![Vec::new(), Vec::new()];
        let mut arrivals = Vec::new();
        for _ in 0..self.rounds {
            for (i, subscribed) in [false, true].into_iter().enumerate() {
                let server = ServerProc::start(&[]);
                let receiver = subscribed.then(|| subscribe(&server));
                setup_accounts(server.addr, &server.key, CONNS);
                let from_ms = wall_us() / 1000;
                let run = drive(
                    server.addr,
                    &server.key,
                    CONNS,
                    self.duration,
                    unique_keys(CONNS, false),
                );
                let to_ms = wall_us() / 1000;
                assert_one_charge_per_201(&server, &run);
                let label = if subscribed {
                    "one endpoint subscribed"
                } else {
                    "no endpoint (baseline)"
                };
                let mut r = row(&format!("{label}, {CONNS} conns"), &run, CONNS);
                if let Some(receiver) = receiver {
                    receiver.report(CONNS, &run, from_ms, to_ms, &mut r);
                    arrivals.push(r.clone());
                }
                rounds[i].push(r);
            }
        }
        let pair: Vec<Value> = rounds.into_iter().map(median_by_rate).collect();
        print_table(
            "webhooks: unique charges with one subscribed endpoint vs none",
            &pair,
        );
        println!(
            "
subscribed/none throughput: {}",
            ratio(
                pair[1]["per_second"].as_f64().unwrap(),
                pair[0]["per_second"].as_f64().unwrap()
            )
        );
        println!(
            "
| round | events | delivered | drain after load s | commit→arrival p50 ms | p99 ms | max ms |"
        );
        println!("|---|---|---|---|---|---|---|");
        for (n, a) in arrivals.iter().enumerate() {
            println!(
                "| {} | {} | {} | {:.2} | {:.1} | {:.1} | {:.1} |",
                n + 1,
                a["events"],
                a["delivered"],
                a["drain_s_after_load"].as_f64().unwrap(),
                a["delivery_p50_ms"].as_f64().unwrap_or(f64::NAN),
                a["delivery_p99_ms"].as_f64().unwrap_or(f64::NAN),
                a["delivery_max_ms"].as_f64().unwrap_or(f64::NAN),
            );
        }
        println!(
            "
(commit→arrival: the receiver's clock at arrival minus the event's created_at, \
             taken just before its transaction commits, so it includes the commit itself; \
             over the events created while the load ran)"
        );
        self.results.insert(
            "webhooks".into(),
            json!({"runs": pair, "deliveries": arrivals}),
        );
    }

    /// One closed-loop run of `targets`: unique charges from `conns`
    /// connections (every one crediting `shop0` if `hot`) for the run's
    /// length at a [`Subscribed`] server with `args`. Its row, with the
    /// mean commands per commit, peak RSS, the server's CPU per charge and
    /// the webhook deliveries (after the backlog drained).
    fn subscribed_run(&self, label: &str, args: &[&str], conns: usize, hot: bool) -> Value {
        let s = Subscribed::start(args, conns);
        let (addr, key) = (s.server.addr, s.server.key.clone());
        let (commands, commits) = commit_counters(addr, &key);
        let cpu_before = s.server.cpu_ms();
        let threads_before = s.server.thread_cpu_ms();
        let from_ms = wall_us() / 1000;
        let run = drive(addr, &key, conns, self.duration, unique_keys(conns, hot));
        let to_ms = wall_us() / 1000;
        let cpu_us = (s.server.cpu_ms() - cpu_before) * 1000.0 / run.ok().max(1) as f64;
        let threads: BTreeMap<String, f64> = s
            .server
            .thread_cpu_ms()
            .into_iter()
            .map(|(t, ms)| {
                let before = threads_before.get(&t).copied().unwrap_or(0.0);
                (t, ms - before)
            })
            .collect();
        let (commands_after, commits_after) = commit_counters(addr, &key);
        let mut r = row(label, &run, conns);
        r["mean_batch"] = json!((commands_after - commands) / (commits_after - commits));
        r["peak_rss_kib"] = json!(s.server.peak_rss_kib());
        r["server_cpu_us_per_charge"] = json!(cpu_us);
        r["thread_cpu_ms"] = json!(threads);
        s.deliveries(&run, from_ms, to_ms, &mut r);
        assert_one_charge_per_201(&s.server, &run);
        r
    }

    /// One open-loop round: `rate` charges/s for the run's length from
    /// [`OPEN_SENDERS`] senders at a [`Subscribed`] server.
    fn open_round(&self, rate: f64) -> Value {
        let s = Subscribed::start(&[], OPEN_SENDERS);
        let (addr, key) = (s.server.addr, s.server.key.clone());
        let from_ms = wall_us() / 1000;
        let next = unique_keys(OPEN_SENDERS, false);
        let run = drive_open(addr, &key, OPEN_SENDERS, rate, self.duration, next);
        let to_ms = wall_us() / 1000;
        let name = format!("open loop, {rate:.0}/s offered");
        let mut r = open_row(&name, &run, OPEN_SENDERS, rate);
        r["peak_rss_kib"] = json!(s.server.peak_rss_kib());
        s.deliveries(&run, from_ms, to_ms, &mut r);
        assert_one_charge_per_201(&s.server, &run);
        r
    }

    /// `open_loop` (only when named): `IDEM_BENCH_OPEN_RATE` charges/s
    /// (default 3000) offered at a constant rate for the run's length, in
    /// `IDEM_BENCH_ROUNDS` rounds, each at a fresh server with one webhook
    /// endpoint subscribed to every event (as in `targets`); latency from
    /// each request's intended send time.
    fn open_loop(&mut self) {
        let rate = open_rate();
        let mut rows: Vec<Value> = (0..self.rounds).map(|_| self.open_round(rate)).collect();
        for (i, r) in rows.iter_mut().enumerate() {
            r["name"] = json!(format!("{}, round {}", r["name"].as_str().unwrap(), i + 1));
        }
        let med = median_row(&format!("median of {}", rows.len()), &rows);
        let mut table = rows.clone();
        table.push(med.clone());
        print_open_table(
            &format!(
                "open loop: {rate:.0} charges/s offered by {OPEN_SENDERS} senders, latency from the intended send time"
            ),
            &table,
        );
        print_deliveries(&rows);
        self.results.insert(
            "open_loop".into(),
            json!({"offered_per_second": rate, "senders": OPEN_SENDERS, "rounds": rows, "median": med}),
        );
    }

    /// The RSS row of `targets`: unique charges from [`TARGET_CONNS`]
    /// connections (full load) for `seconds` at a [`Subscribed`] server,
    /// RSS sampled [`TARGET_RSS_SAMPLES`] times. Flat: the samples from
    /// the end of the run's first fifth on span less than [`RSS_FLAT_MIB`].
    fn targets_rss(&self, seconds: f64) -> Value {
        let s = Subscribed::start(&[], TARGET_CONNS);
        let from_ms = wall_us() / 1000;
        let duration = Duration::from_secs_f64(seconds);
        let (run, samples) =
            load_sampling_rss(&s.server, TARGET_CONNS, duration, TARGET_RSS_SAMPLES);
        let to_ms = wall_us() / 1000;
        let kib = |v: &Value| v["rss_kib"].as_f64().unwrap();
        let charges = |v: &Value| v["charges"].as_f64().unwrap();
        // samples[0] is before the load, samples[i] at i/SAMPLES of it.
        let window = &samples[(TARGET_RSS_SAMPLES / 5) as usize..];
        let (lo, hi) = window
            .iter()
            .map(kib)
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), k| {
                (lo.min(k), hi.max(k))
            });
        let spread_mib = (hi - lo) / 1024.0;
        let (first, last) = (&window[0], &window[window.len() - 1]);
        let growth_kib_per_1000 =
            (kib(last) - kib(first)) / ((charges(last) - charges(first)) / 1000.0);
        let mut r = row(
            &format!("full load, {TARGET_CONNS} conns, {seconds:.0} s"),
            &run,
            TARGET_CONNS,
        );
        r["samples"] = json!(samples);
        r["window_from_s"] = first["seconds"].clone();
        r["final_rss_mib"] = json!(kib(last) / 1024.0);
        r["peak_rss_mib"] = json!(s.server.peak_rss_kib() as f64 / 1024.0);
        r["window_spread_mib"] = json!(spread_mib);
        r["window_growth_kib_per_1000_charges"] = json!(growth_kib_per_1000);
        r["flat"] = json!(spread_mib < RSS_FLAT_MIB);
        s.deliveries(&run, from_ms, to_ms, &mut r);
        assert_one_charge_per_201(&s.server, &run);
        let mib = |v: &Value| v.as_f64().unwrap() / (1024.0 * 1024.0);
        println!(
            "\n## targets, RSS: {TARGET_CONNS} connections of unique charges for {seconds:.0} s, one subscribed endpoint\n"
        );
        println!("| s | charges | RSS MiB | ledger db+wal MiB | acquirer db+wal MiB |");
        println!("|---|---|---|---|---|");
        for x in &samples {
            println!(
                "| {:.1} | {} | {:.1} | {:.1} | {:.1} |",
                x["seconds"].as_f64().unwrap(),
                x["charges"],
                kib(x) / 1024.0,
                mib(&x["ledger_bytes"]),
                mib(&x["acquirer_bytes"]),
            );
        }
        println!(
            "\nfrom {:.0} s on: RSS {:.1}–{:.1} MiB (spread {spread_mib:.1} MiB; flat means < {RSS_FLAT_MIB} MiB), \
             {growth_kib_per_1000:+.1} KiB per 1,000 charges; {:.0} charges/s",
            first["seconds"].as_f64().unwrap(),
            lo / 1024.0,
            hi / 1024.0,
            run.rate(),
        );
        r
    }

    /// `targets` (only when named): every row of issue 12's table in one
    /// run, each server with one webhook endpoint subscribed to every event
    /// at a receiver of its own. Each of `IDEM_BENCH_ROUNDS` rounds runs,
    /// in turn: group commit at 64 connections (also the spread baseline of
    /// the hot account), one merchant account at 64, `--commit-batch-max 1`
    /// at 64, group commit at 256, and the open loop; then one RSS run of
    /// `IDEM_BENCH_RSS_SECONDS` (default 300). Each measure is its median
    /// over the rounds.
    fn targets(&mut self) {
        let rate = open_rate();
        let rss_secs = rss_seconds(300.0);
        let batch1: &[&str] = &["--commit-batch-max", "1"];
        let closed: [(&str, &[&str], usize, bool); 4] = [
            ("group commit, 64 conns", &[], TARGET_CONNS, false),
            ("one merchant account, 64 conns", &[], TARGET_CONNS, true),
            ("batch-max 1, 64 conns", batch1, TARGET_CONNS, false),
            ("group commit, 256 conns", &[], TARGET_WIDE_CONNS, false),
        ];
        let mut rounds: Vec<Vec<Value>> = vec![Vec::new(); closed.len()];
        let mut open = Vec::new();
        let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        for round in 1..=self.rounds {
            for (i, (label, args, conns, hot)) in closed.iter().enumerate() {
                let r = self.subscribed_run(label, args, *conns, *hot);
                println!(
                    "round {round}: {label}: {:.0}/s, p99 {:.1} ms, p99.9 {:.1} ms; webhooks {}/{}, commit→arrival p99 {:.0} ms",
                    f(&r, "per_second"),
                    f(&r, "p99_ms"),
                    f(&r, "p999_ms"),
                    r["delivered"],
                    r["events"],
                    f(&r, "delivery_p99_ms"),
                );
                rounds[i].push(r);
            }
            let mut r = self.open_round(rate);
            r["name"] = json!(format!("{}, round {round}", r["name"].as_str().unwrap()));
            println!(
                "round {round}: open loop {rate:.0}/s offered: {:.0}/s achieved, p99 {:.1} ms, p99.9 {:.1} ms, {} late starts",
                f(&r, "per_second"),
                f(&r, "p99_ms"),
                f(&r, "p999_ms"),
                r["late_starts"],
            );
            open.push(r);
        }
        let rss = self.targets_rss(rss_secs);

        let medians: Vec<Value> = rounds.iter().cloned().map(median_by_rate).collect();
        print_table(
            "targets: closed-loop runs, one subscribed endpoint each (the median round by ok/s)",
            &medians,
        );
        let open_median = median_row(&format!("median of {}", open.len()), &open);
        let mut open_table = open.clone();
        open_table.push(open_median.clone());
        print_open_table(
            &format!("targets: open loop, {rate:.0} charges/s offered by {OPEN_SENDERS} senders"),
            &open_table,
        );
        print_thread_cpu(
            "targets: where the server's CPU goes, 64 connections, group commit (the median round)",
            &medians[0],
        );
        let mut delivered: Vec<Value> = rounds.iter().flatten().cloned().collect();
        delivered.extend(open.iter().cloned());
        delivered.push(rss.clone());
        print_deliveries(&delivered);

        // Each measure: its median over the rounds.
        let med = |rs: &[Value], k: &str| median(rs.iter().map(|r| f(r, k)).collect());
        let each = |rs: &[Value], k: &str, digits: usize| {
            rs.iter()
                .map(|r| format!("{:.*}", digits, f(r, k)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let per_round_ratio = |a: &[Value], b: &[Value]| {
            a.iter()
                .zip(b)
                .map(|(a, b)| ratio(f(a, "per_second"), f(b, "per_second")))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (g64, hot, b1, g256) = (&rounds[0], &rounds[1], &rounds[2], &rounds[3]);
        let n = self.rounds;
        let mut table: Vec<(String, String, String, bool)> = Vec::new();
        let g64_rate = med(g64, "per_second");
        table.push((
            "unique-key charges/s, 64 keep-alive connections".into(),
            "≥ 6,500".into(),
            format!(
                "{g64_rate:.0} (median of {n}: {})",
                each(g64, "per_second", 0)
            ),
            g64_rate >= 6500.0,
        ));
        let g256_rate = med(g256, "per_second");
        table.push((
            "unique-key charges/s, 256 connections".into(),
            "≥ 10,000".into(),
            format!(
                "{g256_rate:.0} (median of {n}: {})",
                each(g256, "per_second", 0)
            ),
            g256_rate >= 10_000.0,
        ));
        let b1_rate = med(b1, "per_second");
        table.push((
            "group commit vs `--commit-batch-max 1`, 64 connections (throughput ratio)".into(),
            "≥ 6×".into(),
            format!(
                "{:.2}× ({g64_rate:.0} vs {b1_rate:.0}/s; per round {})",
                g64_rate / b1_rate,
                per_round_ratio(g64, b1)
            ),
            g64_rate / b1_rate >= 6.0,
        ));
        let (open_p99, open_p999) = (med(&open, "p99_ms"), med(&open, "p999_ms"));
        table.push((
            format!(
                "open-loop: a constant {rate:.0} charges/s offered, latency from each request's intended send time"
            ),
            "p99 ≤ 10 ms, p99.9 ≤ 25 ms".into(),
            format!(
                "p99 {open_p99:.2} ms, p99.9 {open_p999:.2} ms (p99.9 per round {}; achieved {:.0}/s; late starts > {LATE:?}: {:.0} of {:.0}, {:.0} with all senders busy)",
                each(&open, "p999_ms", 2),
                med(&open, "per_second"),
                med(&open, "late_starts"),
                med(&open, "requests"),
                med(&open, "late_all_senders_busy"),
            ),
            open_p99 <= 10.0 && open_p999 <= 25.0,
        ));
        let hot_rate = med(hot, "per_second");
        let hot_p999 = med(hot, "p999_ms");
        table.push((
            "hot account (every charge credits one merchant) vs spread".into(),
            "≥ 0.9× throughput, hot p99.9 ≤ 50 ms".into(),
            format!(
                "{:.2}× ({hot_rate:.0} vs {g64_rate:.0}/s; per round {}), hot p99.9 {hot_p999:.1} ms (spread {:.1})",
                hot_rate / g64_rate,
                per_round_ratio(hot, g64),
                med(g64, "p999_ms"),
            ),
            hot_rate / g64_rate >= 0.9 && hot_p999 <= 50.0,
        ));
        let (final_mib, spread) = (f(&rss, "final_rss_mib"), f(&rss, "window_spread_mib"));
        table.push((
            format!("RSS after a {rss_secs:.0} s run at full load (64 connections)"),
            format!("< 64 MiB and flat from {:.0} s on (spread < {RSS_FLAT_MIB} MiB)", rss_secs / 5.0),
            format!(
                "{final_mib:.1} MiB (peak {:.1}); spread {spread:.1} MiB from {:.0} s on, {:+.1} KiB per 1,000 charges",
                f(&rss, "peak_rss_mib"),
                f(&rss, "window_from_s"),
                f(&rss, "window_growth_kib_per_1000_charges"),
            ),
            final_mib < 64.0 && spread < RSS_FLAT_MIB,
        ));
        let delivery_p99 = med(g64, "delivery_p99_ms");
        let (got, expected) = g64.iter().fold((0.0, 0.0), |(g, e), r| {
            (g + f(r, "delivered"), e + f(r, "events"))
        });
        table.push((
            "webhook delivery, commit → receiver, p99 under the 64-connection load".into(),
            "≤ 250 ms".into(),
            format!(
                "{delivery_p99:.0} ms (median of {n}: {}; delivered {got:.0}/{expected:.0}); \
                 for comparison, over the {rss_secs:.0} s RSS run at the same load: {:.0} ms",
                each(g64, "delivery_p99_ms", 0),
                f(&rss, "delivery_p99_ms"),
            ),
            delivery_p99 <= 250.0 && got == expected,
        ));

        let mut markdown =
            String::from("| measure | target | measured | met |\n|---|---|---|---|\n");
        for (measure, target, measured, met) in &table {
            let met = if *met { "yes" } else { "**no**" };
            markdown.push_str(&format!("| {measure} | {target} | {measured} | {met} |\n"));
        }
        let flags = server_args(&[]).join(" ");
        println!(
            "\n## targets (issue 12): {} s runs, median of {n} rounds, {} s RSS run; every server with one endpoint subscribed to every event (flags: {})\n",
            self.duration.as_secs_f64(),
            rss_secs,
            if flags.is_empty() { "defaults" } else { &flags },
        );
        print!("{markdown}");
        println!(
            "\n(flat: the RSS samples from the end of the run's first fifth on span less than {RSS_FLAT_MIB} MiB; \
             the hot account's spread baseline is the 64-connection group-commit run of the same round; \
             commit→arrival over the events created while the load ran)"
        );
        let rows: Vec<Value> = table
            .iter()
            .map(|(measure, target, measured, met)| {
                json!({"measure": measure, "target": target, "measured": measured, "met": met})
            })
            .collect();
        self.results.insert(
            "targets".into(),
            json!({
                "table": rows,
                "markdown": markdown,
                "seconds": self.duration.as_secs_f64(),
                "rounds": n,
                "flags": flags,
                "closed_loop_medians": medians,
                "closed_loop_rounds": rounds,
                "open_loop": {"offered_per_second": rate, "senders": OPEN_SENDERS,
                              "rounds": open, "median": open_median},
                "rss": rss,
            }),
        );
    }

    /// RSS over a long run of unique charges (`IDEM_BENCH_RSS_SECONDS`,
    /// default 60): the server child's VmRSS sampled from /proc at equal
    /// intervals, with the charges made so far and the size on disk of the
    /// ledger and of the acquirer simulator's file. What the server holds
    /// per charge ever made shows up as RSS growing with the charges.
    fn rss(&mut self) {
        let seconds = rss_seconds(60.0);
        let duration = Duration::from_secs_f64(seconds);
        let server = ServerProc::start(&[]);
        setup_accounts(server.addr, &server.key, RSS_CONNS);
        let (run, samples) = load_sampling_rss(&server, RSS_CONNS, duration, RSS_SAMPLES);
        assert_one_charge_per_201(&server, &run);
        let mib = |v: &Value| v.as_f64().unwrap() / (1024.0 * 1024.0);
        let flags = server_args(&[]).join(" ");
        println!(
            "\n## rss: {RSS_CONNS} connections of unique charges for {seconds} s \
             (flags: {}), server RSS sampled from /proc/PID/status\n",
            if flags.is_empty() { "defaults" } else { &flags }
        );
        println!("| s | charges | RSS MiB | ledger db+wal MiB | acquirer db+wal MiB |");
        println!("|---|---|---|---|---|");
        for s in &samples {
            println!(
                "| {:.0} | {} | {:.1} | {:.1} | {:.1} |",
                s["seconds"].as_f64().unwrap(),
                s["charges"],
                s["rss_kib"].as_f64().unwrap() / 1024.0,
                mib(&s["ledger_bytes"]),
                mib(&s["acquirer_bytes"]),
            );
        }
        // From the first sample under load (caches and pools warm) to the
        // last: what each further charge costs in RSS.
        let (first, last) = (&samples[1], &samples[samples.len() - 1]);
        let charges = last["charges"].as_f64().unwrap() - first["charges"].as_f64().unwrap();
        let grown_kib = last["rss_kib"].as_f64().unwrap() - first["rss_kib"].as_f64().unwrap();
        let per_charge = grown_kib * 1024.0 / charges;
        println!(
            "\nRSS {:.1} MiB -> {:.1} MiB over {charges:.0} more charges: {per_charge:.1} bytes per charge; \
             peak {:.1} MiB; {:.0} charges/s",
            first["rss_kib"].as_f64().unwrap() / 1024.0,
            last["rss_kib"].as_f64().unwrap() / 1024.0,
            server.peak_rss_kib() as f64 / 1024.0,
            run.rate(),
        );
        self.results.insert(
            "rss".into(),
            json!({"connections": RSS_CONNS, "seconds": seconds, "flags": flags, "samples": samples,
                   "rss_bytes_per_charge": per_charge, "peak_rss_kib": server.peak_rss_kib(),
                   "per_second": run.rate()}),
        );
    }

    /// How `--commit-batch-max` was chosen: 64 connections, unique keys.
    fn batch_sweep(&mut self) {
        const CONNS: usize = 64;
        let mut rows = Vec::new();
        for max in ["1", "4", "16", "64", "128", "512"] {
            let (run, server) = self.measure(
                &["--commit-batch-max", max],
                CONNS,
                unique_keys(CONNS, false),
            );
            assert_one_charge_per_201(&server, &run);
            rows.push(row(&format!("--commit-batch-max {max}"), &run, CONNS));
        }
        print_table("commit batch sweep: 64 connections, unique keys", &rows);
        self.results.insert("batch_sweep".into(), json!(rows));
    }

    fn retry_storm(&mut self) {
        const CONNS: usize = 64;
        let mut rows = Vec::new();
        let mut effects = (0, 0);
        for (label, storm) in [
            ("unique keys (baseline)", false),
            ("30% repeat an earlier key", true),
        ] {
            // Recently sent keys, shared by all connections: a repeat may hit
            // a completed key or one still in flight on another connection.
            let recent: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
            let counter = Arc::new(AtomicUsize::new(0));
            let run_id = uuid::Uuid::new_v4().simple().to_string();
            let next: Next = Arc::new(move |i, n| {
                let c = counter.fetch_add(1, Ordering::Relaxed);
                let mut recent = recent.lock().unwrap();
                if storm && c % 10 < 3 && !recent.is_empty() {
                    return recent[c % recent.len()].clone();
                }
                let fresh = (
                    format!("{run_id}-{i}-{n}"),
                    charge_body(1 + (n % 1000) as i64, i, i),
                );
                if recent.len() < 256 {
                    recent.push(fresh.clone());
                } else {
                    recent[c % 256] = fresh.clone();
                }
                fresh
            });
            let (run, server) = self.measure(&[], CONNS, next);
            let fresh = run.ok() - run.replays();
            let charges = charge_count(server.addr, &server.key) as u64;
            assert_eq!(
                charges, fresh,
                "each fresh 201 is one charge, replays add none"
            );
            effects = (charges, run.replays());
            let mut r = row(label, &run, CONNS);
            r["charges"] = json!(charges);
            rows.push(r);
        }
        print_table(
            "retry storm: 30% of requests repeat an earlier key (completed or in flight)",
            &rows,
        );
        println!(
            "\nstorm/baseline 2xx answers per second: {}; charges {} for {} replays",
            ratio(
                rows[1]["per_second"].as_f64().unwrap(),
                rows[0]["per_second"].as_f64().unwrap()
            ),
            effects.0,
            effects.1
        );
        self.results.insert("retry_storm".into(), json!(rows));
    }

    /// The ceiling: the same charges through the library, no HTTP, from 64
    /// threads through the same writer (group commit) — vs HTTP in this run.
    fn floor(&mut self) {
        const THREADS: usize = 64;
        let server = idem::Server::start_temporary(|_| {}).unwrap();
        let key = server.initial_key().unwrap().to_string();
        setup_accounts(server.addr(), &key, THREADS);
        let app = server.app().clone();
        let consumer = app.authenticate(key.as_bytes()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let barrier = Arc::new(Barrier::new(THREADS + 1));
        let run_id = uuid::Uuid::new_v4().simple().to_string();
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                let (app, stop, barrier, run_id) =
                    (app.clone(), stop.clone(), barrier.clone(), run_id.clone());
                std::thread::spawn(move || {
                    let mut t = Tally::default();
                    barrier.wait();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let body: Value =
                            serde_json::from_str(&charge_body(1 + (n % 1000) as i64, i, i))
                                .unwrap();
                        let req = idem::model::ChargeRequest::from_json(&body).unwrap();
                        let k = idem::idempotency::IdempotencyKey::parse(
                            format!("{run_id}-{i}-{n}").as_bytes(),
                        )
                        .unwrap();
                        n += 1;
                        let started = Instant::now();
                        let reply = app
                            .create_charge(
                                consumer,
                                k,
                                idem::idempotency::Mode::Sync,
                                &body,
                                req,
                                Default::default(),
                            )
                            .wait();
                        t.latencies_us.push(started.elapsed().as_micros() as u64);
                        *t.by_status.entry(reply.status).or_default() += 1;
                        t.answered = true;
                    }
                    t
                })
            })
            .collect();
        barrier.wait();
        let started = Instant::now();
        std::thread::sleep(self.duration);
        stop.store(true, Ordering::Relaxed);
        let floor = Run {
            tallies: handles.into_iter().map(|h| h.join().unwrap()).collect(),
            seconds: started.elapsed().as_secs_f64(),
            commands_per_commit: None,
        };
        drop(server);

        let (http, http_server) = self.measure(&[], THREADS, unique_keys(THREADS, false));
        assert_one_charge_per_201(&http_server, &http);
        let rows = vec![
            row("library, no HTTP (floor)", &floor, THREADS),
            row("HTTP, 64 keep-alive connections", &http, THREADS),
        ];
        print_table("floor: the same charges without HTTP vs over HTTP", &rows);
        println!(
            "\nHTTP/floor throughput: {}",
            ratio(http.rate(), floor.rate())
        );
        self.results.insert(
            "floor".into(),
            json!({"runs": rows, "http_over_floor": http.rate() / floor.rate()}),
        );
    }
}

fn main() {
    let selected: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let want = |name: &str| selected.is_empty() || selected.iter().any(|s| s == name);
    let seconds = std::env::var("IDEM_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let rounds = std::env::var("IDEM_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|n| *n >= 1)
        .unwrap_or(3);
    let mut bench = Bench {
        rounds,
        duration: Duration::from_secs_f64(seconds),
        results: BTreeMap::new(),
    };
    println!(
        "# idem contention bench ({seconds} s per run, {} CPUs)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if want("unique") {
        bench.unique();
    }
    if want("hot_key") {
        bench.hot_key();
    }
    if want("hot_account") {
        bench.hot_account();
    }
    if want("retry_storm") {
        bench.retry_storm();
    }
    if want("floor") {
        bench.floor();
    }
    if want("rss") {
        bench.rss();
    }
    if want("webhooks") {
        bench.webhooks();
    }
    if selected.iter().any(|s| s == "ab") {
        bench.ab();
    }
    // Not in the default set: it only re-derives the default batch size.
    if selected.iter().any(|s| s == "batch_sweep") {
        bench.batch_sweep();
    }
    // Only when named: `targets` repeats the others' measures against
    // issue 12's table (and a 5-minute RSS run); `open_loop` is one of them.
    if selected.iter().any(|s| s == "open_loop") {
        bench.open_loop();
    }
    if selected.iter().any(|s| s == "targets") {
        bench.targets();
    }
    // Only when named: it needs a PostgreSQL cluster (IDEM_BENCH_POSTGRES).
    if selected.iter().any(|s| s == "backends") {
        bench.backends();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    let out = target.join("bench");
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join("contention.json");
    std::fs::write(
        &file,
        serde_json::to_string_pretty(&json!(bench.results)).unwrap(),
    )
    .unwrap();
    println!("\nresults: {}", file.display());
}
