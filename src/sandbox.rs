//! The sandbox (`idem serve --sandbox`, [`crate::Config::sandbox`]): faults
//! on request, so that a client's retry logic can be tested offline against
//! the very failures it must survive — a decline, an acquirer outage, a slow
//! acquirer, a lost or late answer, a proxy failing after the effect, and a
//! process crash at each step of the protocol.
//!
//! A fault is asked for with the `Idem-Simulate` request header on a POST
//! (comma-separated [`Directive`]s, parsed strictly by [`Directives::parse`])
//! or scripted from Rust with [`crate::Server::simulate`] and a
//! [`Simulation`]. Either way it applies to one attempt only and never
//! enters the fingerprint: the retry without it is the same request.
//!
//! Where each directive acts:
//! - `acquirer=…` and `acquirer-latency=…`: around this attempt's acquirer
//!   call (`App::call_acquirer`); the acquirer itself is not told.
//! - `crash=after-reserve`: right after the reservation commits, before the
//!   operation is queued; `crash=after-acquirer`: right after the acquirer
//!   answered, before its recovery point; `crash=after-commit`: right after
//!   the transaction that completes the key. The owner then neither unlocks
//!   its key nor answers — exactly what a dead process leaves — so its lock
//!   goes stale and a retry after `--inflight-timeout`, or the reaper, takes
//!   it over (a new generation, without the fault) and finishes it.
//! - `response=…`: on the answer, whatever it is, once the attempt is over
//!   (`http/router.rs`), and in the connection task for `drop` and `delay`
//!   (`http/server.rs`), so a delayed answer holds no thread.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use crate::config::{parse_duration, SIMULATE_DURATION_MAX, SIMULATE_HEADER_BYTES_MAX};
use crate::error::{Error, Result};

/// The request header that asks for faults (lower case, as the engine
/// names headers).
pub const SIMULATE_HEADER: &str = "idem-simulate";

/// One fault, as the contract spells it in `Idem-Simulate`
/// ([`Directive::from_str`] and [`fmt::Display`] convert both ways).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Directive {
    /// `acquirer=decline`: the acquirer declines the authorization; the
    /// charge answers 402 `card-declined`, stored and replayed. Charges only.
    AcquirerDecline,
    /// `acquirer=unavailable`: the acquirer call fails; 503, the key is
    /// unlocked (a transient failure) and the next retry resumes at once.
    AcquirerUnavailable,
    /// `acquirer-latency=DURATION`: this attempt's acquirer call takes that
    /// much longer (within the acquirer deadline; past it, 503 as for a
    /// real acquirer that times out).
    AcquirerLatency(Duration),
    /// `response=drop`: the work commits, then the connection closes with no
    /// answer.
    ResponseDrop,
    /// `response=delay:DURATION`: the work commits, then the answer waits
    /// that long.
    ResponseDelay(Duration),
    /// `response=503`: the work commits, then the client gets 503
    /// `temporarily-unavailable`; the retry is a replay.
    Response503,
    /// `crash=after-reserve`: abandoned once the reservation committed (key
    /// in progress at its first recovery point, the acquirer not called).
    CrashAfterReserve,
    /// `crash=after-acquirer`: abandoned once the acquirer answered, before
    /// its recovery point is recorded.
    CrashAfterAcquirer,
    /// `crash=after-commit`: abandoned once the key's final answer committed.
    CrashAfterCommit,
}

/// The `directive` label values of `idem_simulated_faults_total`, in the
/// order of [`Directive::index`].
pub const DIRECTIVE_LABELS: [&str; 9] = [
    "acquirer=decline",
    "acquirer=unavailable",
    "acquirer-latency",
    "response=drop",
    "response=delay",
    "response=503",
    "crash=after-reserve",
    "crash=after-acquirer",
    "crash=after-commit",
];

impl Directive {
    /// Its position in [`DIRECTIVE_LABELS`] (the metric's label).
    pub fn index(self) -> usize {
        match self {
            Directive::AcquirerDecline => 0,
            Directive::AcquirerUnavailable => 1,
            Directive::AcquirerLatency(_) => 2,
            Directive::ResponseDrop => 3,
            Directive::ResponseDelay(_) => 4,
            Directive::Response503 => 5,
            Directive::CrashAfterReserve => 6,
            Directive::CrashAfterAcquirer => 7,
            Directive::CrashAfterCommit => 8,
        }
    }

    /// The metric label: the directive without its duration.
    pub fn label(self) -> &'static str {
        DIRECTIVE_LABELS[self.index()]
    }
}

impl FromStr for Directive {
    type Err = String;

    /// One directive, spelled exactly as the contract does (case matters);
    /// a duration is at most [`SIMULATE_DURATION_MAX`].
    fn from_str(s: &str) -> std::result::Result<Directive, String> {
        let duration = |name: &str, text: &str| -> std::result::Result<Duration, String> {
            let d = parse_duration(text).map_err(|e| format!("{name}: {e}"))?;
            if d > SIMULATE_DURATION_MAX {
                return Err(format!(
                    "{name}: '{text}' is longer than {}s",
                    SIMULATE_DURATION_MAX.as_secs()
                ));
            }
            Ok(d)
        };
        Ok(match s {
            "acquirer=decline" => Directive::AcquirerDecline,
            "acquirer=unavailable" => Directive::AcquirerUnavailable,
            "response=drop" => Directive::ResponseDrop,
            "response=503" => Directive::Response503,
            "crash=after-reserve" => Directive::CrashAfterReserve,
            "crash=after-acquirer" => Directive::CrashAfterAcquirer,
            "crash=after-commit" => Directive::CrashAfterCommit,
            _ => {
                if let Some(d) = s.strip_prefix("acquirer-latency=") {
                    Directive::AcquirerLatency(duration("acquirer-latency", d)?)
                } else if let Some(d) = s.strip_prefix("response=delay:") {
                    Directive::ResponseDelay(duration("response=delay", d)?)
                } else {
                    return Err(format!("unknown directive '{s}'"));
                }
            }
        })
    }
}

impl fmt::Display for Directive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Directive::AcquirerLatency(d) => write!(f, "acquirer-latency={}ms", d.as_millis()),
            Directive::ResponseDelay(d) => write!(f, "response=delay:{}ms", d.as_millis()),
            other => f.write_str(other.label()),
        }
    }
}

/// What the acquirer does for this attempt instead of answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcquirerFault {
    /// A decline: the final answer 402 `card-declined`.
    Decline,
    /// A failure: 503, key unlocked.
    Unavailable,
}

/// What happens to this attempt's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFault {
    /// The connection closes with no answer.
    Drop,
    /// The answer waits this long.
    Delay(Duration),
    /// 503 `temporarily-unavailable` instead of the answer.
    Unavailable,
}

/// Where a `crash=` directive abandons the attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// The reservation committed; nothing else happened.
    AfterReserve,
    /// The acquirer answered; its recovery point is not recorded.
    AfterAcquirer,
    /// The key's final answer committed; it was not sent.
    AfterCommit,
}

/// The kind of POST a directive is asked for on: which directives apply
/// depends on what the operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// `POST /v1/charges`: every directive.
    Charge,
    /// `POST /v1/charges/{id}/capture`, `…/cancel`, `…/refunds`: every
    /// directive but `acquirer=decline` (only an authorization is declined).
    Settlement,
    /// Any other POST (accounts, webhook endpoints, notification sources,
    /// inbound notifications): no acquirer and no recovery point, so
    /// `response=…` only.
    Other,
}

/// The faults of one attempt: at most one directive of each kind, checked
/// against each other. `Directives::default()` is no fault at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Directives {
    /// `acquirer=decline|unavailable`.
    pub acquirer: Option<AcquirerFault>,
    /// `acquirer-latency=DURATION`.
    pub acquirer_latency: Option<Duration>,
    /// `response=drop|delay:DURATION|503`.
    pub response: Option<ResponseFault>,
    /// `crash=after-reserve|after-acquirer|after-commit`.
    pub crash: Option<CrashPoint>,
}

impl Directives {
    /// Parses an `Idem-Simulate` value: comma-separated directives, spaces
    /// around each allowed, at most [`SIMULATE_HEADER_BYTES_MAX`] bytes.
    /// Refuses an empty value or element, an unknown directive, a bad or
    /// too long duration, a directive kind given twice and directives that
    /// contradict each other; the error names the culprit.
    pub fn parse(value: &[u8]) -> std::result::Result<Directives, String> {
        if value.len() > SIMULATE_HEADER_BYTES_MAX {
            return Err(format!(
                "Idem-Simulate: longer than {SIMULATE_HEADER_BYTES_MAX} bytes"
            ));
        }
        let text = std::str::from_utf8(value)
            .ok()
            .filter(|t| {
                t.bytes()
                    .all(|b| b == b' ' || b == b'\t' || b.is_ascii_graphic())
            })
            .ok_or("Idem-Simulate: only printable ASCII is allowed")?;
        let mut parsed = Vec::new();
        for element in text.split(',') {
            let element = element.trim_matches([' ', '\t']);
            if element.is_empty() {
                return Err("Idem-Simulate: empty directive".into());
            }
            parsed.push(
                element
                    .parse::<Directive>()
                    .map_err(|e| format!("Idem-Simulate: {e}"))?,
            );
        }
        Directives::of(&parsed).map_err(|e| format!("Idem-Simulate: {e}"))
    }

    /// The directives `list` asks for together, checked as
    /// [`Directives::parse`] checks them.
    pub fn of(list: &[Directive]) -> std::result::Result<Directives, String> {
        let mut d = Directives::default();
        for directive in list {
            let repeated = |kind: &str| format!("{kind} given twice ('{directive}')");
            match *directive {
                Directive::AcquirerDecline | Directive::AcquirerUnavailable => {
                    if d.acquirer.is_some() {
                        return Err(repeated("acquirer="));
                    }
                    d.acquirer = Some(if *directive == Directive::AcquirerDecline {
                        AcquirerFault::Decline
                    } else {
                        AcquirerFault::Unavailable
                    });
                }
                Directive::AcquirerLatency(latency) => {
                    if d.acquirer_latency.is_some() {
                        return Err(repeated("acquirer-latency="));
                    }
                    d.acquirer_latency = Some(latency);
                }
                Directive::ResponseDrop | Directive::ResponseDelay(_) | Directive::Response503 => {
                    if d.response.is_some() {
                        return Err(repeated("response="));
                    }
                    d.response = Some(match *directive {
                        Directive::ResponseDrop => ResponseFault::Drop,
                        Directive::ResponseDelay(wait) => ResponseFault::Delay(wait),
                        _ => ResponseFault::Unavailable,
                    });
                }
                Directive::CrashAfterReserve
                | Directive::CrashAfterAcquirer
                | Directive::CrashAfterCommit => {
                    if d.crash.is_some() {
                        return Err(repeated("crash="));
                    }
                    d.crash = Some(match *directive {
                        Directive::CrashAfterReserve => CrashPoint::AfterReserve,
                        Directive::CrashAfterAcquirer => CrashPoint::AfterAcquirer,
                        _ => CrashPoint::AfterCommit,
                    });
                }
            }
        }
        d.check_conflicts()?;
        Ok(d)
    }

    /// Directives that cannot both happen in one attempt.
    fn check_conflicts(&self) -> std::result::Result<(), String> {
        let Some(crash) = self.crash else {
            return Ok(());
        };
        if self.response.is_some() {
            return Err(
                "crash=… leaves no answer, so it cannot be combined with response=…".into(),
            );
        }
        let acquirer = self.acquirer.is_some() || self.acquirer_latency.is_some();
        match (crash, self.acquirer) {
            (CrashPoint::AfterReserve, _) if acquirer => Err(
                "crash=after-reserve abandons the attempt before the acquirer is called, \
                 so acquirer=… and acquirer-latency=… cannot apply"
                    .into(),
            ),
            (_, Some(AcquirerFault::Unavailable)) => Err(
                "acquirer=unavailable ends the attempt (503, key unlocked) before crash=… \
                 is reached"
                    .into(),
            ),
            (CrashPoint::AfterAcquirer, Some(AcquirerFault::Decline)) => Err(
                "acquirer=decline with crash=after-acquirer: the sandbox's decline is not \
                 remembered by the acquirer, so the takeover would be approved; use \
                 crash=after-commit to lose the stored 402"
                    .into(),
            ),
            _ => Ok(()),
        }
    }

    /// Refuses directives that cannot apply to a POST of this kind.
    pub fn check_target(&self, target: Target) -> std::result::Result<(), String> {
        if self.acquirer == Some(AcquirerFault::Decline) && target != Target::Charge {
            return Err("Idem-Simulate: acquirer=decline applies to charges only".into());
        }
        let in_attempt =
            self.acquirer.is_some() || self.acquirer_latency.is_some() || self.crash.is_some();
        if in_attempt && target == Target::Other {
            return Err(
                "Idem-Simulate: acquirer=…, acquirer-latency=… and crash=… apply to charges, \
                 captures, cancels and refunds only; this route takes response=…"
                    .into(),
            );
        }
        Ok(())
    }

    /// No fault at all.
    pub fn is_empty(&self) -> bool {
        *self == Directives::default()
    }

    /// Whether a fault acts inside the attempt (acquirer or crash), not
    /// only on its answer.
    pub fn in_attempt(&self) -> bool {
        Directives {
            response: None,
            ..*self
        } != Directives::default()
    }
}

/// Faults scripted from Rust for the next matching requests, as if each had
/// carried them in `Idem-Simulate` (build it, then hand it to
/// [`crate::Server::simulate`]):
///
/// ```no_run
/// use idem::sandbox::{Directive, Simulation};
/// let server = idem::Server::start_temporary(|c| c.sandbox = true)?;
/// // The next two charges crash after the acquirer authorised them.
/// server.simulate(
///     Simulation::new()
///         .matching("/v1/charges")
///         .times(2)
///         .fault(Directive::CrashAfterAcquirer),
/// )?;
/// # Ok::<(), idem::Error>(())
/// ```
///
/// A request matches when it is a POST that passed decoding (auth, route,
/// `Idempotency-Key`, body), carries no `Idem-Simulate` header of its own,
/// its path is the one given to [`Simulation::matching`] (a concrete path
/// such as `/v1/charges/ch_…/capture`, or a route template such as
/// `/v1/charges/{id}/capture`; any POST if not given), and its route can
/// take the faults (a crash matches no account creation). Each match uses
/// up one of [`Simulation::times`], atomically, so concurrent requests
/// never share one; scripts are tried in the order they were added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Simulation {
    path: Option<String>,
    times: u32,
    faults: Vec<Directive>,
}

impl Default for Simulation {
    fn default() -> Simulation {
        Simulation::new()
    }
}

impl Simulation {
    /// Any POST, once, with no fault yet (add them with
    /// [`Simulation::fault`]).
    pub fn new() -> Simulation {
        Simulation {
            path: None,
            times: 1,
            faults: Vec::new(),
        }
    }

    /// Only POSTs to `path`: a concrete path or a route template.
    pub fn matching(mut self, path: impl Into<String>) -> Simulation {
        self.path = Some(path.into());
        self
    }

    /// For the next `n` matching requests (default 1).
    pub fn times(mut self, n: u32) -> Simulation {
        self.times = n;
        self
    }

    /// Adds a fault; several combine as in one `Idem-Simulate` header.
    pub fn fault(mut self, directive: Directive) -> Simulation {
        self.faults.push(directive);
        self
    }
}

/// One script as kept: what is left of it.
#[derive(Debug)]
struct Script {
    path: Option<String>,
    left: u32,
    directives: Directives,
}

/// The sandbox's state in a running server: whether it is on, the scripts
/// waiting for requests, and the in-attempt faults of the attempts running
/// now, keyed by their key row and generation (so a takeover — a new
/// generation — runs without them).
#[derive(Debug, Default)]
pub struct Sandbox {
    enabled: bool,
    scripts: Mutex<VecDeque<Script>>,
    attempts: Mutex<HashMap<(i64, i64), Directives>>,
}

impl Sandbox {
    /// A sandbox, on or off.
    pub fn new(enabled: bool) -> Sandbox {
        Sandbox {
            enabled,
            ..Sandbox::default()
        }
    }

    /// Whether faults may be asked for.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Adds a script (see [`Simulation`]). Refused outside sandbox mode, for
    /// `times(0)`, no fault, faults that contradict each other, or faults
    /// the route of a concrete path or template cannot take.
    pub fn add(&self, simulation: Simulation) -> Result<()> {
        if !self.enabled {
            return Err(Error::Usage(
                "simulated faults need sandbox mode (Config::sandbox, --sandbox)".into(),
            ));
        }
        if simulation.times == 0 || simulation.faults.is_empty() {
            return Err(Error::Usage(
                "a simulation needs at least one fault and times(n) with n >= 1".into(),
            ));
        }
        let directives = Directives::of(&simulation.faults).map_err(Error::Usage)?;
        if let Some(path) = &simulation.path {
            let target = crate::http::router::post_target(path)
                .ok_or_else(|| Error::Usage(format!("no POST route matches '{path}'")))?;
            directives.check_target(target).map_err(Error::Usage)?;
        }
        self.scripts
            .lock()
            .expect("sandbox scripts")
            .push_back(Script {
                path: simulation.path,
                left: simulation.times,
                directives,
            });
        Ok(())
    }

    /// Forgets every script not used up yet.
    pub fn clear(&self) {
        self.scripts.lock().expect("sandbox scripts").clear();
    }

    /// Scripted uses not consumed yet, over all scripts.
    pub fn pending(&self) -> u64 {
        let scripts = self.scripts.lock().expect("sandbox scripts");
        scripts.iter().map(|s| u64::from(s.left)).sum()
    }

    /// Takes one use of the first script that matches a POST to `path`
    /// (whose route template is `template`) of kind `target`.
    pub fn take(&self, path: &str, template: &str, target: Target) -> Option<Directives> {
        if !self.enabled {
            return None;
        }
        let mut scripts = self.scripts.lock().expect("sandbox scripts");
        let i = scripts.iter().position(|s| {
            s.path.as_deref().is_none_or(|p| p == path || p == template)
                && s.directives.check_target(target).is_ok()
        })?;
        let script = &mut scripts[i];
        script.left -= 1;
        let directives = script.directives;
        if script.left == 0 {
            scripts.remove(i);
        }
        Some(directives)
    }

    /// Registers the in-attempt faults of the attempt that owns key row
    /// `key_id` at `generation`, for as long as the returned guard lives.
    pub(crate) fn register(
        self: &std::sync::Arc<Self>,
        key_id: i64,
        generation: i64,
        directives: Directives,
    ) -> Registered {
        self.attempts
            .lock()
            .expect("sandbox attempts")
            .insert((key_id, generation), directives);
        Registered {
            sandbox: std::sync::Arc::clone(self),
            at: (key_id, generation),
        }
    }

    /// The in-attempt faults of the owner of `key_id` at `generation`.
    pub(crate) fn of(&self, key_id: i64, generation: i64) -> Directives {
        if !self.enabled {
            return Directives::default();
        }
        self.attempts
            .lock()
            .expect("sandbox attempts")
            .get(&(key_id, generation))
            .copied()
            .unwrap_or_default()
    }
}

/// An attempt's faults, registered until dropped (when its operation ends,
/// or is dropped unrun by a stopping pool).
pub(crate) struct Registered {
    sandbox: std::sync::Arc<Sandbox>,
    at: (i64, i64),
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Ok(mut attempts) = self.sandbox.attempts.lock() {
            attempts.remove(&self.at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_parse_strictly() {
        let ok = Directives::parse(b"acquirer-latency=250ms, response=delay:2s").unwrap();
        assert_eq!(ok.acquirer_latency, Some(Duration::from_millis(250)));
        assert_eq!(
            ok.response,
            Some(ResponseFault::Delay(Duration::from_secs(2)))
        );
        for bad in [
            "",
            " ",
            "crash",
            "crash=later",
            "Crash=after-commit",
            "acquirer=decline,",
            ",acquirer=decline",
            "acquirer=decline,,response=503",
            "acquirer=decline,acquirer=unavailable",
            "response=drop,response=drop",
            "response=delay:61s",
            "response=delay:5",
            "response=delay:-1s",
            "acquirer-latency=1.5s",
            "acquirer-latency=2m",
            "crash=after-commit,response=drop",
            "crash=after-reserve,acquirer-latency=1s",
            "crash=after-acquirer,acquirer=unavailable",
            "crash=after-acquirer,acquirer=decline",
            "response=d\u{e9}lai",
        ] {
            assert!(Directives::parse(bad.as_bytes()).is_err(), "{bad:?}");
        }
        let long = format!("response=503{}", " ".repeat(SIMULATE_HEADER_BYTES_MAX));
        assert!(Directives::parse(long.as_bytes()).is_err());
    }

    #[test]
    fn directives_print_as_they_parse() {
        for text in [
            "acquirer=decline",
            "acquirer=unavailable",
            "acquirer-latency=1500ms",
            "response=drop",
            "response=delay:60000ms",
            "response=503",
            "crash=after-reserve",
            "crash=after-acquirer",
            "crash=after-commit",
        ] {
            let d: Directive = text.parse().unwrap();
            assert_eq!(d.to_string(), text);
            assert_eq!(DIRECTIVE_LABELS[d.index()], d.label());
        }
    }

    #[test]
    fn targets_limit_directives() {
        let decline = Directives::parse(b"acquirer=decline").unwrap();
        assert!(decline.check_target(Target::Charge).is_ok());
        assert!(decline.check_target(Target::Settlement).is_err());
        let crash = Directives::parse(b"crash=after-commit").unwrap();
        assert!(crash.check_target(Target::Settlement).is_ok());
        assert!(crash.check_target(Target::Other).is_err());
        let drop = Directives::parse(b"response=drop").unwrap();
        assert!(drop.check_target(Target::Other).is_ok());
        assert!(!drop.in_attempt() && crash.in_attempt());
    }

    #[test]
    fn scripts_are_used_up_in_order() {
        let sandbox = Sandbox::new(true);
        let crash = Simulation::new()
            .matching("/v1/charges")
            .times(2)
            .fault(Directive::CrashAfterAcquirer);
        sandbox.add(crash).unwrap();
        sandbox
            .add(Simulation::new().fault(Directive::ResponseDrop))
            .unwrap();
        assert_eq!(sandbox.pending(), 3);
        let account = sandbox.take("/v1/accounts", "/v1/accounts", Target::Other);
        assert_eq!(account.unwrap().response, Some(ResponseFault::Drop));
        for _ in 0..2 {
            let d = sandbox.take("/v1/charges", "/v1/charges", Target::Charge);
            assert_eq!(d.unwrap().crash, Some(CrashPoint::AfterAcquirer));
        }
        assert_eq!(
            sandbox.take("/v1/charges", "/v1/charges", Target::Charge),
            None
        );
        assert!(Sandbox::new(false)
            .add(Simulation::new().fault(Directive::Response503))
            .is_err());
        assert!(sandbox.add(Simulation::new()).is_err());
        let crash_account = Simulation::new()
            .matching("/v1/accounts")
            .fault(Directive::CrashAfterCommit);
        assert!(sandbox.add(crash_account).is_err());
    }
}
