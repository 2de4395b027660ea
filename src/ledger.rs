//! Accounts, charges, refunds and entries: the business rules of a
//! double-entry ledger, as functions on a connection and outcomes as enums.
//!
//! Write functions expect the caller (the writer thread) to hold a
//! `BEGIN IMMEDIATE` transaction: a charge's entries, both balance updates and
//! the stored answer commit together or not at all. This module knows nothing
//! about HTTP or idempotency keys; it records which operation produced what.

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde_json::Value;

use crate::error::Result;
use crate::idempotency::Fingerprint;
use crate::ids;
use crate::json;
use crate::model::{
    AccountObject, AccountRequest, ChargeObject, ChargeRequest, EntryObject, ListObject, Page,
    RefundObject, RefundRequest,
};
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
}

impl AccountRow {
    pub fn object(&self) -> AccountObject {
        AccountObject {
            id: self.public_id.clone(),
            object: "account",
            currency: self.currency.clone(),
            balance: self.balance,
            allow_negative: self.allow_negative,
            metadata: json::from_slice(self.metadata.as_bytes()).unwrap_or(Value::Null),
            created_at: rfc3339(self.created_at_ms),
        }
    }

    fn same_fields(&self, req: &AccountRequest) -> bool {
        self.currency == req.currency.as_str()
            && self.allow_negative == req.allow_negative
            && json::from_slice(self.metadata.as_bytes()).ok().as_ref() == Some(&req.metadata)
    }
}

const ACCOUNT_COLUMNS: &str =
    "id, public_id, currency, allow_negative, metadata, balance, created_at";

fn row_to_account(r: &Row<'_>) -> rusqlite::Result<AccountRow> {
    Ok(AccountRow {
        id: r.get(0)?,
        public_id: r.get(1)?,
        currency: r.get(2)?,
        allow_negative: r.get(3)?,
        metadata: r.get(4)?,
        balance: r.get(5)?,
        created_at_ms: r.get(6)?,
    })
}

pub fn find_account(
    conn: &Connection,
    consumer_id: i64,
    public_id: &str,
) -> Result<Option<AccountRow>> {
    let sql =
        format!("SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE consumer_id = ?1 AND public_id = ?2");
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params![consumer_id, public_id], row_to_account)
        .optional()?)
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
    tx: &Connection,
    consumer_id: i64,
    req: &AccountRequest,
    now_ms: i64,
) -> Result<AccountOutcome> {
    if let Some(id) = &req.id {
        if let Some(existing) = find_account(tx, consumer_id, id)? {
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
    };
    tx.prepare_cached(
        "INSERT INTO accounts (consumer_id, public_id, currency, allow_negative, metadata, \
         balance, created_at) VALUES (?1, ?2, ?3, ?4, ?5, 0, ?6)",
    )?
    .execute(params![
        consumer_id,
        row.public_id,
        row.currency,
        row.allow_negative,
        row.metadata,
        now_ms
    ])?;
    Ok(AccountOutcome::Created(row.object()))
}

// ---------------------------------------------------------------------------
// Charges

#[derive(Debug)]
pub enum ChargeOutcome {
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
     c.fingerprint FROM charges c JOIN accounts s ON s.id = c.source_id \
     JOIN accounts d ON d.id = c.destination_id";

struct ChargeRow {
    id: i64,
    object: ChargeObject,
    fingerprint: Vec<u8>,
}

fn row_to_charge(r: &Row<'_>) -> rusqlite::Result<ChargeRow> {
    let metadata: String = r.get(9)?;
    Ok(ChargeRow {
        id: r.get(0)?,
        object: ChargeObject {
            id: r.get(1)?,
            object: "charge",
            amount: r.get(2)?,
            currency: r.get(3)?,
            source: r.get(4)?,
            destination: r.get(5)?,
            status: "succeeded",
            amount_refunded: r.get(6)?,
            reference: r.get(7)?,
            description: r.get(8)?,
            metadata: json::from_slice(metadata.as_bytes()).unwrap_or(Value::Null),
            created_at: rfc3339(r.get(10)?),
        },
        fingerprint: r.get(11)?,
    })
}

fn find_charge(conn: &Connection, consumer_id: i64, public_id: &str) -> Result<Option<ChargeRow>> {
    let sql = format!("{CHARGE_SELECT} WHERE c.consumer_id = ?1 AND c.public_id = ?2");
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params![consumer_id, public_id], row_to_charge)
        .optional()?)
}

fn find_by_reference(
    conn: &Connection,
    consumer_id: i64,
    reference: &str,
) -> Result<Option<ChargeRow>> {
    let sql = format!("{CHARGE_SELECT} WHERE c.consumer_id = ?1 AND c.reference = ?2");
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params![consumer_id, reference], row_to_charge)
        .optional()?)
}

pub fn get_charge(
    conn: &Connection,
    consumer_id: i64,
    public_id: &str,
) -> Result<Option<ChargeObject>> {
    Ok(find_charge(conn, consumer_id, public_id)?.map(|c| c.object))
}

/// The rules a charge must pass, checked before the acquirer is called (on a
/// reader) and again inside the ledger transaction. `Ok(None)` means go
/// ahead; otherwise the final outcome, and the accounts when it is a go.
fn check_charge(
    conn: &Connection,
    consumer_id: i64,
    req: &ChargeRequest,
    fp: &Fingerprint,
) -> Result<Result<(AccountRow, AccountRow), ChargeOutcome>> {
    if let Some(reference) = &req.reference {
        if let Some(existing) = find_by_reference(conn, consumer_id, reference)? {
            return Ok(Err(if existing.fingerprint.as_slice() == fp.as_slice() {
                ChargeOutcome::ReferenceReplay(existing.object)
            } else {
                ChargeOutcome::ReferenceMismatch
            }));
        }
    }
    let source = find_account(conn, consumer_id, &req.source)?;
    let destination = find_account(conn, consumer_id, &req.destination)?;
    let (Some(source), Some(destination)) = (source, destination) else {
        return Ok(Err(ChargeOutcome::AccountNotFound));
    };
    let currency = req.currency.as_str();
    if source.currency != currency || destination.currency != currency {
        return Ok(Err(ChargeOutcome::CurrencyMismatch));
    }
    let Some(new_source) = source.balance.checked_sub(req.amount) else {
        return Ok(Err(ChargeOutcome::BalanceOverflow));
    };
    if !source.allow_negative && new_source < 0 {
        return Ok(Err(ChargeOutcome::InsufficientFunds));
    }
    if destination.balance.checked_add(req.amount).is_none() {
        return Ok(Err(ChargeOutcome::BalanceOverflow));
    }
    Ok(Ok((source, destination)))
}

/// The outcome a charge would have if it ran now, when that outcome is final
/// without the acquirer (reference replay or mismatch, missing account,
/// currency mismatch, insufficient funds). `None`: call the acquirer.
pub fn precheck_charge(
    conn: &Connection,
    consumer_id: i64,
    req: &ChargeRequest,
    fp: &Fingerprint,
) -> Result<Option<ChargeOutcome>> {
    Ok(check_charge(conn, consumer_id, req, fp)?.err())
}

/// The ledger phase of a charge: create it, write its two entries and update
/// both balances, after checking every rule again.
pub fn apply_charge(
    tx: &Connection,
    consumer_id: i64,
    req: &ChargeRequest,
    fp: &Fingerprint,
    origin: &Origin<'_>,
    authorization_id: &str,
    now_ms: i64,
) -> Result<ChargeOutcome> {
    let (source, destination) = match check_charge(tx, consumer_id, req, fp)? {
        Ok(accounts) => accounts,
        Err(outcome) => return Ok(outcome),
    };
    let public_id = ids::new_id(ids::CHARGE);
    let metadata = req.metadata.to_string();
    tx.prepare_cached(
        "INSERT INTO charges (consumer_id, public_id, amount, currency, source_id, destination_id, \
         reference, description, metadata, fingerprint, op_id, idempotency_key, authorization_id, \
         created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
    )?
    .execute(params![
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
    ])?;
    let charge_id = tx.last_insert_rowid();
    post_entry(tx, source.id, -req.amount, charge_id, None, now_ms)?;
    post_entry(tx, destination.id, req.amount, charge_id, None, now_ms)?;
    Ok(ChargeOutcome::Created(ChargeObject {
        id: public_id,
        object: "charge",
        amount: req.amount,
        currency: req.currency.as_str().to_string(),
        source: source.public_id,
        destination: destination.public_id,
        status: "succeeded",
        amount_refunded: 0,
        reference: req.reference.clone(),
        description: req.description.clone(),
        metadata: req.metadata.clone(),
        created_at: rfc3339(now_ms),
    }))
}

/// Writes one entry and moves the account's balance by `amount`. The caller
/// has checked that the balance stays in range.
fn post_entry(
    tx: &Connection,
    account_id: i64,
    amount: i64,
    charge_id: i64,
    refund_id: Option<i64>,
    now_ms: i64,
) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO entries (public_id, account_id, amount, charge_id, refund_id, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        ids::new_id(ids::ENTRY),
        account_id,
        amount,
        charge_id,
        refund_id,
        now_ms
    ])?;
    let n = tx
        .prepare_cached("UPDATE accounts SET balance = balance + ?2 WHERE id = ?1")?
        .execute(params![account_id, amount])?;
    assert_eq!(n, 1, "entry for a missing account {account_id}");
    Ok(())
}

// ---------------------------------------------------------------------------
// Refunds

#[derive(Debug)]
pub enum RefundOutcome {
    Created(RefundObject),
    ChargeNotFound,
    /// More than what is left to refund, or nothing left.
    ExceedsCharge,
    /// The destination would go below zero without `allow_negative`.
    InsufficientFunds,
    BalanceOverflow,
}

pub fn apply_refund(
    tx: &Connection,
    consumer_id: i64,
    req: &RefundRequest,
    origin: &Origin<'_>,
    now_ms: i64,
) -> Result<RefundOutcome> {
    let Some(charge) = find_charge(tx, consumer_id, &req.charge)? else {
        return Ok(RefundOutcome::ChargeNotFound);
    };
    let left = charge.object.amount - charge.object.amount_refunded;
    let amount = req.amount.unwrap_or(left);
    if amount <= 0 || amount > left {
        return Ok(RefundOutcome::ExceedsCharge);
    }
    let source = find_account(tx, consumer_id, &charge.object.source)?.expect("charge source");
    let destination =
        find_account(tx, consumer_id, &charge.object.destination)?.expect("charge destination");
    let Some(new_destination) = destination.balance.checked_sub(amount) else {
        return Ok(RefundOutcome::BalanceOverflow);
    };
    if !destination.allow_negative && new_destination < 0 {
        return Ok(RefundOutcome::InsufficientFunds);
    }
    if source.balance.checked_add(amount).is_none() {
        return Ok(RefundOutcome::BalanceOverflow);
    }
    let public_id = ids::new_id(ids::REFUND);
    tx.prepare_cached(
        "INSERT INTO refunds (consumer_id, public_id, charge_id, amount, op_id, idempotency_key, \
         created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        consumer_id,
        public_id,
        charge.id,
        amount,
        origin.op_id,
        origin.key,
        now_ms
    ])?;
    let refund_id = tx.last_insert_rowid();
    tx.prepare_cached("UPDATE charges SET amount_refunded = amount_refunded + ?2 WHERE id = ?1")?
        .execute(params![charge.id, amount])?;
    post_entry(
        tx,
        destination.id,
        -amount,
        charge.id,
        Some(refund_id),
        now_ms,
    )?;
    post_entry(tx, source.id, amount, charge.id, Some(refund_id), now_ms)?;
    Ok(RefundOutcome::Created(RefundObject {
        id: public_id,
        object: "refund",
        charge: charge.object.id,
        amount,
        created_at: rfc3339(now_ms),
    }))
}

// ---------------------------------------------------------------------------
// Lists

/// `starting_after` names no object of this list.
#[derive(Debug, PartialEq, Eq)]
pub struct UnknownCursor;

/// Runs a newest-first page query. `cursor_sql` maps the public id in
/// `starting_after` to the internal id (or nothing); `page_sql` takes the
/// scope parameter, an exclusive upper bound on the internal id, and a limit.
fn page<T>(
    conn: &Connection,
    scope: i64,
    page: &Page,
    cursor_sql: &str,
    page_sql: &str,
    map: impl Fn(&Row<'_>) -> rusqlite::Result<T>,
) -> Result<Result<ListObject<T>, UnknownCursor>> {
    let before = match &page.starting_after {
        None => i64::MAX,
        Some(cursor) => match conn
            .prepare_cached(cursor_sql)?
            .query_row(params![scope, cursor], |r| r.get(0))
            .optional()?
        {
            Some(id) => id,
            None => return Ok(Err(UnknownCursor)),
        },
    };
    let mut stmt = conn.prepare_cached(page_sql)?;
    let mut data = stmt
        .query_map(params![scope, before, page.limit as i64 + 1], map)?
        .collect::<rusqlite::Result<Vec<T>>>()?;
    let has_more = data.len() > page.limit;
    data.truncate(page.limit);
    Ok(Ok(ListObject {
        object: "list",
        data,
        has_more,
    }))
}

pub fn list_charges(
    conn: &Connection,
    consumer_id: i64,
    p: &Page,
) -> Result<Result<ListObject<ChargeObject>, UnknownCursor>> {
    let page_sql = format!(
        "{CHARGE_SELECT} WHERE c.consumer_id = ?1 AND c.id < ?2 ORDER BY c.id DESC LIMIT ?3"
    );
    page(
        conn,
        consumer_id,
        p,
        "SELECT id FROM charges WHERE consumer_id = ?1 AND public_id = ?2",
        &page_sql,
        |r| row_to_charge(r).map(|c| c.object),
    )
}

pub fn list_entries(
    conn: &Connection,
    account: &AccountRow,
    p: &Page,
) -> Result<Result<ListObject<EntryObject>, UnknownCursor>> {
    page(
        conn,
        account.id,
        p,
        "SELECT id FROM entries WHERE account_id = ?1 AND public_id = ?2",
        "SELECT e.public_id, e.amount, c.public_id, r.public_id, e.created_at FROM entries e \
         JOIN charges c ON c.id = e.charge_id LEFT JOIN refunds r ON r.id = e.refund_id \
         WHERE e.account_id = ?1 AND e.id < ?2 ORDER BY e.id DESC LIMIT ?3",
        |r| {
            Ok(EntryObject {
                id: r.get(0)?,
                object: "entry",
                account: account.public_id.clone(),
                amount: r.get(1)?,
                charge: r.get(2)?,
                refund: r.get(3)?,
                created_at: rfc3339(r.get(4)?),
            })
        },
    )
}
