//! The application: what each API operation does, as synchronous functions
//! from validated input to a [`Reply`]. This is where the idempotency
//! protocol's steps run in order — reserve, pre-check, call the acquirer,
//! record the recovery point, apply the ledger phase — each write through the
//! writer thread and each read through the reader pool.
//!
//! The same [`App::run_operation`] finishes an operation for the request that
//! reserved it, for a request that took an orphan over, for the async pool,
//! and for the reaper: there is one way to resume from a recovery point.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use serde::Serialize;
use serde_json::Value;

use crate::acquirer::Acquirer;
use crate::api::{Answer, Deliver, Problem, Reply};
use crate::config::{
    Config, FaultPoint, ACQUIRER_OVERRUN_TOLERANCE, OPERATION_QUEUE_LEN_MAX, OPERATION_THREADS,
    RESERVATION_QUEUE_LEN_MAX, RESERVATION_THREADS,
};
use crate::consumers;
use crate::error::{Error, Result};
use crate::idempotency::{
    self, Attempt, Fingerprint, IdempotencyKey, KeyRow, KeyState, Mode, Owner, RecoveryPoint,
    Reservation, Scope, StoredResponse, Timeouts,
};
use crate::ledger::{self, AccountOutcome, ChargeOutcome, Origin, RefundOutcome, UnknownCursor};
use crate::metrics::Metrics;
use crate::model::{AccountRequest, ChargeRequest, ListObject, Operation, Page, RefundRequest};
use crate::pool::{Pool, Task};
use crate::store::{Readers, Writer};
use crate::time::now_ms;

pub struct App {
    pub config: Config,
    pub metrics: Arc<Metrics>,
    writer: Writer,
    readers: Readers,
    acquirer: Arc<dyn Acquirer>,
    /// Key hash → consumer id. Consumers are never deleted, so a positive
    /// answer stays true; unknown keys are looked up every time.
    consumers: RwLock<HashMap<[u8; 32], i64>>,
    /// Short write tasks (a reservation, an account without key), off the
    /// HTTP workers.
    reservations: Pool,
    /// Owned operations (acquirer, recovery point, ledger phase).
    operations: Pool,
    /// Itself, for the tasks it hands to its pools.
    me: Weak<App>,
}

/// The reservation step's result, with the inline case (accounts and
/// refunds need no acquirer, so a synchronous one completes in the same
/// transaction that reserved its key).
enum Reserved {
    Done {
        stored: StoredResponse,
        took_over: bool,
    },
    Pending(Reservation),
}

#[derive(Serialize)]
struct OperationObject<'a> {
    id: &'a str,
    object: &'static str,
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<OperationResponse>,
}

#[derive(Serialize)]
struct OperationResponse {
    status: u16,
    /// The stored answer's bytes, embedded as they are.
    body: Box<serde_json::value::RawValue>,
}

impl App {
    pub fn start(
        config: Config,
        writer: Writer,
        readers: Readers,
        acquirer: Arc<dyn Acquirer>,
        metrics: Arc<Metrics>,
    ) -> Arc<App> {
        Arc::new_cyclic(|me| App {
            config,
            metrics,
            writer,
            readers,
            acquirer,
            consumers: RwLock::new(HashMap::new()),
            reservations: Pool::start("reserve", RESERVATION_THREADS, RESERVATION_QUEUE_LEN_MAX),
            operations: Pool::start("op", OPERATION_THREADS, OPERATION_QUEUE_LEN_MAX),
            me: me.clone(),
        })
    }

    /// Runs queued reservations and operations, stops their threads, then
    /// stops the writer (which checkpoints).
    pub fn stop(&self) {
        self.reservations.stop();
        self.operations.stop();
        self.writer.stop();
    }

    fn me(&self) -> Arc<App> {
        self.me.upgrade().expect("the app outlives its requests")
    }

    fn timeouts(&self) -> Timeouts {
        Timeouts {
            inflight: self.config.inflight_timeout,
            retention: self.config.key_retention,
        }
    }

    fn fault(&self, point: FaultPoint) {
        if self.config.fault == Some(point) {
            eprintln!("idem: fault point {point:?} reached, aborting");
            std::process::abort();
        }
    }

    // -----------------------------------------------------------------------
    // Consumers

    /// The consumer whose secret key is `token`.
    pub fn authenticate(&self, token: &[u8]) -> Result<i64, Problem> {
        let hash = consumers::hash_key(token);
        if let Some(id) = self.consumers.read().expect("auth cache").get(&hash) {
            return Ok(*id);
        }
        let found = self
            .readers
            .read(|c| consumers::authenticate(c, &hash))
            .map_err(Problem::from)?;
        let id = found.ok_or(Problem::Unauthorized)?;
        self.consumers.write().expect("auth cache").insert(hash, id);
        Ok(id)
    }

    /// Creates the consumer `name` if there is no consumer at all, in one
    /// write transaction, and returns its key; `None` if one existed.
    pub fn create_first_consumer(&self, name: &str) -> Result<Option<String>> {
        let name = name.to_string();
        self.writer.call(move |tx| {
            if consumers::count(tx)? > 0 {
                return Ok(None);
            }
            consumers::create(tx, &name).map(|(_, key)| Some(key))
        })
    }

    pub fn create_consumer(&self, name: &str) -> Result<String> {
        let name = name.to_string();
        self.writer
            .call(move |tx| consumers::create(tx, &name))
            .map(|(_, key)| key)
    }

    // -----------------------------------------------------------------------
    // Writes

    pub fn create_account(
        &self,
        consumer: i64,
        key: Option<IdempotencyKey>,
        mode: Mode,
        body: &Value,
        req: AccountRequest,
    ) -> Answer {
        match key {
            Some(key) => self.idempotent(
                consumer,
                "/v1/accounts".into(),
                key,
                mode,
                idempotency::fingerprint(body),
                Operation::Account(req),
            ),
            // No key: the natural id (if any) is the only protection, and
            // the work is one transaction, so there is nothing to track.
            None => self.later(move |app, deliver| {
                let created = app.writer.call(move |tx| {
                    ledger::create_account(tx, consumer, &req, now_ms()).map(account_response)
                });
                deliver(match created {
                    Ok(stored) => Reply::stored(stored, false),
                    Err(e) => Problem::from(e).reply(),
                })
            }),
        }
    }

    pub fn create_charge(
        &self,
        consumer: i64,
        key: IdempotencyKey,
        mode: Mode,
        body: &Value,
        req: ChargeRequest,
    ) -> Answer {
        let fp = idempotency::fingerprint(body);
        self.idempotent(
            consumer,
            "/v1/charges".into(),
            key,
            mode,
            fp,
            Operation::Charge(req),
        )
    }

    pub fn create_refund(
        &self,
        consumer: i64,
        key: IdempotencyKey,
        mode: Mode,
        body: &Value,
        req: RefundRequest,
    ) -> Answer {
        let path = format!("/v1/charges/{}/refunds", req.charge);
        let fp = idempotency::fingerprint(body);
        self.idempotent(consumer, path, key, mode, fp, Operation::Refund(req))
    }

    /// Steps 4–5 of the protocol: reserve the key (or learn why not) in one
    /// write transaction, then answer or do the work.
    fn idempotent(
        &self,
        consumer: i64,
        path: String,
        key: IdempotencyKey,
        mode: Mode,
        fp: Fingerprint,
        op: Operation,
    ) -> Answer {
        let attempt = Attempt {
            scope: Scope {
                consumer_id: consumer,
                method: "POST",
                path,
            },
            key,
            fingerprint: fp,
            request_json: serde_json::to_string(&op).expect("serialisable operation"),
            mode,
            reference: match &op {
                Operation::Charge(c) => c.reference.clone(),
                _ => None,
            },
        };
        let inline = mode == Mode::Sync && !matches!(op, Operation::Charge(_));
        let t = self.timeouts();
        // Duplicates are answered from a reader, never queued behind writes.
        let seen = self
            .readers
            .read(|c| idempotency::load(c, &attempt.scope, &attempt.key));
        let settled = seen
            .ok()
            .and_then(|row| idempotency::settle(row.as_ref(), &attempt, now_ms(), t));
        match settled {
            Some(answer) => Answer::Now(self.answer(Ok(Reserved::Pending(answer)), mode)),
            // Everything that writes runs on the reservation pool, then the
            // operation pool: no HTTP worker waits for the writer or the
            // acquirer.
            None => {
                self.later(move |app, deliver| app.reserve_and_run(attempt, op, inline, deliver))
            }
        }
    }

    /// Runs `task` on the reservation pool; the HTTP layer awaits its
    /// reply. A full queue answers 503 (nothing has been reserved yet).
    fn later(&self, task: impl FnOnce(&App, Deliver) + Send + 'static) -> Answer {
        let me = self.me();
        Answer::Later(Box::new(move |deliver| {
            let app = Arc::clone(&me);
            let task: Task = Box::new(move |deliver| task(&app, deliver));
            if let Err(deliver) = me.reservations.submit(task, deliver) {
                let why = "reservation queue is full".to_string();
                deliver(Problem::TemporarilyUnavailable(why).reply());
            }
        }))
    }

    /// Steps 4–5 on a reservation thread: reserve; when this request owns
    /// the key, hand the operation to the operation pool. Async mode answers
    /// 202 once the operation is queued.
    fn reserve_and_run(&self, attempt: Attempt, op: Operation, inline: bool, deliver: Deliver) {
        let mode = attempt.mode;
        match self.reserve(attempt, op, inline) {
            Ok(Reserved::Pending(Reservation::Owned { row, took_over })) => {
                if took_over {
                    self.metrics.orphans_taken_over.inc();
                }
                self.run_owned(row, mode, deliver);
            }
            other => deliver(self.answer(other, mode)),
        }
    }

    /// Queues an owned operation on the operation pool. If it cannot be
    /// queued, the key is unlocked and the client told 503.
    fn run_owned(&self, row: KeyRow, mode: Mode, deliver: Deliver) {
        let owner = row.owner();
        let me = self.me();
        let task: Task = Box::new(move |d| d(me.run_operation_guarded(row)));
        let refused = match mode {
            Mode::Sync => self.operations.submit(task, deliver).err(),
            // Nobody waits for the reply: the stored answer is the result.
            Mode::Async => match self.operations.submit(task, Box::new(|_| {})) {
                Ok(()) => {
                    deliver(accepted(&owner.op_id));
                    None
                }
                Err(_) => Some(deliver),
            },
        };
        if let Some(deliver) = refused {
            deliver(self.give_up(&owner, Error::Unavailable("operation queue is full")));
        }
    }

    /// The write half of step 4: reserve (or take over) in the writer, and
    /// for an inline operation apply it in the same transaction.
    fn reserve(&self, attempt: Attempt, op: Operation, inline: bool) -> Result<Reserved> {
        let t = self.timeouts();
        self.writer.call(move |tx| {
            let now = now_ms();
            let r = idempotency::reserve(tx, &attempt, now, t)?;
            match r {
                Reservation::Owned { row, took_over } if inline => {
                    let owner = row.owner();
                    let stored = apply_local(tx, &owner, &op, now)?;
                    let completed = idempotency::complete(tx, &owner, &stored, now)?;
                    assert!(completed, "the key was reserved in this transaction");
                    Ok(Reserved::Done { stored, took_over })
                }
                other => Ok(Reserved::Pending(other)),
            }
        })
    }

    /// The reply to a reservation that leaves nothing to run.
    fn answer(&self, reserved: Result<Reserved>, mode: Mode) -> Reply {
        match reserved {
            Err(e) => Problem::from(e).reply(),
            Ok(Reserved::Done { stored, took_over }) => {
                if took_over {
                    self.metrics.orphans_taken_over.inc();
                }
                Reply::stored(stored, false)
            }
            Ok(Reserved::Pending(Reservation::Replay(stored))) => {
                self.metrics.idempotent_replays.inc();
                Reply::stored(stored, true)
            }
            Ok(Reserved::Pending(Reservation::Reused)) => {
                self.metrics.conflicts_reused.inc();
                Problem::IdempotencyKeyReused.reply()
            }
            Ok(Reserved::Pending(Reservation::Busy { op_id })) => self.busy(&op_id, mode),
            Ok(Reserved::Pending(Reservation::ReferenceBusy)) => {
                self.metrics.conflicts_reference_in_use.inc();
                Problem::ReferenceInUse.reply()
            }
            Ok(Reserved::Pending(Reservation::Owned { .. })) => {
                unreachable!("an owned reservation is run, not answered")
            }
        }
    }

    /// Someone alive owns the key: 409 at once (sync) or 202 (async).
    fn busy(&self, op_id: &str, mode: Mode) -> Reply {
        match mode {
            Mode::Sync => {
                self.metrics.conflicts_in_use.inc();
                Problem::IdempotencyKeyInUse.reply()
            }
            Mode::Async => accepted(op_id),
        }
    }

    /// [`App::run_operation`], but a panic (a bug) unlocks the key so that
    /// the next retry resumes from its recovery point, and answers 500.
    fn run_operation_guarded(&self, row: KeyRow) -> Reply {
        let owner = row.owner();
        catch_unwind(AssertUnwindSafe(|| self.run_operation(row))).unwrap_or_else(|_| {
            log::error!("operation {} panicked; key unlocked", owner.op_id);
            let _ = self.writer.call(move |tx| idempotency::unlock(tx, &owner));
            Problem::Internal.reply()
        })
    }

    /// Drives an owned operation from its recovery point to its final answer.
    pub fn run_operation(&self, row: KeyRow) -> Reply {
        let owner = row.owner();
        let op: Operation = match serde_json::from_str(&row.request) {
            Ok(op) => op,
            Err(e) => {
                log::error!("operation {} has an unreadable request: {e}", owner.op_id);
                return Problem::Internal.reply();
            }
        };
        match op {
            Operation::Charge(req) => {
                let fp: Fingerprint = row
                    .fingerprint
                    .as_slice()
                    .try_into()
                    .expect("fingerprints are 32 bytes");
                let authorization = match row.recovery_point {
                    RecoveryPoint::Authorized => row.authorization.clone().unwrap_or_default(),
                    RecoveryPoint::Reserved => {
                        match self.authorize(&owner, row.locked_at_ms, &req, &fp) {
                            Ok(auth) => auth,
                            Err(reply) => return reply,
                        }
                    }
                };
                if let Some(hook) = &self.config.hooks.before_ledger_phase {
                    hook(&owner.op_id);
                }
                self.ledger_phase(owner, move |tx, o, now| {
                    let origin = Origin {
                        op_id: &o.op_id,
                        key: &o.key,
                    };
                    ledger::apply_charge(tx, o.consumer_id, &req, &fp, &origin, &authorization, now)
                        .map(charge_response)
                })
            }
            op => self.ledger_phase(owner, move |tx, o, now| apply_local(tx, o, &op, now)),
        }
    }

    /// The steps between reservation and the ledger phase of a charge: the
    /// pre-check (a final outcome needs no acquirer), the acquirer call
    /// within its deadline and its recovery point. `locked_at_ms` is when
    /// `owner`'s lock was taken. `Err` is the reply to give instead.
    fn authorize(
        &self,
        owner: &Owner,
        locked_at_ms: i64,
        req: &ChargeRequest,
        fp: &Fingerprint,
    ) -> Result<String, Reply> {
        let consumer = owner.consumer_id;
        match self
            .readers
            .read(|c| ledger::precheck_charge(c, consumer, req, fp))
        {
            Err(e) => return Err(self.give_up(owner, e)),
            Ok(Some(outcome)) => {
                let stored = charge_response(outcome);
                return Err(self.ledger_phase(owner.clone(), move |_, _, _| Ok(stored)));
            }
            Ok(None) => {}
        }
        self.fault(FaultPoint::AfterReserve);
        let Some(deadline) = self.acquirer_deadline(locked_at_ms) else {
            let why = "the operation waited past its acquirer deadline before calling".into();
            return Err(self.give_up(owner, Error::Acquirer(why)));
        };
        let called =
            self.acquirer
                .authorize(&owner.op_id, req.amount, req.currency.as_str(), deadline);
        let overrun = Instant::now().saturating_duration_since(deadline);
        if overrun > ACQUIRER_OVERRUN_TOLERANCE {
            log::warn!(
                "operation {}: the acquirer answered {overrun:?} past its deadline",
                owner.op_id
            );
        }
        let auth = match called {
            Ok(auth) => auth,
            Err(e) => return Err(self.give_up(owner, Error::Acquirer(e.0))),
        };
        self.fault(FaultPoint::AfterAcquirer);
        let o = owner.clone();
        let auth_id = auth.id.clone();
        match self
            .writer
            .call(move |tx| idempotency::record_authorization(tx, &o, &auth_id, now_ms()))
        {
            Ok(true) => {}
            Ok(false) => return Err(self.lost(owner)),
            Err(e) => return Err(self.give_up(owner, e)),
        }
        self.fault(FaultPoint::AfterRecoveryPoint);
        Ok(auth.id)
    }

    /// When the acquirer call of an owner whose lock was taken at
    /// `locked_at_ms` must answer: `--acquirer-timeout` after the lock, not
    /// after the call starts, so that time spent in the operation queue
    /// counts too and the owner reaches its recovery point with the rest of
    /// the in-flight timeout to spare. `None`: that time has already passed.
    fn acquirer_deadline(&self, locked_at_ms: i64) -> Option<Instant> {
        let since_lock = u64::try_from(now_ms().saturating_sub(locked_at_ms)).unwrap_or(0);
        let left = self
            .config
            .effective_acquirer_timeout()
            .checked_sub(Duration::from_millis(since_lock))
            .filter(|left| !left.is_zero())?;
        Some(Instant::now() + left)
    }

    /// Commits `effect` and the stored answer together, if `owner` still
    /// holds its key (the fencing check); answers like a later duplicate if
    /// it was taken over meanwhile.
    fn ledger_phase<F>(&self, owner: Owner, effect: F) -> Reply
    where
        F: FnOnce(&Connection, &Owner, i64) -> Result<StoredResponse> + Send + 'static,
    {
        let o = owner.clone();
        let committed = self.writer.call(move |tx| {
            if !idempotency::holds(tx, &o)? {
                return Ok(None);
            }
            let now = now_ms();
            let stored = effect(tx, &o, now)?;
            let completed = idempotency::complete(tx, &o, &stored, now)?;
            assert!(completed, "fence checked in this transaction");
            Ok(Some(stored))
        });
        match committed {
            Ok(Some(stored)) => {
                self.fault(FaultPoint::AfterCommit);
                Reply::stored(stored, false)
            }
            Ok(None) => self.lost(&owner),
            Err(e) => self.give_up(&owner, e),
        }
    }

    /// An owner that was fenced off answers like any later duplicate.
    fn lost(&self, owner: &Owner) -> Reply {
        let id = owner.key_id;
        match self.readers.read(|c| idempotency::load_by_id(c, id)) {
            Ok(Some(row)) if row.state == KeyState::Completed && row.op_id == owner.op_id => {
                self.metrics.idempotent_replays.inc();
                Reply::stored(row.response.expect("completed rows have a response"), true)
            }
            Ok(_) => self.busy(&owner.op_id, Mode::Sync),
            Err(e) => Problem::from(e).reply(),
        }
    }

    /// A transient failure: unlock the key so the next retry resumes at once
    /// from its recovery point, and answer 503 (500 for a bug).
    fn give_up(&self, owner: &Owner, e: Error) -> Reply {
        log::warn!("operation {} failed: {e}", owner.op_id);
        let o = owner.clone();
        if let Err(unlock) = self.writer.call(move |tx| idempotency::unlock(tx, &o)) {
            log::warn!("cannot unlock {}: {unlock}", owner.op_id);
        }
        Problem::from(e).reply()
    }

    // -----------------------------------------------------------------------
    // Reads

    fn read<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<Option<T>>,
        render: impl FnOnce(T) -> Reply,
    ) -> Reply {
        match self.readers.read(f) {
            Ok(Some(v)) => render(v),
            Ok(None) => Problem::NotFound.reply(),
            Err(e) => Problem::from(e).reply(),
        }
    }

    pub fn get_account(&self, consumer: i64, id: &str) -> Reply {
        self.read(
            |c| ledger::find_account(c, consumer, id),
            |a| Reply::json(200, &a.object()),
        )
    }

    pub fn list_entries(&self, consumer: i64, account: &str, page: &Page) -> Reply {
        self.read(
            |c| match ledger::find_account(c, consumer, account)? {
                None => Ok(None),
                Some(a) => ledger::list_entries(c, &a, page).map(Some),
            },
            list_reply,
        )
    }

    pub fn get_charge(&self, consumer: i64, id: &str) -> Reply {
        self.read(
            |c| ledger::get_charge(c, consumer, id),
            |ch| Reply::json(200, &ch),
        )
    }

    pub fn list_charges(&self, consumer: i64, page: &Page) -> Reply {
        self.read(
            |c| ledger::list_charges(c, consumer, page).map(Some),
            list_reply,
        )
    }

    pub fn get_operation(&self, consumer: i64, op_id: &str) -> Reply {
        self.read(
            |c| idempotency::load_operation(c, consumer, op_id),
            |row| Reply::json(200, &operation_object(&row)),
        )
    }

    // -----------------------------------------------------------------------
    // For the reaper

    /// In-progress keys silent for longer than the in-flight timeout.
    pub fn orphans(&self, limit: usize) -> Result<Vec<i64>> {
        let cutoff = now_ms() - self.config.inflight_timeout.as_millis() as i64;
        self.readers
            .read(|c| idempotency::orphans(c, cutoff, limit))
    }

    /// Takes the orphan `id` over and finishes it; false if it was no longer
    /// an orphan (a client's retry got there first).
    pub fn complete_orphan(&self, id: i64) -> Result<bool> {
        let inflight = self.config.inflight_timeout;
        let row = self
            .writer
            .call(move |tx| idempotency::take_over_orphan(tx, id, now_ms(), inflight))?;
        let Some(row) = row else {
            return Ok(false);
        };
        self.metrics.orphans_taken_over.inc();
        let op_id = row.op_id.clone();
        let reply = self.run_operation_guarded(row);
        log::info!("reaper completed orphan {op_id}: {}", reply.status);
        Ok(true)
    }

    /// Deletes one batch of completed keys past retention.
    pub fn delete_expired(&self, batch: usize) -> Result<usize> {
        let cutoff = now_ms() - self.config.key_retention.as_millis() as i64;
        let n = self
            .writer
            .call(move |tx| idempotency::delete_expired(tx, cutoff, batch))?;
        self.metrics.keys_reaped.add(n as u64);
        Ok(n)
    }
}

fn accepted(op_id: &str) -> Reply {
    let body = OperationObject {
        id: op_id,
        object: "operation",
        status: "in_progress",
        response: None,
    };
    Reply::json(202, &body).header("location", format!("/v1/operations/{op_id}"))
}

fn operation_object(row: &KeyRow) -> OperationObject<'_> {
    OperationObject {
        id: &row.op_id,
        object: "operation",
        status: match row.state {
            KeyState::InProgress => "in_progress",
            KeyState::Completed => "completed",
        },
        response: row.response.as_ref().map(|r| OperationResponse {
            status: r.status,
            body: String::from_utf8(r.body.clone())
                .ok()
                .and_then(|s| serde_json::value::RawValue::from_string(s).ok())
                .expect("stored bodies are JSON"),
        }),
    }
}

fn list_reply<T: Serialize>(list: std::result::Result<ListObject<T>, UnknownCursor>) -> Reply {
    match list {
        Ok(list) => Reply::json(200, &list),
        Err(UnknownCursor) => {
            Problem::InvalidRequest("starting_after: no such object in this list".into()).reply()
        }
    }
}

/// Applies an operation that needs no acquirer (account, refund) and renders
/// its answer.
fn apply_local(tx: &Connection, owner: &Owner, op: &Operation, now: i64) -> Result<StoredResponse> {
    match op {
        Operation::Account(req) => {
            ledger::create_account(tx, owner.consumer_id, req, now).map(account_response)
        }
        Operation::Refund(req) => {
            let origin = Origin {
                op_id: &owner.op_id,
                key: &owner.key,
            };
            ledger::apply_refund(tx, owner.consumer_id, req, &origin, now).map(refund_response)
        }
        Operation::Charge(_) => unreachable!("charges go through the acquirer"),
    }
}

fn problem_response(p: Problem) -> StoredResponse {
    StoredResponse {
        status: p.status(),
        body: p.body(),
    }
}

fn json_response(status: u16, body: &impl Serialize) -> StoredResponse {
    StoredResponse {
        status,
        body: serde_json::to_vec(body).expect("serialisable body"),
    }
}

fn account_response(outcome: AccountOutcome) -> StoredResponse {
    match outcome {
        AccountOutcome::Created(a) => json_response(201, &a),
        AccountOutcome::Existing(a) => json_response(200, &a),
        AccountOutcome::Mismatch => problem_response(Problem::ResourceMismatch),
    }
}

fn charge_response(outcome: ChargeOutcome) -> StoredResponse {
    match outcome {
        ChargeOutcome::Created(c) => json_response(201, &c),
        ChargeOutcome::ReferenceReplay(c) => json_response(200, &c),
        ChargeOutcome::ReferenceMismatch => problem_response(Problem::ResourceMismatch),
        ChargeOutcome::AccountNotFound => problem_response(Problem::AccountNotFound),
        ChargeOutcome::CurrencyMismatch => problem_response(Problem::CurrencyMismatch),
        ChargeOutcome::InsufficientFunds => problem_response(Problem::InsufficientFunds),
        ChargeOutcome::BalanceOverflow => problem_response(Problem::BalanceOverflow),
    }
}

fn refund_response(outcome: RefundOutcome) -> StoredResponse {
    match outcome {
        RefundOutcome::Created(r) => json_response(201, &r),
        RefundOutcome::ChargeNotFound => problem_response(Problem::NotFound),
        RefundOutcome::ExceedsCharge => problem_response(Problem::RefundExceedsCharge),
        RefundOutcome::InsufficientFunds => problem_response(Problem::InsufficientFunds),
        RefundOutcome::BalanceOverflow => problem_response(Problem::BalanceOverflow),
    }
}
