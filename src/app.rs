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
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::acquirer::{Acquirer, AuthorizeOutcome, Declined};
use crate::api::{Answer, Deliver, Problem, Reply, JSON};
use crate::config::{
    Config, FaultPoint, ACQUIRER_OVERRUN_TOLERANCE, OPERATION_QUEUE_LEN_MAX, OPERATION_THREADS,
    RESERVATION_QUEUE_LEN_MAX, RESERVATION_THREADS,
};
use crate::consumers;
use crate::error::{Error, Result};
use crate::events::{self, EventType};
use crate::idempotency::{
    self, Attempt, Fingerprint, IdempotencyKey, KeyRow, KeyState, Mode, Owner, RecoveryPoint,
    Reservation, Scope, StoredResponse, Timeouts,
};
use crate::inbound::{self, Delivery, NotificationRequest, Received, SourceRequest, Status};
use crate::ledger::{
    self, AccountOutcome, CancellationReason, ChargeOutcome, Claim, ClaimOutcome, Origin,
    RefundOutcome, UnknownCursor,
};
use crate::metrics::Metrics;
use crate::model::{
    AccountRequest, CancelRequest, CaptureRequest, ChargeRequest, ListObject, Operation, Page,
    RefundRequest, WebhookEndpointRequest,
};
use crate::pool::{Pool, Task};
use crate::sandbox::{AcquirerFault, CrashPoint, Directive, Directives, Registered, Sandbox};
use crate::store::{Db, Store};
use crate::time::now_ms;
use crate::webhooks::{self, CreateOutcome, DeletedObject, Recorded};

pub struct App {
    pub config: Config,
    pub metrics: Arc<Metrics>,
    /// The database: SQLite's writer thread and readers, or PostgreSQL.
    store: Store,
    acquirer: Arc<dyn Acquirer>,
    /// Key hash → consumer id. Consumers are never deleted, so a positive
    /// answer stays true; unknown keys are looked up every time.
    consumers: RwLock<HashMap<[u8; 32], i64>>,
    /// Short write tasks (a reservation, an account without key), off the
    /// HTTP workers.
    reservations: Pool,
    /// Owned operations (acquirer, recovery point, ledger phase).
    operations: Pool,
    /// Held for a whole reaper pass, so that the reaper thread and
    /// `Server::reap_now` never expire the same hold at once.
    reaping: std::sync::Mutex<()>,
    /// Webhook endpoints deleted by this process (see
    /// [`App::endpoint_deletions`]).
    endpoint_deletions: AtomicU64,
    /// The sandbox's scripts and the faults of the attempts running now
    /// (all empty outside sandbox mode).
    sandbox: Arc<Sandbox>,
    /// This process's name in the database's leases (deliveries claimed
    /// by this node), new at every start.
    node: Arc<str>,
    /// Itself, for the tasks it hands to its pools.
    me: Weak<App>,
}

/// The reservation step's result, with the inline case: an answer decided
/// in the transaction that reserved the key (a synchronous account; a refund
/// the ledger refuses; a capture or cancel whose charge cannot be claimed).
enum Reserved {
    Done {
        stored: StoredResponse,
        took_over: bool,
        /// A first answer that names what already existed (200).
        existing: bool,
    },
    Pending(Reservation),
}

/// What the reservation transaction does besides reserving.
enum Prepared {
    /// The answer is final: complete the key in this transaction.
    Done(StoredResponse, bool),
    /// Hand the operation on (its row as this transaction left it).
    Run(KeyRow),
}

/// How a ledger-phase transaction leaves its key.
enum Step {
    /// The answer is final: the key completes in this transaction.
    Complete(StoredResponse, bool),
    /// The answer is decided, and one acquirer call is still due before the
    /// key completes (`Declined`: void the authorization; `Applied`: refund).
    Decided(RecoveryPoint, StoredResponse),
}

/// What a ledger-phase transaction did.
enum Committed {
    Completed(StoredResponse, bool),
    Decided,
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
        store: Store,
        acquirer: Arc<dyn Acquirer>,
        metrics: Arc<Metrics>,
    ) -> Arc<App> {
        Arc::new_cyclic(|me| App {
            sandbox: Arc::new(Sandbox::new(config.sandbox)),
            config,
            metrics,
            store,
            acquirer,
            consumers: RwLock::new(HashMap::new()),
            reservations: Pool::start("reserve", RESERVATION_THREADS, RESERVATION_QUEUE_LEN_MAX),
            operations: Pool::start("op", OPERATION_THREADS, OPERATION_QUEUE_LEN_MAX),
            reaping: std::sync::Mutex::new(()),
            endpoint_deletions: AtomicU64::new(0),
            node: Arc::from(crate::ids::new_id("node_")),
            me: me.clone(),
        })
    }

    /// Runs queued reservations and operations, stops their threads, then
    /// stops the writer (which checkpoints).
    pub fn stop(&self) {
        self.reservations.stop();
        self.operations.stop();
        self.store.stop();
    }

    /// How many webhook endpoints this process has deleted: the delivery
    /// dispatcher drops what it read ahead when this changes.
    pub fn endpoint_deletions(&self) -> u64 {
        self.endpoint_deletions.load(AtomicOrdering::SeqCst)
    }

    /// Receives a message after commits (see [`Writer::commits`]).
    pub fn commits(&self) -> crossbeam_channel::Receiver<()> {
        self.store.commits()
    }

    /// The sandbox: whether it is on, and its scripted faults.
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
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

    /// Aborts the process at `point` of an operation of `kind`, if the
    /// configuration asks for it (the crash tests).
    fn fault(&self, point: FaultPoint, kind: &str) {
        let kind_matches = self
            .config
            .fault_operation
            .as_deref()
            .is_none_or(|k| k == kind);
        if self.config.fault == Some(point) && kind_matches {
            eprintln!("idem: fault point {point:?} reached in a {kind}, aborting");
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
            .store
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
        self.store.write(move |tx| {
            if consumers::count(tx)? > 0 {
                return Ok(None);
            }
            consumers::create(tx, &name).map(|(_, key)| Some(key))
        })
    }

    pub fn create_consumer(&self, name: &str) -> Result<String> {
        let name = name.to_string();
        self.store
            .write(move |tx| consumers::create(tx, &name))
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
                Directives::default(),
            ),
            // No key: the natural id (if any) is the only protection, and
            // the work is one transaction, so there is nothing to track.
            None => self.later(move |app, deliver| {
                let created = app.store.write(move |tx| {
                    ledger::create_account(tx, consumer, &req, now_ms()).map(account_response)
                });
                deliver(match created {
                    Ok((stored, existing)) => Reply::stored(stored, existing),
                    Err(e) => Problem::from(e).reply(),
                })
            }),
        }
    }

    /// `POST /v1/charges`. `faults` are the sandbox's in-attempt faults
    /// for this attempt (`Directives::default()`: none).
    pub fn create_charge(
        &self,
        consumer: i64,
        key: IdempotencyKey,
        mode: Mode,
        body: &Value,
        req: ChargeRequest,
        faults: Directives,
    ) -> Answer {
        let fp = idempotency::fingerprint(body);
        self.idempotent(
            consumer,
            "/v1/charges".into(),
            key,
            mode,
            fp,
            Operation::Charge(req),
            faults,
        )
    }

    /// `POST /v1/charges/{id}/refunds`, with the sandbox's `faults`.
    pub fn create_refund(
        &self,
        consumer: i64,
        key: IdempotencyKey,
        mode: Mode,
        body: &Value,
        req: RefundRequest,
        faults: Directives,
    ) -> Answer {
        let path = format!("/v1/charges/{}/refunds", req.charge);
        let fp = idempotency::fingerprint(body);
        self.idempotent(
            consumer,
            path,
            key,
            mode,
            fp,
            Operation::Refund(req),
            faults,
        )
    }

    /// `POST /v1/charges/{id}/capture`, with the sandbox's `faults`.
    pub fn create_capture(
        &self,
        consumer: i64,
        key: IdempotencyKey,
        mode: Mode,
        body: &Value,
        req: CaptureRequest,
        faults: Directives,
    ) -> Answer {
        let path = format!("/v1/charges/{}/capture", req.charge);
        let fp = idempotency::fingerprint(body);
        self.idempotent(
            consumer,
            path,
            key,
            mode,
            fp,
            Operation::Capture(req),
            faults,
        )
    }

    /// `POST /v1/charges/{id}/cancel`, with the sandbox's `faults`.
    pub fn create_cancel(
        &self,
        consumer: i64,
        key: IdempotencyKey,
        mode: Mode,
        body: &Value,
        req: CancelRequest,
        faults: Directives,
    ) -> Answer {
        let path = format!("/v1/charges/{}/cancel", req.charge);
        let fp = idempotency::fingerprint(body);
        self.idempotent(
            consumer,
            path,
            key,
            mode,
            fp,
            Operation::Cancel(req),
            faults,
        )
    }

    /// `POST /v1/webhook_endpoints`. With an `Idempotency-Key` it runs the
    /// protocol like an account: the endpoint is created in the
    /// transaction that reserves the key, and a replay answers the stored
    /// 201, secret included — the one way a client whose first answer was
    /// lost can learn the secret, and only for the same consumer, key and
    /// body within `--key-retention`. Without a key, a retry creates
    /// another endpoint.
    pub fn create_webhook_endpoint(
        &self,
        consumer: i64,
        key: Option<IdempotencyKey>,
        mode: Mode,
        body: &Value,
        req: WebhookEndpointRequest,
    ) -> Answer {
        match key {
            Some(key) => self.idempotent(
                consumer,
                "/v1/webhook_endpoints".into(),
                key,
                mode,
                idempotency::fingerprint(body),
                Operation::WebhookEndpoint(req),
                Directives::default(),
            ),
            None => self.later(move |app, deliver| {
                let created = app.store.write(move |tx| {
                    webhooks::create(tx, consumer, &req, now_ms()).map(endpoint_response)
                });
                deliver(match created {
                    Ok(stored) => Reply::stored(stored, false),
                    Err(e) => Problem::from(e).reply(),
                })
            }),
        }
    }

    /// `DELETE /v1/webhook_endpoints/{id}`: the endpoint and its pending
    /// deliveries stop in one transaction. An attempt already on the wire
    /// may still arrive; its outcome is not recorded.
    pub fn delete_webhook_endpoint(&self, consumer: i64, id: &str) -> Answer {
        let id = id.to_string();
        self.later(move |app, deliver| {
            let public_id = id.clone();
            let deleted = app
                .store
                .write(move |tx| webhooks::delete(tx, consumer, &public_id, now_ms()));
            if matches!(deleted, Ok(Some(_))) {
                app.endpoint_deletions.fetch_add(1, AtomicOrdering::SeqCst);
            }
            deliver(match deleted {
                Ok(Some(_)) => Reply::json(
                    200,
                    &DeletedObject {
                        id,
                        object: "webhook_endpoint",
                        deleted: true,
                    },
                ),
                Ok(None) => Problem::NotFound.reply(),
                Err(e) => Problem::from(e).reply(),
            })
        })
    }

    /// Steps 4–5 of the protocol: reserve the key (or learn why not) in one
    /// write transaction, then answer or do the work. `faults` (the
    /// sandbox's) go with this attempt only: never into the fingerprint or
    /// the key row.
    #[allow(clippy::too_many_arguments)]
    fn idempotent(
        &self,
        consumer: i64,
        path: String,
        key: IdempotencyKey,
        mode: Mode,
        fp: Fingerprint,
        op: Operation,
        faults: Directives,
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
        let t = self.timeouts();
        // Duplicates are answered from a reader, never queued behind writes.
        let seen = self
            .store
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
                self.later(move |app, deliver| app.reserve_and_run(attempt, op, faults, deliver))
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
    ///
    /// The sandbox's `crash=after-reserve` abandons the attempt here, once
    /// the reservation committed: the key stays in progress, unanswered,
    /// until its lock goes stale. A reservation that completed its key in
    /// the same transaction (an account, a refused refund or capture) is
    /// abandoned by `crash=after-reserve` and `crash=after-commit` alike:
    /// that commit was the attempt's last.
    fn reserve_and_run(
        &self,
        attempt: Attempt,
        op: Operation,
        faults: Directives,
        deliver: Deliver,
    ) {
        let mode = attempt.mode;
        match self.reserve(attempt, op) {
            Ok(Reserved::Pending(Reservation::Owned { row, took_over })) => {
                if took_over {
                    self.metrics.orphans_taken_over.inc();
                } else if row.recovery_point == RecoveryPoint::Applied {
                    // A synchronous refund's ledger effect and answer were
                    // committed with its reservation: the point a crash
                    // test aborts at before the acquirer refunds.
                    self.fault(FaultPoint::AfterRecoveryPoint, "refund");
                }
                let owner = row.owner();
                if faults.crash == Some(CrashPoint::AfterReserve) {
                    return deliver(self.abandon(&owner, CrashPoint::AfterReserve));
                }
                let registered = faults.in_attempt().then(|| {
                    self.sandbox
                        .register(owner.key_id, owner.generation, faults)
                });
                self.run_owned(row, mode, deliver, registered);
            }
            other => {
                let committed = matches!(other, Ok(Reserved::Done { .. }));
                let reply = self.answer(other, mode);
                match faults.crash {
                    Some(point @ (CrashPoint::AfterReserve | CrashPoint::AfterCommit))
                        if committed =>
                    {
                        self.metrics.simulated(crash_directive(point));
                        log::warn!("sandbox: crash={point:?} abandoned an answered reservation");
                        deliver(Reply::abandoned())
                    }
                    _ => deliver(reply),
                }
            }
        }
    }

    /// The sandbox's `crash=` at `point` of `owner`'s attempt, if it asked
    /// for one there: `Err` abandons the attempt (see [`App::abandon`]).
    fn crash(&self, owner: &Owner, point: CrashPoint) -> Result<(), Reply> {
        if self.sandbox.of(owner.key_id, owner.generation).crash == Some(point) {
            return Err(self.abandon(owner, point));
        }
        Ok(())
    }

    /// Abandons `owner`'s attempt as a crash there would: the key is
    /// neither unlocked nor completed by it, and its connection is closed
    /// unanswered. Its lock goes stale after `--inflight-timeout`, and a
    /// retry or the reaper takes it over and finishes it.
    fn abandon(&self, owner: &Owner, point: CrashPoint) -> Reply {
        self.metrics.simulated(crash_directive(point));
        log::warn!(
            "sandbox: operation {} abandoned at crash={point:?}, as a crash would leave it",
            owner.op_id
        );
        Reply::abandoned()
    }

    /// Queues an owned operation on the operation pool. If it cannot be
    /// queued, the key is unlocked and the client told 503.
    /// `registered` (the attempt's sandbox faults) lives as long as the task.
    fn run_owned(&self, row: KeyRow, mode: Mode, deliver: Deliver, registered: Option<Registered>) {
        let owner = row.owner();
        let me = self.me();
        let task: Task = Box::new(move |d| {
            let reply = me.run_operation_guarded(row);
            drop(registered);
            d(reply)
        });
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
    /// in the same transaction what must happen with the reservation
    /// ([`prepare`]).
    fn reserve(&self, attempt: Attempt, op: Operation) -> Result<Reserved> {
        let t = self.timeouts();
        let mode = attempt.mode;
        self.store.write(move |tx| {
            let now = now_ms();
            match idempotency::reserve(tx, &attempt, now, t)? {
                Reservation::Owned { row, took_over } => {
                    match prepare(tx, row, &op, mode, took_over, now)? {
                        Prepared::Done(stored, existing) => Ok(Reserved::Done {
                            stored,
                            took_over,
                            existing,
                        }),
                        Prepared::Run(row) => {
                            Ok(Reserved::Pending(Reservation::Owned { row, took_over }))
                        }
                    }
                }
                other => Ok(Reserved::Pending(other)),
            }
        })
    }

    /// The reply to a reservation that leaves nothing to run.
    fn answer(&self, reserved: Result<Reserved>, mode: Mode) -> Reply {
        match reserved {
            Err(e) => Problem::from(e).reply(),
            Ok(Reserved::Done {
                stored,
                took_over,
                existing,
            }) => {
                if took_over {
                    self.metrics.orphans_taken_over.inc();
                }
                Reply::stored(stored, existing)
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
            let _ = self.store.write(move |tx| idempotency::unlock(tx, &owner));
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
        let point = row.recovery_point;
        let result = match op {
            Operation::Charge(req) => self.run_charge(&row, req),
            Operation::Capture(req) => self.run_capture(&owner, point, row.locked_at_ms, req),
            Operation::Cancel(req) => self.run_cancel(&owner, point, row.locked_at_ms, req),
            Operation::Refund(req) => self.run_refund(&owner, point, row.locked_at_ms, req),
            Operation::Account(req) => self.ledger_phase(&owner, "account", move |tx, o, now| {
                ledger::create_account(tx, o.consumer_id, &req, now)
                    .map(account_response)
                    .map(|(stored, existing)| Step::Complete(stored, existing))
            }),
            // Created in the reservation's transaction (`prepare`); only a
            // key row from elsewhere could get here.
            Operation::WebhookEndpoint(req) => {
                self.ledger_phase(&owner, "webhook_endpoint", move |tx, o, now| {
                    webhooks::create(tx, o.consumer_id, &req, now)
                        .map(|out| Step::Complete(endpoint_response(out), false))
                })
            }
            Operation::NotificationSource(req) => {
                self.ledger_phase(&owner, "notification_source", move |tx, o, now| {
                    inbound::create_source(tx, o.consumer_id, &req, now)
                        .map(|source| Step::Complete(json_response(201, &source), false))
                })
            }
        };
        result.unwrap_or_else(|reply| reply)
    }

    /// A charge: the pre-check (a final outcome needs no acquirer), the
    /// authorization, the ledger phase; and when the ledger declines after
    /// the acquirer authorised, the void of that authorization (its own
    /// recovery point) before the answer is final.
    ///
    /// The authorization has no commit of its own: the ledger phase records
    /// it with its effect. A crash (or a transient failure) between the two
    /// leaves the key at `reserved`, and whoever resumes asks the acquirer
    /// again under the same key — the same authorization, not a second —
    /// so a separate recovery point would buy nothing but a writer pass.
    /// Where a later step can fail after the authorization (a decline, then
    /// the void), the decline's transaction records the authorization with
    /// the decided answer (`declined`), and the void resumes from there.
    fn run_charge(&self, row: &KeyRow, req: ChargeRequest) -> Result<Reply, Reply> {
        let owner = row.owner();
        let fp = row.fingerprint();
        let authorization = match row.recovery_point {
            RecoveryPoint::Reserved => {
                self.authorize(&owner, row.locked_at_ms, row.prechecked, &req, &fp)?
            }
            _ => row.authorization.clone().unwrap_or_default(),
        };
        if row.recovery_point != RecoveryPoint::Declined {
            if let Some(hook) = &self.config.hooks.before_ledger_phase {
                hook(&owner.op_id);
            }
            let ttl = crate::time::millis(self.config.authorization_ttl);
            let auth = authorization.clone();
            let committed = self.commit(&owner, "charge", move |tx, o, now| {
                let origin = Origin {
                    op_id: &o.op_id,
                    key: &o.key,
                };
                let expires = now.saturating_add(ttl);
                let outcome = ledger::apply_charge(
                    tx,
                    o.consumer_id,
                    &req,
                    &fp,
                    &origin,
                    &auth,
                    now,
                    expires,
                )?;
                Ok(match outcome {
                    ChargeOutcome::Created(c) => Step::Complete(json_response(201, &c), false),
                    // Declined after the acquirer authorised: the answer is
                    // decided, and the authorization must not dangle.
                    other => {
                        // Recorded with the decision, for the void to
                        // resume from if this owner dies before it.
                        let recorded = idempotency::record_authorization(tx, o, &auth, now)?;
                        assert!(recorded, "fence checked in this transaction");
                        let (stored, _) = charge_response(other);
                        Step::Decided(RecoveryPoint::Declined, stored)
                    }
                })
            })?;
            if let Committed::Completed(stored, existing) = committed {
                return Ok(Reply::stored(stored, existing));
            }
        }
        // The decline was just recorded (or the key just taken over): the
        // lock is fresh, so the void has the whole deadline.
        let key = format!("{}:void", owner.op_id);
        self.call_acquirer(&owner, now_ms(), "charge", |deadline| {
            self.acquirer.void(&key, &authorization, deadline)
        })?;
        self.finish(&owner, "charge")
    }

    /// A capture: the charge was claimed when the key was reserved; the
    /// acquirer captures (a recovery point), then the ledger phase moves the
    /// captured amount and releases the hold.
    fn run_capture(
        &self,
        owner: &Owner,
        point: RecoveryPoint,
        locked_at_ms: i64,
        req: CaptureRequest,
    ) -> Result<Reply, Reply> {
        let claim = Claim::Capture(req.amount);
        let (authorization, amount) = self.claimed(owner, &req.charge, claim)?;
        if point == RecoveryPoint::Reserved {
            self.fault(FaultPoint::AfterReserve, "capture");
            self.call_acquirer(owner, locked_at_ms, "capture", |deadline| {
                self.acquirer
                    .capture(&owner.op_id, &authorization, amount, deadline)
            })?;
            self.record(owner, RecoveryPoint::Captured, "capture")?;
        }
        if let Some(hook) = &self.config.hooks.before_ledger_phase {
            hook(&owner.op_id);
        }
        let charge = req.charge;
        self.ledger_phase(owner, "capture", move |tx, o, now| {
            let c = ledger::apply_capture(tx, o.consumer_id, &charge, &o.op_id, amount, now)?;
            Ok(Step::Complete(json_response(200, &c), false))
        })
    }

    /// A cancel: like a capture, with a void and the hold released.
    fn run_cancel(
        &self,
        owner: &Owner,
        point: RecoveryPoint,
        locked_at_ms: i64,
        req: CancelRequest,
    ) -> Result<Reply, Reply> {
        let (authorization, _) = self.claimed(owner, &req.charge, Claim::Cancel)?;
        if point == RecoveryPoint::Reserved {
            self.fault(FaultPoint::AfterReserve, "cancel");
            self.call_acquirer(owner, locked_at_ms, "cancel", |deadline| {
                self.acquirer.void(&owner.op_id, &authorization, deadline)
            })?;
            self.record(owner, RecoveryPoint::Voided, "cancel")?;
        }
        if let Some(hook) = &self.config.hooks.before_ledger_phase {
            hook(&owner.op_id);
        }
        let charge = req.charge;
        self.ledger_phase(owner, "cancel", move |tx, o, now| {
            let c = ledger::apply_cancel(
                tx,
                o.consumer_id,
                &charge,
                &o.op_id,
                CancellationReason::Requested,
                now,
            )?;
            Ok(Step::Complete(json_response(200, &c), false))
        })
    }

    /// A refund, ledger first: its entries and its answer commit (recovery
    /// point `Applied`; a refusal is final at once), then the acquirer
    /// refunds, then the key completes.
    fn run_refund(
        &self,
        owner: &Owner,
        point: RecoveryPoint,
        mut locked_at_ms: i64,
        req: RefundRequest,
    ) -> Result<Reply, Reply> {
        if point == RecoveryPoint::Reserved {
            let committed = self.commit(owner, "refund", move |tx, o, now| {
                refund_step(tx, o, &req, now)
            })?;
            if let Committed::Completed(stored, existing) = committed {
                return Ok(Reply::stored(stored, existing));
            }
            // Recording the answer refreshed the lock.
            locked_at_ms = now_ms();
        }
        let op_id = owner.op_id.clone();
        let applied = self.store.read(|c| ledger::applied_refund(c, &op_id));
        let (authorization, amount) = match applied {
            Ok(Some(found)) => found,
            Ok(None) => return Err(self.give_up(owner, Error::Other("refund row missing".into()))),
            Err(e) => return Err(self.give_up(owner, e)),
        };
        self.call_acquirer(owner, locked_at_ms, "refund", |deadline| {
            self.acquirer
                .refund(&owner.op_id, &authorization, amount, deadline)
        })?;
        self.finish(owner, "refund")
    }

    /// The authorization and amount of the charge a capture or cancel
    /// claimed.
    fn claimed(&self, owner: &Owner, charge: &str, claim: Claim) -> Result<(String, i64), Reply> {
        let consumer = owner.consumer_id;
        match self
            .store
            .read(|c| ledger::claimed_charge(c, consumer, charge, claim))
        {
            Ok(Some(found)) => Ok(found),
            Ok(None) => Err(self.give_up(owner, Error::Other(format!("charge {charge} vanished")))),
            Err(e) => Err(self.give_up(owner, e)),
        }
    }

    /// One acquirer call between two recovery points, given the deadline
    /// of an owner whose lock was last refreshed at `locked_at_ms`, with its
    /// fault point; a failure, or no time left, is transient (503, key
    /// unlocked).
    fn call_acquirer<T>(
        &self,
        owner: &Owner,
        locked_at_ms: i64,
        kind: &str,
        call: impl FnOnce(Instant) -> std::result::Result<T, crate::acquirer::Unavailable>,
    ) -> Result<T, Reply> {
        let Some(deadline) = self.acquirer_deadline(locked_at_ms) else {
            let why = "the operation waited past its acquirer deadline before calling".into();
            return Err(self.give_up(owner, Error::Acquirer(why)));
        };
        self.acquirer_faults(owner, deadline)?;
        let called = call(deadline);
        let overrun = Instant::now().saturating_duration_since(deadline);
        if overrun > ACQUIRER_OVERRUN_TOLERANCE {
            log::warn!(
                "operation {}: the acquirer answered {overrun:?} past its deadline",
                owner.op_id
            );
        }
        let answer = called.map_err(|e| self.give_up(owner, Error::Acquirer(e.0)))?;
        self.fault(FaultPoint::AfterAcquirer, kind);
        self.crash(owner, CrashPoint::AfterAcquirer)?;
        Ok(answer)
    }

    /// The sandbox's `acquirer-latency=` (the call starts that much later;
    /// past the deadline it is a timeout, 503) and `acquirer=unavailable`
    /// (503, key unlocked) for every acquirer call of `owner`'s attempt.
    fn acquirer_faults(&self, owner: &Owner, deadline: Instant) -> Result<(), Reply> {
        let faults = self.sandbox.of(owner.key_id, owner.generation);
        if let Some(latency) = faults.acquirer_latency {
            self.metrics.simulated(Directive::AcquirerLatency(latency));
            let left = deadline.saturating_duration_since(Instant::now());
            std::thread::sleep(latency.min(left));
            if latency > left {
                let why = format!("sandbox: acquirer-latency={latency:?} passed the deadline");
                return Err(self.give_up(owner, Error::Acquirer(why)));
            }
        }
        if faults.acquirer == Some(AcquirerFault::Unavailable) {
            self.metrics.simulated(Directive::AcquirerUnavailable);
            let why = "sandbox: acquirer=unavailable".to_string();
            return Err(self.give_up(owner, Error::Acquirer(why)));
        }
        Ok(())
    }

    /// Records a recovery point after an acquirer call.
    fn record(&self, owner: &Owner, point: RecoveryPoint, kind: &str) -> Result<(), Reply> {
        let o = owner.clone();
        match self
            .store
            .write(move |tx| idempotency::record_point(tx, &o, point, now_ms()))
        {
            Ok(true) => {}
            Ok(false) => return Err(self.lost(owner)),
            Err(e) => return Err(self.give_up(owner, e)),
        }
        self.fault(FaultPoint::AfterRecoveryPoint, kind);
        Ok(())
    }

    /// Completes a key whose answer was decided before its last acquirer
    /// call.
    fn finish(&self, owner: &Owner, kind: &str) -> Result<Reply, Reply> {
        let o = owner.clone();
        match self
            .store
            .write(move |tx| idempotency::finish(tx, &o, now_ms()))
        {
            Ok(Some(stored)) => {
                self.fault(FaultPoint::AfterCommit, kind);
                self.crash(owner, CrashPoint::AfterCommit)?;
                // A charge decided 200 after its authorization is a
                // reference replay: it names a charge that existed.
                let existing = kind == "charge" && stored.status == 200;
                Ok(Reply::stored(stored, existing))
            }
            Ok(None) => Err(self.lost(owner)),
            Err(e) => Err(self.give_up(owner, e)),
        }
    }

    /// The steps between reservation and the ledger phase of a charge: the
    /// pre-check (a final outcome needs no acquirer) and the acquirer call
    /// within its deadline; the ledger phase records the authorization it
    /// returns. `locked_at_ms` is when `owner`'s lock was taken. `Err` is
    /// the reply to give instead.
    fn authorize(
        &self,
        owner: &Owner,
        locked_at_ms: i64,
        prechecked: bool,
        req: &ChargeRequest,
        fp: &Fingerprint,
    ) -> Result<String, Reply> {
        let consumer = owner.consumer_id;
        // A first owner has called nobody yet, so a final outcome of the
        // pre-check is answered without the acquirer. An owner that took the
        // key over cannot know that: its predecessor may have been
        // authorised just before it stalled or died. It asks the acquirer
        // (same key: the same authorization, or a first one), and a decline
        // then goes through the ledger phase, which voids it. A synchronous
        // first owner was pre-checked in its reservation's transaction
        // (`prepare`).
        let first_owner = owner.generation == 1;
        let precheck = if first_owner && !prechecked {
            self.store
                .read(|c| ledger::precheck_charge(c, consumer, req, fp))
        } else {
            Ok(None)
        };
        match precheck {
            Err(e) => return Err(self.give_up(owner, e)),
            Ok(Some(outcome)) => {
                let (stored, existing) = charge_response(outcome);
                return Err(self
                    .ledger_phase(owner, "charge", move |_, _, _| {
                        Ok(Step::Complete(stored.clone(), existing))
                    })
                    .unwrap_or_else(|reply| reply));
            }
            Ok(None) => {}
        }
        self.fault(FaultPoint::AfterReserve, "charge");
        let declines = self.sandbox.of(owner.key_id, owner.generation).acquirer
            == Some(AcquirerFault::Decline);
        let outcome = self.call_acquirer(owner, locked_at_ms, "charge", |deadline| {
            if declines {
                // The sandbox's decline: the acquirer is not asked.
                self.metrics.simulated(Directive::AcquirerDecline);
                return Ok(AuthorizeOutcome::Declined(Declined(
                    "sandbox: acquirer=decline".into(),
                )));
            }
            self.acquirer.authorize(
                &owner.op_id,
                req.amount,
                req.currency.as_str(),
                req.capture,
                deadline,
            )
        })?;
        let auth = match outcome {
            AuthorizeOutcome::Approved(auth) => auth,
            // Final: stored and replayed. No authorization exists, so there
            // is nothing to void and nothing to record before the answer.
            AuthorizeOutcome::Declined(Declined(why)) => {
                log::info!("operation {}: declined by the acquirer: {why}", owner.op_id);
                let stored = problem_response(Problem::CardDeclined);
                return Err(self
                    .ledger_phase(owner, "charge", move |_, _, _| {
                        Ok(Step::Complete(stored.clone(), false))
                    })
                    .unwrap_or_else(|reply| reply));
            }
        };
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

    /// Commits `effect` and what it decides for the key, if `owner` still
    /// holds its key (the fencing check); answers like a later duplicate if
    /// it was taken over meanwhile.
    fn commit<F>(&self, owner: &Owner, kind: &str, mut effect: F) -> Result<Committed, Reply>
    where
        F: FnMut(&dyn Db, &Owner, i64) -> Result<Step> + Send + 'static,
    {
        let o = owner.clone();
        let committed = self.store.write(move |tx| {
            if !idempotency::holds(tx, &o)? {
                return Ok(None);
            }
            let now = now_ms();
            Ok(Some(match effect(tx, &o, now)? {
                Step::Complete(stored, existing) => {
                    let completed = idempotency::complete(tx, &o, &stored, now)?;
                    assert!(completed, "fence checked in this transaction");
                    Committed::Completed(stored, existing)
                }
                Step::Decided(point, stored) => {
                    let recorded = idempotency::record_answer(tx, &o, point, &stored, now)?;
                    assert!(recorded, "fence checked in this transaction");
                    Committed::Decided
                }
            }))
        });
        match committed {
            Ok(Some(committed)) => {
                match committed {
                    Committed::Completed(..) => {
                        self.fault(FaultPoint::AfterCommit, kind);
                        self.crash(owner, CrashPoint::AfterCommit)?;
                    }
                    Committed::Decided => self.fault(FaultPoint::AfterRecoveryPoint, kind),
                }
                Ok(committed)
            }
            Ok(None) => Err(self.lost(owner)),
            Err(e) => Err(self.give_up(owner, e)),
        }
    }

    /// [`App::commit`] of an effect that completes the key.
    fn ledger_phase<F>(&self, owner: &Owner, kind: &str, effect: F) -> Result<Reply, Reply>
    where
        F: FnMut(&dyn Db, &Owner, i64) -> Result<Step> + Send + 'static,
    {
        match self.commit(owner, kind, effect)? {
            Committed::Completed(stored, existing) => Ok(Reply::stored(stored, existing)),
            Committed::Decided => unreachable!("a ledger phase completes its key"),
        }
    }

    /// An owner that was fenced off answers like any later duplicate.
    fn lost(&self, owner: &Owner) -> Reply {
        let id = owner.key_id;
        match self.store.read(|c| idempotency::load_by_id(c, id)) {
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
        if let Err(unlock) = self.store.write(move |tx| idempotency::unlock(tx, &o)) {
            log::warn!("cannot unlock {}: {unlock}", owner.op_id);
        }
        Problem::from(e).reply()
    }

    // -----------------------------------------------------------------------
    // Inbound notifications (src/inbound.rs)

    /// `POST /v1/notification_sources`. With an `Idempotency-Key`, a
    /// replay answers the stored 201 byte for byte, secret included (as
    /// Stripe does for its endpoints' secrets): the secret is shown once
    /// per creation, to the key's owner, within `--key-retention`.
    pub fn create_notification_source(
        &self,
        consumer: i64,
        key: Option<IdempotencyKey>,
        mode: Mode,
        body: &Value,
        req: SourceRequest,
    ) -> Answer {
        match key {
            Some(key) => self.idempotent(
                consumer,
                "/v1/notification_sources".into(),
                key,
                mode,
                idempotency::fingerprint(body),
                Operation::NotificationSource(req),
                Directives::default(),
            ),
            None => self.later(move |app, deliver| {
                let created = app.store.write(move |tx| {
                    inbound::create_source(tx, consumer, &req, now_ms())
                        .map(|s| json_response(201, &s))
                });
                deliver(match created {
                    Ok(stored) => Reply::stored(stored, false),
                    Err(e) => Problem::from(e).reply(),
                })
            }),
        }
    }

    pub fn get_notification_source(&self, consumer: i64, id: &str) -> Reply {
        self.read(
            |c| inbound::get_source(c, consumer, id),
            |s| Reply::json(200, &s),
        )
    }

    pub fn list_notification_sources(&self, consumer: i64, page: &Page) -> Reply {
        self.read(
            |c| inbound::list_sources(c, consumer, page).map(Some),
            list_reply,
        )
    }

    pub fn list_notifications(&self, consumer: i64, status: Option<Status>, page: &Page) -> Reply {
        self.read(
            |c| inbound::list(c, consumer, status, page).map(Some),
            list_reply,
        )
    }

    /// `POST /v1/notifications/{source}`, in order: the signature (401
    /// `signature-invalid`, the same for a source that does not exist,
    /// which is checked against a dummy key so that it takes as long), the
    /// `webhook-id` (400), the body (400), then the idempotency decision —
    /// first on a reader (a replay or a 422 needs no write), then again in
    /// the one writer command that stores the notification and applies it.
    pub fn receive_notification(&self, source: &str, signed: &Signed<'_>) -> Answer {
        let found = match self.store.read(|c| inbound::source_key(c, source)) {
            Ok(found) => found,
            Err(e) => return Problem::from(e).reply().into(),
        };
        let tolerance = self.config.notification_tolerance.as_secs() as i64;
        let now_s = now_ms().div_euclid(1000);
        let key = found.as_ref().map_or(&[0u8; 32][..], |s| s.key.as_slice());
        let verified = match (signed.id, signed.timestamp, signed.signature) {
            (Some(id), Some(ts), Some(sig)) => crate::signature::verify(
                key,
                &String::from_utf8_lossy(id),
                ts,
                sig,
                signed.body,
                now_s,
                tolerance,
            ),
            _ => Err(crate::signature::SignatureError::MissingHeader),
        };
        let source = match (verified, found) {
            (Ok(()), Some(source)) => source,
            (Ok(()), None) => {
                return Problem::SignatureInvalid(
                    crate::signature::SignatureError::NoMatch.to_string(),
                )
                .reply()
                .into()
            }
            (Err(why), _) => return Problem::SignatureInvalid(why.to_string()).reply().into(),
        };
        let id = signed.id.unwrap_or_default();
        if !inbound::valid_webhook_id(id) {
            return Problem::WebhookIdInvalid.reply().into();
        }
        let webhook_id = String::from_utf8_lossy(id).into_owned();
        let parsed = crate::model::parse_object(signed.body)
            .and_then(|v| NotificationRequest::from_json(&v).map(|r| (v, r)));
        let (value, request) = match parsed {
            Ok(parsed) => parsed,
            Err(e) => return Problem::InvalidRequest(e.to_string()).reply().into(),
        };
        let delivery = Delivery {
            source,
            webhook_id,
            fingerprint: idempotency::fingerprint(&value),
            body: signed.body.to_vec(),
            request,
        };
        let seen = self.store.read(|c| {
            inbound::settle(
                c,
                delivery.source.id,
                &delivery.webhook_id,
                &delivery.fingerprint,
            )
        });
        if let Ok(Some(decided)) = seen {
            return self.received(Ok(decided)).into();
        }
        let abort = self.config.fault == Some(FaultPoint::InNotification)
            && self
                .config
                .fault_operation
                .as_deref()
                .is_none_or(|k| k == "notification");
        self.later(move |app, deliver| {
            let received = app.store.write(move |tx| {
                inbound::receive(tx, &delivery, now_ms(), || {
                    if abort {
                        eprintln!("idem: fault point InNotification reached, aborting");
                        std::process::abort();
                    }
                })
            });
            deliver(app.received(received))
        })
    }

    fn received(&self, received: Result<Received>) -> Reply {
        match received {
            Ok(Received::New(status, stored)) => {
                self.metrics.notifications[status.index()].inc();
                Reply::stored(stored, false)
            }
            Ok(Received::Replay(stored)) => {
                self.metrics.idempotent_replays.inc();
                Reply::stored(stored, true)
            }
            Ok(Received::Reused) => {
                self.metrics.conflicts_reused.inc();
                Problem::IdempotencyKeyReused.reply()
            }
            Err(e) => Problem::from(e).reply(),
        }
    }

    // -----------------------------------------------------------------------
    // Reads

    fn read<T>(
        &self,
        f: impl FnOnce(&dyn Db) -> Result<Option<T>>,
        render: impl FnOnce(T) -> Reply,
    ) -> Reply {
        match self.store.read(f) {
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

    pub fn list_events(&self, consumer: i64, kind: Option<EventType>, page: &Page) -> Reply {
        self.read(
            |c| events::list(c, consumer, kind, page).map(Some),
            list_reply,
        )
    }

    /// The event exactly as it was stored (and is delivered).
    pub fn get_event(&self, consumer: i64, id: &str) -> Reply {
        self.read(
            |c| events::get(c, consumer, id),
            |e| Reply::raw(200, JSON, e.body),
        )
    }

    /// A live webhook endpoint, without its secret.
    pub fn get_webhook_endpoint(&self, consumer: i64, id: &str) -> Reply {
        self.read(|c| webhooks::get(c, consumer, id), |e| Reply::json(200, &e))
    }

    pub fn list_webhook_endpoints(&self, consumer: i64, page: &Page) -> Reply {
        self.read(|c| webhooks::list(c, consumer, page).map(Some), list_reply)
    }

    /// `GET /v1/events/{id}/deliveries`.
    pub fn list_deliveries(&self, consumer: i64, event: &str) -> Reply {
        self.read(
            |c| webhooks::deliveries(c, consumer, event),
            |list| Reply::json(200, &list),
        )
    }

    pub fn get_operation(&self, consumer: i64, op_id: &str) -> Reply {
        self.read(
            |c| idempotency::load_operation(c, consumer, op_id),
            |row| Reply::json(200, &operation_object(&row)),
        )
    }

    // -----------------------------------------------------------------------
    // For the delivery engine

    /// Up to `limit` deliveries due now: read on a reader when this server
    /// is the database's only one; leased to this node in the database when
    /// servers share it, for as long as a dispatcher may hold what it read
    /// before the attempt ends ([`App::delivery_lease`]).
    pub fn due_deliveries(&self, limit: usize) -> Result<Vec<webhooks::Due>> {
        if !self.store.shared() {
            return self.store.read(|c| webhooks::due(c, now_ms(), limit));
        }
        let node = Arc::clone(&self.node);
        let lease = crate::time::millis(self.delivery_lease());
        // Unheard: the dispatcher waits on commits, and would wake to this
        // one, its own claim, and claim again, without end.
        self.store.write_unheard(move |tx| {
            let now = now_ms();
            webhooks::claim_due(tx, &node, now, now.saturating_add(lease), limit)
        })
    }

    /// How long a node's lease on a delivery lasts: its attempt's timeout
    /// and as long again for the wait in the dispatcher's read-ahead, and a
    /// margin. A node that dies leaves its deliveries to others after this.
    fn delivery_lease(&self) -> Duration {
        self.config.webhook_timeout * 2 + Duration::from_secs(10)
    }

    /// Records the outcomes of attempts, all in one writer command.
    pub fn record_deliveries(
        &self,
        attempts: Vec<webhooks::AttemptRecord>,
    ) -> Result<Vec<Recorded>> {
        self.store.write(move |tx| {
            let now = now_ms();
            attempts
                .iter()
                .map(|a| webhooks::record_attempt(tx, a, now))
                .collect()
        })
    }

    /// Pending deliveries, due or not.
    pub fn webhook_backlog(&self) -> Result<u64> {
        self.store.read(|c| webhooks::backlog(c))
    }

    // -----------------------------------------------------------------------
    // For the reaper

    /// In-progress keys silent for longer than the in-flight timeout.
    pub fn orphans(&self, limit: usize) -> Result<Vec<i64>> {
        let cutoff = now_ms().saturating_sub(crate::time::millis(self.config.inflight_timeout));
        self.store
            .read(|c| idempotency::orphans(c, cutoff, limit))
    }

    /// Takes the orphan `id` over and finishes it; false if it was no longer
    /// an orphan (a client's retry got there first).
    pub fn complete_orphan(&self, id: i64) -> Result<bool> {
        let inflight = self.config.inflight_timeout;
        let row = self
            .store
            .write(move |tx| idempotency::take_over_orphan(tx, id, now_ms(), inflight))?;
        let Some(row) = row else {
            return Ok(false);
        };
        self.metrics.orphans_taken_over.inc();
        let op_id = row.op_id.clone();
        let reply = self.run_operation_guarded(row);
        log::info!("reaper completed orphan {op_id}: {}", reply.status);
        Ok(true)
    }

    /// One reaper pass at a time: the guard to hold for the pass.
    pub fn reaper_pass(&self) -> std::sync::MutexGuard<'_, ()> {
        self.reaping
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Voids and releases up to `limit` holds past `--authorization-ttl`,
    /// each claimed first (a capture or cancel that claimed it earlier wins;
    /// one that comes later is refused), then voided at the acquirer under a
    /// key derived from the charge, then released with
    /// `cancellation_reason: expired`. A pass interrupted anywhere (a crash,
    /// the acquirer down) leaves the claim, and the next pass finishes it.
    /// Returns how many it released.
    pub fn expire_holds(&self, limit: usize) -> Result<usize> {
        let now = now_ms();
        let holds = self
            .store
            .read(|c| ledger::expired_holds(c, now, limit))?;
        let mut released = 0;
        for hold in holds {
            // One hold that cannot be expired now (the acquirer down, a busy
            // database) waits for the next pass; the others go on.
            match self.expire_hold(&hold) {
                Ok(true) => released += 1,
                Ok(false) => {}
                Err(e) => log::warn!("reaper: cannot expire hold {}: {e}", hold.charge),
            }
        }
        Ok(released)
    }

    /// Claims, voids and releases one expired hold; false if a capture or
    /// cancel claimed it first.
    fn expire_hold(&self, hold: &ledger::ExpiredHold) -> Result<bool> {
        let h = hold.clone();
        // The lease (PostgreSQL): the void's deadline and a margin, so that
        // another node's reaper takes the expiry over only once this one
        // has given up or died.
        let lease = crate::time::millis(self.config.effective_acquirer_timeout() * 2)
            .saturating_add(10_000);
        if !self.store.write(move |tx| {
            let now = now_ms();
            ledger::claim_expired(tx, &h, now, now.saturating_add(lease))
        })?
        {
            return Ok(false);
        }
        let key = format!("expire:{}", hold.charge);
        let deadline = Instant::now() + self.config.effective_acquirer_timeout();
        self.acquirer
            .void(&key, &hold.authorization, deadline)
            .map_err(|e| Error::Acquirer(e.0))?;
        self.fault(FaultPoint::AfterAcquirer, "expiry");
        let h = hold.clone();
        self.store.write(move |tx| {
            ledger::apply_cancel(
                tx,
                h.consumer_id,
                &h.charge,
                ledger::EXPIRY_CLAIMER,
                CancellationReason::Expired,
                now_ms(),
            )
        })?;
        self.metrics.authorizations_expired.inc();
        Ok(true)
    }

    /// Deletes one batch of completed keys past retention.
    pub fn delete_expired(&self, batch: usize) -> Result<usize> {
        let cutoff = now_ms().saturating_sub(crate::time::millis(self.config.key_retention));
        let n = self
            .store
            .write(move |tx| idempotency::delete_expired(tx, cutoff, batch))?;
        self.metrics.keys_reaped.add(n as u64);
        Ok(n)
    }

    /// Deletes one batch of events past `--event-retention`, with their
    /// deliveries.
    pub fn delete_expired_events(&self, batch: usize) -> Result<usize> {
        let cutoff = now_ms().saturating_sub(crate::time::millis(self.config.event_retention));
        self.store
            .write(move |tx| events::delete_expired(tx, cutoff, batch))
    }
}

/// The directive that asks for a crash at `point` (the metric's label).
fn crash_directive(point: CrashPoint) -> Directive {
    match point {
        CrashPoint::AfterReserve => Directive::CrashAfterReserve,
        CrashPoint::AfterAcquirer => Directive::CrashAfterAcquirer,
        CrashPoint::AfterCommit => Directive::CrashAfterCommit,
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
        // An in-progress key may hold its decided answer already; it is
        // shown once final.
        response: row
            .response
            .as_ref()
            .filter(|_| row.state == KeyState::Completed)
            .map(|r| OperationResponse {
                status: r.status,
                body: String::from_utf8(r.body.clone())
                    .ok()
                    .and_then(|s| serde_json::value::RawValue::from_string(s).ok())
                    .expect("stored bodies are JSON"),
            }),
    }
}

/// The parts of a notification its signature covers, as received: the
/// three Standard Webhooks headers (`None`: missing, repeated or not text)
/// and the raw body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signed<'a> {
    pub id: Option<&'a [u8]>,
    pub timestamp: Option<&'a str>,
    pub signature: Option<&'a str>,
    pub body: &'a [u8],
}

fn list_reply<T: Serialize>(list: std::result::Result<ListObject<T>, UnknownCursor>) -> Reply {
    match list {
        Ok(list) => Reply::json(200, &list),
        Err(UnknownCursor) => {
            Problem::InvalidRequest("starting_after: no such object in this list".into()).reply()
        }
    }
}

/// What the reservation transaction does with a key this request owns, so
/// that no race can come between the two: a synchronous account is created
/// (and its key completed); a synchronous refund is applied to the ledger
/// (its acquirer call follows); a capture or cancel claims its charge, so
/// that of two racing, the second is refused before any acquirer call. An
/// orphan taken over resumes from its recovery point instead.
fn prepare(
    tx: &dyn Db,
    mut row: KeyRow,
    op: &Operation,
    mode: Mode,
    took_over: bool,
    now: i64,
) -> Result<Prepared> {
    let owner = row.owner();
    let fresh = row.recovery_point == RecoveryPoint::Reserved;
    let done = |stored: StoredResponse, existing: bool| -> Result<Prepared> {
        let completed = idempotency::complete(tx, &owner, &stored, now)?;
        assert!(completed, "the key was reserved in this transaction");
        Ok(Prepared::Done(stored, existing))
    };
    match op {
        Operation::Account(req) if mode == Mode::Sync && fresh => {
            let (stored, existing) =
                account_response(ledger::create_account(tx, owner.consumer_id, req, now)?);
            done(stored, existing)
        }
        Operation::Refund(req) if mode == Mode::Sync && fresh => {
            match refund_step(tx, &owner, req, now)? {
                Step::Complete(stored, existing) => done(stored, existing),
                Step::Decided(point, stored) => {
                    let recorded = idempotency::record_answer(tx, &owner, point, &stored, now)?;
                    assert!(recorded, "the key was reserved in this transaction");
                    row.recovery_point = point;
                    row.response = Some(stored);
                    Ok(Prepared::Run(row))
                }
            }
        }
        // One transaction and nothing to wait for: created with its key in
        // either mode.
        Operation::WebhookEndpoint(req) if fresh => done(
            endpoint_response(webhooks::create(tx, owner.consumer_id, req, now)?),
            false,
        ),
        Operation::NotificationSource(req) if mode == Mode::Sync && fresh => {
            let source = inbound::create_source(tx, owner.consumer_id, req, now)?;
            done(json_response(201, &source), false)
        }
        // The pre-check of a first owner, here where the writer's pages are
        // warm rather than on a reader (whose cache every commit empties):
        // a final outcome completes the key now, without the acquirer; any
        // other goes on with nothing checked twice. Async keeps its 202 and
        // checks when it runs.
        Operation::Charge(req) if mode == Mode::Sync && fresh && owner.generation == 1 => {
            let fp = row.fingerprint();
            match ledger::precheck_charge(tx, owner.consumer_id, req, &fp)? {
                Some(outcome) => {
                    let (stored, existing) = charge_response(outcome);
                    done(stored, existing)
                }
                None => {
                    row.prechecked = true;
                    Ok(Prepared::Run(row))
                }
            }
        }
        Operation::Capture(CaptureRequest { charge, amount }) if !took_over => {
            claim(tx, &owner, charge, Claim::Capture(*amount), now, row, done)
        }
        Operation::Cancel(CancelRequest { charge }) if !took_over => {
            claim(tx, &owner, charge, Claim::Cancel, now, row, done)
        }
        _ => Ok(Prepared::Run(row)),
    }
}

/// Claims a held charge for a capture or cancel; an answer if it cannot be.
fn claim(
    tx: &dyn Db,
    owner: &Owner,
    charge: &str,
    claim: Claim,
    now: i64,
    row: KeyRow,
    done: impl FnOnce(StoredResponse, bool) -> Result<Prepared>,
) -> Result<Prepared> {
    let claimed = ledger::claim_charge(tx, owner.consumer_id, charge, claim, &owner.op_id, now)?;
    let problem = match claimed {
        ClaimOutcome::Claimed => return Ok(Prepared::Run(row)),
        ClaimOutcome::NotFound => Problem::NotFound,
        ClaimOutcome::InvalidState(why) => Problem::InvalidChargeState(why),
        ClaimOutcome::ExceedsAuthorization => Problem::CaptureExceedsAuthorization,
    };
    done(problem_response(problem), false)
}

/// A refund's ledger effect: applied, its answer decided and its acquirer
/// call due (`Applied`); or refused, final.
fn refund_step(tx: &dyn Db, owner: &Owner, req: &RefundRequest, now: i64) -> Result<Step> {
    let origin = Origin {
        op_id: &owner.op_id,
        key: &owner.key,
    };
    Ok(
        match ledger::apply_refund(tx, owner.consumer_id, req, &origin, now)? {
            RefundOutcome::Created(refund) => {
                Step::Decided(RecoveryPoint::Applied, json_response(201, &refund))
            }
            other => Step::Complete(refund_response(other), false),
        },
    )
}

/// A webhook endpoint's creation answer: 201 with the secret, shown here
/// (and in this answer's replays) only.
fn endpoint_response(outcome: CreateOutcome) -> StoredResponse {
    match outcome {
        CreateOutcome::Created(endpoint) => json_response(201, &endpoint),
        CreateOutcome::LimitReached => problem_response(Problem::WebhookEndpointLimit),
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

/// An account's answer, and whether it names an account that existed.
fn account_response(outcome: AccountOutcome) -> (StoredResponse, bool) {
    match outcome {
        AccountOutcome::Created(a) => (json_response(201, &a), false),
        AccountOutcome::Existing(a) => (json_response(200, &a), true),
        AccountOutcome::Mismatch => (problem_response(Problem::ResourceMismatch), false),
    }
}

/// A charge's answer, and whether it names a charge that existed.
fn charge_response(outcome: ChargeOutcome) -> (StoredResponse, bool) {
    let problem = match outcome {
        ChargeOutcome::Created(c) => return (json_response(201, &c), false),
        ChargeOutcome::ReferenceReplay(c) => return (json_response(200, &c), true),
        ChargeOutcome::ReferenceMismatch => Problem::ResourceMismatch,
        ChargeOutcome::AccountNotFound => Problem::AccountNotFound,
        ChargeOutcome::CurrencyMismatch => Problem::CurrencyMismatch,
        ChargeOutcome::InsufficientFunds => Problem::InsufficientFunds,
        ChargeOutcome::BalanceOverflow => Problem::BalanceOverflow,
    };
    (problem_response(problem), false)
}

fn refund_response(outcome: RefundOutcome) -> StoredResponse {
    match outcome {
        RefundOutcome::Created(refund) => json_response(201, &refund),
        RefundOutcome::ChargeNotFound => problem_response(Problem::NotFound),
        RefundOutcome::NotCaptured => problem_response(Problem::InvalidChargeState(
            "only captured money can be refunded; this charge is not captured".into(),
        )),
        RefundOutcome::ExceedsCharge => problem_response(Problem::RefundExceedsCharge),
        RefundOutcome::InsufficientFunds => problem_response(Problem::InsufficientFunds),
        RefundOutcome::BalanceOverflow => problem_response(Problem::BalanceOverflow),
    }
}
