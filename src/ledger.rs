//! Accounts, charges, refunds and entries: the business rules of a
//! double-entry ledger, as functions on a connection and outcomes as enums.
//!
//! Write functions expect the caller (the writer thread) to hold a
//! `BEGIN IMMEDIATE` transaction: a charge's entries, both balance updates and
//! the stored answer commit together or not at all. This module knows nothing
//! about HTTP or idempotency keys; it records which operation produced what.

use serde_json::Value;

use crate::error::Result;
use crate::events::{self, EventType};
use crate::idempotency::Fingerprint;
use crate::ids;
use crate::json;
use crate::model::{
    AccountObject, AccountRequest, ChargeObject, ChargeRequest, EntryObject, ListObject, Page,
    RefundObject, RefundRequest,
};
use crate::store::{Dialect, params, Db, Row};
use crate::time::rfc3339;

/// Which reservation produced a charge or refund (kept forever, unlike the
/// key row, so that invariant 4 can be checked after retention).
#[derive(Debug, Clone)]
pub struct Origin<'a> {
    pub op_id: &'a str,
    pub key: &'a str,
}

#[derive(Debug, Clone)]
pub struct AccountRow {
    pub id: i64,
    pub public_id: String,
    pub currency: String,
    pub allow_negative: bool,
    pub metadata: String,
    pub balance: i64,
    pub created_at_ms: i64,
    /// Sum of the holds drawing on this account.
    pub held: i64,
    /// Sum of what those holds may still credit to this account.
    pub pending_credit: i64,
}

impl AccountRow {
    pub fn object(&self) -> AccountObject {
        AccountObject {
            id: self.public_id.clone(),
            object: "account",
            currency: self.currency.clone(),
            balance: self.balance,
            held: self.held,
            available: self.balance.saturating_sub(self.held),
            allow_negative: self.allow_negative,
            metadata: json::from_slice(self.metadata.as_bytes()).unwrap_or(Value::Null),
            created_at: rfc3339(self.created_at_ms),
        }
    }

    /// Whether `amount` may leave this account now or later (a hold): its
    /// available balance covers it unless it may go negative, and its balance
    /// minus every hold stays an i64. `Err` is the outcome to answer.
    fn can_debit(&self, amount: i64) -> std::result::Result<(), Shortfall> {
        // `held` itself must stay an i64 too: SQLite would turn an
        // overflowing `held + amount` into a float.
        let Some(after) = self
            .balance
            .checked_sub(self.held)
            .and_then(|a| a.checked_sub(amount))
            .filter(|_| self.held.checked_add(amount).is_some())
        else {
            return Err(Shortfall::Overflow);
        };
        if !self.allow_negative && after < 0 {
            return Err(Shortfall::Funds);
        }
        Ok(())
    }

    /// Whether `amount` may be credited now or later: the balance plus every
    /// credit a hold may still bring stays an i64, so that a capture, which
    /// cannot be refused once the acquirer captured, never overflows.
    fn can_credit(&self, amount: i64) -> std::result::Result<(), Shortfall> {
        self.balance
            .checked_add(self.pending_credit)
            .and_then(|b| b.checked_add(amount))
            .and(self.pending_credit.checked_add(amount))
            .map(|_| ())
            .ok_or(Shortfall::Overflow)
    }

    fn same_fields(&self, req: &AccountRequest) -> bool {
        self.currency == req.currency.as_str()
            && self.allow_negative == req.allow_negative
            && json::from_slice(self.metadata.as_bytes()).ok().as_ref() == Some(&req.metadata)
    }
}

/// Why money cannot move: not enough available funds, or a balance would
/// leave the range of i64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shortfall {
    Funds,
    Overflow,
}

const ACCOUNT_COLUMNS: &str =
    "id, public_id, currency, allow_negative, metadata, balance, created_at, held, pending_credit";

fn row_to_account(r: &dyn Row) -> Result<AccountRow> {
    Ok(AccountRow {
        id: r.get(0)?,
        public_id: r.get(1)?,
        currency: r.get(2)?,
        allow_negative: r.get(3)?,
        metadata: r.get(4)?,
        balance: r.get(5)?,
        created_at_ms: r.get(6)?,
        held: r.get(7)?,
        pending_credit: r.get(8)?,
    })
}

pub fn find_account(db: &dyn Db, consumer_id: i64, public_id: &str) -> Result<Option<AccountRow>> {
    let sql =
        format!("SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE consumer_id = ?1 AND public_id = ?2");
    db.query_opt(&sql, params![consumer_id, public_id], row_to_account)
}

#[derive(Debug)]
pub enum AccountOutcome {
    Created(AccountObject),
    /// The natural id exists with the same fields: answer it (200, replayed).
    Existing(AccountObject),
    /// The natural id exists with other fields: 422 `resource-mismatch`.
    Mismatch,
}

pub fn create_account(
    tx: &dyn Db,
    consumer_id: i64,
    req: &AccountRequest,
    now_ms: i64,
) -> Result<AccountOutcome> {
    let db = tx;
    if let Some(id) = &req.id {
        if let Some(existing) = find_account(db, consumer_id, id)? {
            return Ok(if existing.same_fields(req) {
                AccountOutcome::Existing(existing.object())
            } else {
                AccountOutcome::Mismatch
            });
        }
    }
    let row = AccountRow {
        id: 0,
        public_id: req.id.clone().unwrap_or_else(|| ids::new_id(ids::ACCOUNT)),
        currency: req.currency.as_str().to_string(),
        allow_negative: req.allow_negative,
        metadata: req.metadata.to_string(),
        balance: 0,
        created_at_ms: now_ms,
        held: 0,
        pending_credit: 0,
    };
    db.execute(
        "INSERT INTO accounts (consumer_id, public_id, currency, allow_negative, metadata, \
         balance, created_at) VALUES (?1, ?2, ?3, ?4, ?5, 0, ?6)",
        params![
            consumer_id,
            row.public_id,
            row.currency,
            row.allow_negative,
            row.metadata,
            now_ms
        ],
    )?;
    let object = row.object();
    events::record(
        tx,
        consumer_id,
        EventType::AccountCreated,
        &object.id,
        &object,
        now_ms,
    )?;
    Ok(AccountOutcome::Created(object))
}

// ---------------------------------------------------------------------------
// Charges

#[derive(Debug)]
pub enum ChargeOutcome {
    /// Created: `succeeded` (captured at once) or `requires_capture` (held).
    Created(ChargeObject),
    /// A charge with this `reference` and the same body exists: answer it.
    ReferenceReplay(ChargeObject),
    /// The `reference` belongs to a charge with another body.
    ReferenceMismatch,
    AccountNotFound,
    CurrencyMismatch,
    InsufficientFunds,
    /// A balance would leave the range of i64.
    BalanceOverflow,
}

const CHARGE_SELECT: &str = "SELECT c.id, c.public_id, c.amount, c.currency, s.public_id, \
     d.public_id, c.amount_refunded, c.reference, c.description, c.metadata, c.created_at, \
     c.fingerprint, c.status, c.amount_captured, c.amount_disputed, c.authorization_id, \
     c.expires_at, c.canceled_at, c.cancellation_reason, c.claimed_by, c.source_id, \
     c.destination_id FROM charges c JOIN accounts s ON s.id = c.source_id \
     JOIN accounts d ON d.id = c.destination_id";

struct ChargeRow {
    id: i64,
    object: ChargeObject,
    fingerprint: Vec<u8>,
    claimed_by: Option<String>,
    expires_at_ms: Option<i64>,
    source_id: i64,
    destination_id: i64,
}

/// The statuses of the contract, as the static strings objects carry.
fn status_str(s: &str) -> &'static str {
    match s {
        "requires_capture" => "requires_capture",
        "canceled" => "canceled",
        _ => "succeeded",
    }
}

fn reason_str(s: Option<String>) -> Option<&'static str> {
    s.map(|r| match r.as_str() {
        "expired" => "expired",
        _ => "requested",
    })
}

fn row_to_charge(r: &dyn Row) -> Result<ChargeRow> {
    let metadata: String = r.get(9)?;
    let status = status_str(&r.get::<String>(12)?);
    let amount: i64 = r.get(2)?;
    let expires_at_ms: Option<i64> = r.get(16)?;
    Ok(ChargeRow {
        id: r.get(0)?,
        object: ChargeObject {
            id: r.get(1)?,
            object: "charge",
            amount,
            currency: r.get(3)?,
            source: r.get(4)?,
            destination: r.get(5)?,
            status,
            amount_captured: r.get(13)?,
            amount_capturable: if status == "requires_capture" {
                amount
            } else {
                0
            },
            amount_refunded: r.get(6)?,
            amount_disputed: r.get(14)?,
            authorization: r.get(15)?,
            reference: r.get(7)?,
            description: r.get(8)?,
            metadata: json::from_slice(metadata.as_bytes()).unwrap_or(Value::Null),
            expires_at: expires_at_ms.map(rfc3339),
            canceled_at: r.get::<Option<i64>>(17)?.map(rfc3339),
            cancellation_reason: reason_str(r.get(18)?),
            created_at: rfc3339(r.get(10)?),
        },
        fingerprint: r.get(11)?,
        claimed_by: r.get(19)?,
        expires_at_ms,
        source_id: r.get(20)?,
        destination_id: r.get(21)?,
    })
}

fn find_charge(db: &dyn Db, consumer_id: i64, public_id: &str) -> Result<Option<ChargeRow>> {
    let sql = format!("{CHARGE_SELECT} WHERE c.consumer_id = ?1 AND c.public_id = ?2");
    db.query_opt(&sql, params![consumer_id, public_id], row_to_charge)
}

fn find_by_reference(db: &dyn Db, consumer_id: i64, reference: &str) -> Result<Option<ChargeRow>> {
    let sql = format!("{CHARGE_SELECT} WHERE c.consumer_id = ?1 AND c.reference = ?2");
    db.query_opt(&sql, params![consumer_id, reference], row_to_charge)
}

pub fn get_charge(db: &dyn Db, consumer_id: i64, public_id: &str) -> Result<Option<ChargeObject>> {
    Ok(find_charge(db, consumer_id, public_id)?.map(|c| c.object))
}

/// The rules a charge must pass, checked before the acquirer is called (on a
/// reader) and again inside the ledger transaction. `Ok(None)` means go
/// ahead; otherwise the final outcome, and the accounts when it is a go.
/// A hold is checked like a charge: the money may leave when it is captured.
fn check_charge(
    db: &dyn Db,
    consumer_id: i64,
    req: &ChargeRequest,
    fp: &Fingerprint,
) -> Result<Result<(AccountRow, AccountRow), ChargeOutcome>> {
    if let Some(reference) = &req.reference {
        if let Some(existing) = find_by_reference(db, consumer_id, reference)? {
            return Ok(Err(if existing.fingerprint.as_slice() == fp.as_slice() {
                ChargeOutcome::ReferenceReplay(existing.object)
            } else {
                ChargeOutcome::ReferenceMismatch
            }));
        }
    }
    let source = find_account(db, consumer_id, &req.source)?;
    let destination = find_account(db, consumer_id, &req.destination)?;
    let (Some(source), Some(destination)) = (source, destination) else {
        return Ok(Err(ChargeOutcome::AccountNotFound));
    };
    let currency = req.currency.as_str();
    if source.currency != currency || destination.currency != currency {
        return Ok(Err(ChargeOutcome::CurrencyMismatch));
    }
    let checked = source
        .can_debit(req.amount)
        .and_then(|()| destination.can_credit(req.amount));
    match checked {
        Ok(()) => Ok(Ok((source, destination))),
        Err(Shortfall::Funds) => Ok(Err(ChargeOutcome::InsufficientFunds)),
        Err(Shortfall::Overflow) => Ok(Err(ChargeOutcome::BalanceOverflow)),
    }
}

/// The outcome a charge would have if it ran now, when that outcome is final
/// without the acquirer (reference replay or mismatch, missing account,
/// currency mismatch, insufficient funds). `None`: call the acquirer.
pub fn precheck_charge(
    db: &dyn Db,
    consumer_id: i64,
    req: &ChargeRequest,
    fp: &Fingerprint,
) -> Result<Option<ChargeOutcome>> {
    Ok(check_charge(db, consumer_id, req, fp)?.err())
}

/// The ledger phase of a charge, after checking every rule again: captured
/// at once (two entries, both balances), or, with `capture: false`, a hold
/// on the source and room reserved on the destination until `expires_at_ms`.
#[allow(clippy::too_many_arguments)]
pub fn apply_charge(
    tx: &dyn Db,
    consumer_id: i64,
    req: &ChargeRequest,
    fp: &Fingerprint,
    origin: &Origin<'_>,
    authorization_id: &str,
    now_ms: i64,
    expires_at_ms: i64,
) -> Result<ChargeOutcome> {
    let db = tx;
    let (source, destination) = match check_charge(db, consumer_id, req, fp)? {
        Ok(accounts) => accounts,
        Err(outcome) => return Ok(outcome),
    };
    let public_id = ids::new_id(ids::CHARGE);
    let metadata = req.metadata.to_string();
    let (status, captured, expires_at) = if req.capture {
        ("succeeded", req.amount, None)
    } else {
        ("requires_capture", 0, Some(expires_at_ms))
    };
    let charge_id = db.query_value::<i64>(
        "INSERT INTO charges (consumer_id, public_id, amount, currency, source_id, destination_id, \
         reference, description, metadata, fingerprint, op_id, idempotency_key, authorization_id, \
         created_at, status, amount_captured, expires_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17) \
         RETURNING id",
        params![
            consumer_id,
            public_id,
            req.amount,
            req.currency.as_str(),
            source.id,
            destination.id,
            req.reference,
            req.description,
            metadata,
            fp.as_slice(),
            origin.op_id,
            origin.key,
            authorization_id,
            now_ms,
            status,
            captured,
            expires_at,
        ],
    )?;
    if req.capture {
        post_entry(db, source.id, -req.amount, charge_id, None, now_ms)?;
        post_entry(db, destination.id, req.amount, charge_id, None, now_ms)?;
    } else {
        hold(db, source.id, destination.id, req.amount)?;
    }
    let object = ChargeObject {
        id: public_id,
        object: "charge",
        amount: req.amount,
        currency: req.currency.as_str().to_string(),
        source: source.public_id,
        destination: destination.public_id,
        status,
        amount_captured: captured,
        amount_capturable: req.amount - captured,
        amount_refunded: 0,
        amount_disputed: 0,
        authorization: authorization_id.to_string(),
        reference: req.reference.clone(),
        description: req.description.clone(),
        metadata: req.metadata.clone(),
        expires_at: expires_at.map(rfc3339),
        canceled_at: None,
        cancellation_reason: None,
        created_at: rfc3339(now_ms),
    };
    let kind = if req.capture {
        EventType::ChargeSucceeded
    } else {
        EventType::ChargeAuthorized
    };
    events::record(tx, consumer_id, kind, &object.id, &object, now_ms)?;
    if req.capture {
        // Chargebacks that overtook this authorization apply now.
        crate::inbound::settle_unmatched(tx, consumer_id, authorization_id, now_ms)?;
    }
    Ok(ChargeOutcome::Created(object))
}

/// Places (positive `amount`) or releases (negative) a hold: the source's
/// `held` and the destination's `pending_credit` move together.
fn hold(db: &dyn Db, source_id: i64, destination_id: i64, amount: i64) -> Result<()> {
    db.execute(
        "UPDATE accounts SET held = held + ?2 WHERE id = ?1",
        params![source_id, amount],
    )?;
    db.execute(
        "UPDATE accounts SET pending_credit = pending_credit + ?2 WHERE id = ?1",
        params![destination_id, amount],
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Captures, cancels and expiry of holds

/// What a capture or a cancel asks of a held charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Capture this much (`None`: all of it).
    Capture(Option<i64>),
    Cancel,
}

/// The outcome of claiming a held charge for a capture or a cancel.
#[derive(Debug)]
pub enum ClaimOutcome {
    /// The charge is this operation's to capture or cancel: nobody else
    /// may. Whoever runs the operation (this owner, or one that takes it
    /// over) reads its authorization and amount with [`claimed_charge`].
    Claimed,
    NotFound,
    /// Not `requires_capture`, already claimed by another capture or cancel,
    /// or (for a capture) past its expiry: 409 `invalid-charge-state`.
    InvalidState(String),
    /// More than the charge's `amount_capturable`: 422.
    ExceedsAuthorization,
}

/// Claims the held charge `charge` for the operation `claimer`, inside the
/// transaction that reserves its key: of a capture and a cancel that race,
/// the first to reserve wins and the other is told 409 before it calls the
/// acquirer.
pub fn claim_charge(
    db: &dyn Db,
    consumer_id: i64,
    charge: &str,
    claim: Claim,
    claimer: &str,
    now_ms: i64,
) -> Result<ClaimOutcome> {
    let Some(row) = find_charge(db, consumer_id, charge)? else {
        return Ok(ClaimOutcome::NotFound);
    };
    if row.object.status != "requires_capture" {
        return Ok(ClaimOutcome::InvalidState(format!(
            "the charge is {}; only a requires_capture charge can be captured or canceled",
            row.object.status
        )));
    }
    match row.claimed_by.as_deref() {
        None => {}
        Some(EXPIRY_CLAIMER) => {
            return Ok(ClaimOutcome::InvalidState(
                "the hold expired and is being released".into(),
            ))
        }
        Some(_) => {
            return Ok(ClaimOutcome::InvalidState(
                "another capture or cancel of this charge is in progress".into(),
            ))
        }
    }
    if let Claim::Capture(amount) = claim {
        if row.expires_at_ms.is_some_and(|at| now_ms >= at) {
            return Ok(ClaimOutcome::InvalidState(
                "the authorization expired; it can no longer be captured".into(),
            ));
        }
        if amount.unwrap_or(row.object.amount) > row.object.amount_capturable {
            return Ok(ClaimOutcome::ExceedsAuthorization);
        }
    }
    db.execute(
        "UPDATE charges SET claimed_by = ?2 WHERE id = ?1",
        params![row.id, claimer],
    )?;
    Ok(ClaimOutcome::Claimed)
}

/// Releases the claim the operation `claimer` holds on a hold, if any, and
/// returns that charge's id: the hold is free again for the next capture or
/// cancel. Only for an operation that never reached the acquirer (`idem keys
/// evict` of an orphaned capture or cancel at recovery point `reserved`),
/// inside the transaction that deletes its key.
#[cfg(any(feature = "cli", feature = "internals"))]
pub fn release_claim(db: &dyn Db, claimer: &str) -> Result<Option<String>> {
    db.query_opt(
        "UPDATE charges SET claimed_by = NULL WHERE claimed_by = ?1 \
         AND status = 'requires_capture' RETURNING public_id",
        params![claimer],
        |r| r.get(0),
    )
}

/// The authorization and the amount to capture of the charge `claimer`
/// claimed (for an owner that resumes a capture or a cancel).
pub fn claimed_charge(
    db: &dyn Db,
    consumer_id: i64,
    charge: &str,
    claim: Claim,
) -> Result<Option<(String, i64)>> {
    Ok(find_charge(db, consumer_id, charge)?.map(|row| {
        let amount = match claim {
            Claim::Capture(amount) => amount.unwrap_or(row.object.amount),
            Claim::Cancel => row.object.amount,
        };
        (row.object.authorization, amount)
    }))
}

/// The held charge `claimer` claimed, its whole hold released (the first
/// step of a capture's or a cancel's ledger phase). A charge that is not
/// held and claimed by the caller (a bug, or a database edited by hand)
/// refuses the ledger phase.
fn release_claimed(
    db: &dyn Db,
    consumer_id: i64,
    charge: &str,
    claimer: &str,
) -> Result<ChargeRow> {
    let row = find_charge(db, consumer_id, charge)?
        .filter(|r| {
            r.object.status == "requires_capture" && r.claimed_by.as_deref() == Some(claimer)
        })
        .ok_or_else(|| {
            crate::error::Error::Other(format!(
                "charge {charge} is not held and claimed by {claimer}"
            ))
        })?;
    hold(db, row.source_id, row.destination_id, -row.object.amount)?;
    Ok(row)
}

/// The ledger phase of a capture the acquirer has made: entries for
/// `amount`, the whole hold released (one capture per authorization; the
/// rest is released), `succeeded`. The hold guarantees the funds and the
/// room, so this cannot be refused.
pub fn apply_capture(
    tx: &dyn Db,
    consumer_id: i64,
    charge: &str,
    claimer: &str,
    amount: i64,
    now_ms: i64,
) -> Result<ChargeObject> {
    let db = tx;
    let row = release_claimed(db, consumer_id, charge, claimer)?;
    post_entry(db, row.source_id, -amount, row.id, None, now_ms)?;
    post_entry(db, row.destination_id, amount, row.id, None, now_ms)?;
    db.execute(
        "UPDATE charges SET status = 'succeeded', amount_captured = ?2, expires_at = NULL, \
         claimed_by = NULL, captured_at = ?3 WHERE id = ?1",
        params![row.id, amount, now_ms],
    )?;
    let object = find_charge(db, consumer_id, charge)?
        .expect("the charge was just updated")
        .object;
    events::record(
        tx,
        consumer_id,
        EventType::ChargeCaptured,
        &object.id,
        &object,
        now_ms,
    )?;
    // Chargebacks that arrived while it was a hold apply now.
    crate::inbound::settle_unmatched(tx, consumer_id, &object.authorization, now_ms)?;
    Ok(object)
}

/// Why a hold was released without a capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancellationReason {
    /// `POST /v1/charges/{id}/cancel`.
    Requested,
    /// The reaper, after `--authorization-ttl`.
    Expired,
}

/// The ledger phase of a cancel (or an expiry) whose authorization the
/// acquirer has voided: the hold released, `canceled`.
pub fn apply_cancel(
    tx: &dyn Db,
    consumer_id: i64,
    charge: &str,
    claimer: &str,
    reason: CancellationReason,
    now_ms: i64,
) -> Result<ChargeObject> {
    let db = tx;
    let row = release_claimed(db, consumer_id, charge, claimer)?;
    let reason = match reason {
        CancellationReason::Requested => "requested",
        CancellationReason::Expired => "expired",
    };
    db.execute(
        "UPDATE charges SET status = 'canceled', canceled_at = ?2, cancellation_reason = ?3, \
         expires_at = NULL, claimed_by = NULL WHERE id = ?1",
        params![row.id, now_ms, reason],
    )?;
    let object = find_charge(db, consumer_id, charge)?
        .expect("the charge was just updated")
        .object;
    events::record(
        tx,
        consumer_id,
        EventType::ChargeCanceled,
        &object.id,
        &object,
        now_ms,
    )?;
    let why = if reason == "expired" {
        "expired"
    } else {
        "canceled"
    };
    crate::inbound::release_unmatched(tx, consumer_id, &object.authorization, why)?;
    Ok(object)
}

/// Who claims a hold when the reaper expires it.
pub const EXPIRY_CLAIMER: &str = "expiry";

/// A hold past its expiry that no capture or cancel has claimed (or that an
/// earlier reaper pass claimed and did not finish).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiredHold {
    pub consumer_id: i64,
    pub charge: String,
    pub authorization: String,
}

/// Up to `limit` holds whose expiry is at or before `now_ms`, oldest first.
pub fn expired_holds(db: &dyn Db, now_ms: i64, limit: usize) -> Result<Vec<ExpiredHold>> {
    // `expires_at <= ?1` leaves out NULLs, so their order does not matter.
    db.query_all(
        "SELECT consumer_id, public_id, authorization_id FROM charges \
         WHERE status = 'requires_capture' AND expires_at <= ?1 \
         AND (claimed_by IS NULL OR claimed_by = ?2) ORDER BY expires_at LIMIT ?3",
        params![now_ms, EXPIRY_CLAIMER, limit as i64],
        |r| {
            Ok(ExpiredHold {
                consumer_id: r.get(0)?,
                charge: r.get(1)?,
                authorization: r.get(2)?,
            })
        },
    )
}

/// Claims an expired hold for the reaper; false if a capture or cancel
/// claimed it first, or it is no longer held. On a database several servers
/// share (PostgreSQL) the claim is also a lease until `lease_until_ms`:
/// while another node's reaper holds one (it is voiding the hold now), or
/// is claiming the row at this moment (`FOR UPDATE SKIP LOCKED`), this is
/// false too; a node that died mid-expiry leaves a lease that lapses.
pub fn claim_expired(
    db: &dyn Db,
    hold: &ExpiredHold,
    now_ms: i64,
    lease_until_ms: i64,
) -> Result<bool> {
    let n = match db.dialect() {
        Dialect::Sqlite => db.execute(
            "UPDATE charges SET claimed_by = ?3 WHERE consumer_id = ?1 AND public_id = ?2 \
             AND status = 'requires_capture' AND expires_at <= ?4 \
             AND (claimed_by IS NULL OR claimed_by = ?3)",
            params![hold.consumer_id, hold.charge, EXPIRY_CLAIMER, now_ms],
        )?,
        Dialect::Postgres => db.execute(
            "UPDATE charges SET claimed_by = ?3, expiry_leased_until = ?5 WHERE id = ( \
               SELECT id FROM charges WHERE consumer_id = ?1 AND public_id = ?2 \
               AND status = 'requires_capture' AND expires_at <= ?4 \
               AND (claimed_by IS NULL OR (claimed_by = ?3 AND expiry_leased_until < ?4)) \
               FOR UPDATE SKIP LOCKED)",
            params![hold.consumer_id, hold.charge, EXPIRY_CLAIMER, now_ms, lease_until_ms],
        )?,
    };
    Ok(n == 1)
}

/// Writes one entry and moves the account's balance by `amount`. The caller
/// has checked that the balance stays in range.
fn post_entry(
    db: &dyn Db,
    account_id: i64,
    amount: i64,
    charge_id: i64,
    refund_id: Option<i64>,
    now_ms: i64,
) -> Result<()> {
    db.execute(
        "INSERT INTO entries (public_id, account_id, amount, charge_id, refund_id, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![
            ids::new_id(ids::ENTRY),
            account_id,
            amount,
            charge_id,
            refund_id,
            now_ms
        ],
    )?;
    let n = db.execute(
        "UPDATE accounts SET balance = balance + ?2 WHERE id = ?1",
        params![account_id, amount],
    )?;
    assert_eq!(n, 1, "entry for a missing account {account_id}");
    Ok(())
}

// ---------------------------------------------------------------------------
// Refunds

#[derive(Debug)]
pub enum RefundOutcome {
    /// Applied to the ledger; the acquirer's refund is due (its owner reads
    /// what to refund with [`applied_refund`]).
    Created(RefundObject),
    ChargeNotFound,
    /// The charge is not captured (`requires_capture` or `canceled`): 409.
    NotCaptured,
    /// More than what is left to refund, or nothing left.
    ExceedsCharge,
    /// The destination would go below zero without `allow_negative`.
    InsufficientFunds,
    BalanceOverflow,
}

pub fn apply_refund(
    tx: &dyn Db,
    consumer_id: i64,
    req: &RefundRequest,
    origin: &Origin<'_>,
    now_ms: i64,
) -> Result<RefundOutcome> {
    let db = tx;
    let Some(charge) = find_charge(db, consumer_id, &req.charge)? else {
        return Ok(RefundOutcome::ChargeNotFound);
    };
    if charge.object.status != "succeeded" {
        return Ok(RefundOutcome::NotCaptured);
    }
    // Only captured money can go back, less what went back already.
    let left = charge.object.amount_captured
        - charge.object.amount_refunded
        - charge.object.amount_disputed;
    let amount = req.amount.unwrap_or(left);
    if amount <= 0 || amount > left {
        return Ok(RefundOutcome::ExceedsCharge);
    }
    let source = find_account(db, consumer_id, &charge.object.source)?.expect("charge source");
    let destination =
        find_account(db, consumer_id, &charge.object.destination)?.expect("charge destination");
    match destination
        .can_debit(amount)
        .and_then(|()| source.can_credit(amount))
    {
        Ok(()) => {}
        Err(Shortfall::Funds) => return Ok(RefundOutcome::InsufficientFunds),
        Err(Shortfall::Overflow) => return Ok(RefundOutcome::BalanceOverflow),
    }
    let public_id = ids::new_id(ids::REFUND);
    let refund_id = db.query_value::<i64>(
        "INSERT INTO refunds (consumer_id, public_id, charge_id, amount, op_id, idempotency_key, \
         created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) RETURNING id",
        params![
            consumer_id,
            public_id,
            charge.id,
            amount,
            origin.op_id,
            origin.key,
            now_ms
        ],
    )?;
    db.execute(
        "UPDATE charges SET amount_refunded = amount_refunded + ?2 WHERE id = ?1",
        params![charge.id, amount],
    )?;
    post_entry(
        db,
        destination.id,
        -amount,
        charge.id,
        Some(refund_id),
        now_ms,
    )?;
    post_entry(db, source.id, amount, charge.id, Some(refund_id), now_ms)?;
    let object = RefundObject {
        id: public_id,
        object: "refund",
        charge: charge.object.id,
        amount,
        created_at: rfc3339(now_ms),
    };
    events::record(
        tx,
        consumer_id,
        EventType::RefundCreated,
        &object.id,
        &object,
        now_ms,
    )?;
    Ok(RefundOutcome::Created(object))
}

/// The charge's authorization and the amount of the refund that the
/// operation `op_id` applied (for an owner that resumes its acquirer call).
pub fn applied_refund(db: &dyn Db, op_id: &str) -> Result<Option<(String, i64)>> {
    db.query_opt(
        "SELECT c.authorization_id, r.amount FROM refunds r \
         JOIN charges c ON c.id = r.charge_id WHERE r.op_id = ?1",
        params![op_id],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
}

// ---------------------------------------------------------------------------
// Lists

/// `starting_after` names no object of this list.
#[derive(Debug, PartialEq, Eq)]
pub struct UnknownCursor;

/// Runs a newest-first page query. `cursor_sql` maps the public id in
/// `starting_after` to the internal id (or nothing); `page_sql` takes the
/// scope parameter, an exclusive upper bound on the internal id, and a limit.
pub(crate) fn page<T>(
    db: &dyn Db,
    scope: i64,
    page: &Page,
    cursor_sql: &str,
    page_sql: &str,
    map: impl FnMut(&dyn Row) -> Result<T>,
) -> Result<Result<ListObject<T>, UnknownCursor>> {
    let before = match &page.starting_after {
        None => i64::MAX,
        Some(cursor) => match db.query_opt(cursor_sql, params![scope, cursor], |r| r.get(0))? {
            Some(id) => id,
            None => return Ok(Err(UnknownCursor)),
        },
    };
    let mut data = db.query_all(page_sql, params![scope, before, page.limit as i64 + 1], map)?;
    let has_more = data.len() > page.limit;
    data.truncate(page.limit);
    Ok(Ok(ListObject {
        object: "list",
        data,
        has_more,
    }))
}

pub fn list_charges(
    db: &dyn Db,
    consumer_id: i64,
    p: &Page,
) -> Result<Result<ListObject<ChargeObject>, UnknownCursor>> {
    let page_sql = format!(
        "{CHARGE_SELECT} WHERE c.consumer_id = ?1 AND c.id < ?2 ORDER BY c.id DESC LIMIT ?3"
    );
    page(
        db,
        consumer_id,
        p,
        "SELECT id FROM charges WHERE consumer_id = ?1 AND public_id = ?2",
        &page_sql,
        |r| row_to_charge(r).map(|c| c.object),
    )
}

pub fn list_entries(
    db: &dyn Db,
    account: &AccountRow,
    p: &Page,
) -> Result<Result<ListObject<EntryObject>, UnknownCursor>> {
    page(
        db,
        account.id,
        p,
        "SELECT id FROM entries WHERE account_id = ?1 AND public_id = ?2",
        "SELECT e.public_id, e.amount, c.public_id, r.public_id, e.created_at, d.public_id \
         FROM entries e JOIN charges c ON c.id = e.charge_id \
         LEFT JOIN refunds r ON r.id = e.refund_id LEFT JOIN disputes d ON d.id = e.dispute_id \
         WHERE e.account_id = ?1 AND e.id < ?2 ORDER BY e.id DESC LIMIT ?3",
        |r| {
            Ok(EntryObject {
                id: r.get(0)?,
                object: "entry",
                account: account.public_id.clone(),
                amount: r.get(1)?,
                charge: r.get(2)?,
                refund: r.get(3)?,
                dispute: r.get(5)?,
                created_at: rfc3339(r.get(4)?),
            })
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(balance: i64, held: i64, pending_credit: i64, allow_negative: bool) -> AccountRow {
        AccountRow {
            id: 1,
            public_id: "a".into(),
            currency: "BRL".into(),
            allow_negative,
            metadata: "{}".into(),
            balance,
            created_at_ms: 0,
            held,
            pending_credit,
        }
    }

    const MAX: i64 = crate::config::AMOUNT_MINOR_MAX;

    #[test]
    fn debits_check_available_and_every_sum_at_the_edges_of_i64() {
        // Available funds, not the balance.
        assert_eq!(account(100, 60, 0, false).can_debit(40), Ok(()));
        assert_eq!(
            account(100, 60, 0, false).can_debit(41),
            Err(Shortfall::Funds)
        );
        // A source that may go negative: balance - held - amount must fit.
        assert_eq!(account(i64::MIN + MAX, 0, 0, true).can_debit(MAX), Ok(()));
        assert_eq!(
            account(i64::MIN + MAX, 1, 0, true).can_debit(MAX),
            Err(Shortfall::Overflow)
        );
        // And `held` itself: a positive balance does not let holds push it
        // past i64::MAX (SQLite would store a float).
        assert_eq!(
            account(MAX, i64::MAX - MAX + 1, 0, true).can_debit(MAX),
            Err(Shortfall::Overflow)
        );
        assert_eq!(account(MAX, i64::MAX - MAX, 0, true).can_debit(MAX), Ok(()));
    }

    #[test]
    fn credits_leave_room_for_every_pending_capture() {
        assert_eq!(account(i64::MAX - MAX, 0, 0, false).can_credit(MAX), Ok(()));
        assert_eq!(
            account(i64::MAX - MAX, 1, 1, false).can_credit(MAX),
            Err(Shortfall::Overflow)
        );
        // A negative balance does not let pending_credit itself overflow.
        assert_eq!(
            account(-MAX, 0, i64::MAX - MAX + 1, true).can_credit(MAX),
            Err(Shortfall::Overflow)
        );
        assert_eq!(
            account(-MAX, 0, i64::MAX - MAX, true).can_credit(MAX),
            Ok(())
        );
    }
}
