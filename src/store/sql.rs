//! The storage interface: what the domain modules (ledger, idempotency,
//! events, webhooks, inbound, consumers, keys, verify) see of a database.
//!
//! A [`Db`] runs one statement at a time inside a transaction that its
//! backend opened: the SQLite writer's savepoint or a reader's snapshot, or
//! a PostgreSQL transaction (`store/postgres.rs`). The domain writes its SQL
//! once, in the subset both engines share (numbered `?N` placeholders,
//! `INSERT … RETURNING id`, integers as 64-bit, bytes as blobs), and asks
//! [`Db::dialect`] only where the two differ (JSON functions, row locks).
//! No domain module names rusqlite or postgres.

use crate::error::{Error, Result};

/// Which SQL engine runs a statement, for the few statements the two write
/// differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// SQLite (the embedded default).
    Sqlite,
    /// PostgreSQL 15+.
    Postgres,
}

/// One value, as a statement takes it or a row gives it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    Null,
    Int(i64),
    Real(f64),
    Text(&'a str),
    Blob(&'a [u8]),
}

impl Value<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Value::Null => "NULL",
            Value::Int(_) => "an integer",
            Value::Real(_) => "a real",
            Value::Text(_) => "text",
            Value::Blob(_) => "a blob",
        }
    }
}

/// A statement parameter.
pub trait Arg {
    /// The value bound for this parameter.
    fn value(&self) -> Value<'_>;
}

macro_rules! int_arg {
    ($($t:ty),*) => {$(
        impl Arg for $t {
            fn value(&self) -> Value<'_> {
                Value::Int(*self as i64)
            }
        }
    )*};
}
int_arg!(i64, i32, u32, u8, u16);

impl Arg for bool {
    fn value(&self) -> Value<'_> {
        Value::Int(i64::from(*self))
    }
}
impl Arg for f64 {
    fn value(&self) -> Value<'_> {
        Value::Real(*self)
    }
}
impl Arg for str {
    fn value(&self) -> Value<'_> {
        Value::Text(self)
    }
}
impl Arg for String {
    fn value(&self) -> Value<'_> {
        Value::Text(self)
    }
}
impl Arg for [u8] {
    fn value(&self) -> Value<'_> {
        Value::Blob(self)
    }
}
impl Arg for Vec<u8> {
    fn value(&self) -> Value<'_> {
        Value::Blob(self)
    }
}
impl<const N: usize> Arg for [u8; N] {
    fn value(&self) -> Value<'_> {
        Value::Blob(self)
    }
}
impl<T: Arg + ?Sized> Arg for &T {
    fn value(&self) -> Value<'_> {
        (**self).value()
    }
}
impl<T: Arg> Arg for Option<T> {
    fn value(&self) -> Value<'_> {
        match self {
            Some(v) => v.value(),
            None => Value::Null,
        }
    }
}
impl Arg for Value<'_> {
    fn value(&self) -> Value<'_> {
        *self
    }
}

/// The parameters of a statement: `params![a, b, c]` binds `?1`, `?2`, `?3`.
macro_rules! params {
    () => {
        &[] as &[&dyn $crate::store::Arg]
    };
    ($($x:expr),+ $(,)?) => {
        &[$(&$x as &dyn $crate::store::Arg),+] as &[&dyn $crate::store::Arg]
    };
}
pub(crate) use params;

/// One row of a result.
pub trait Row {
    /// Column `i` (from 0) of this row.
    fn value(&self, i: usize) -> Result<Value<'_>>;
}

impl dyn Row + '_ {
    /// Column `i` as a `T`; a NULL or a value of another type is an error
    /// (use `Option<T>` for a nullable column).
    pub fn get<T: FromValue>(&self, i: usize) -> Result<T> {
        let v = self.value(i)?;
        T::from_value(v).ok_or_else(|| {
            Error::Storage(format!(
                "column {i} holds {}, not {}",
                v.kind(),
                std::any::type_name::<T>()
            ))
        })
    }
}

/// A Rust type a column converts to.
pub trait FromValue: Sized {
    /// `None` when the value is of another type.
    fn from_value(v: Value<'_>) -> Option<Self>;
}

impl FromValue for i64 {
    fn from_value(v: Value<'_>) -> Option<i64> {
        match v {
            Value::Int(i) => Some(i),
            _ => None,
        }
    }
}
impl FromValue for u32 {
    fn from_value(v: Value<'_>) -> Option<u32> {
        i64::from_value(v).and_then(|i| u32::try_from(i).ok())
    }
}
impl FromValue for i32 {
    fn from_value(v: Value<'_>) -> Option<i32> {
        i64::from_value(v).and_then(|i| i32::try_from(i).ok())
    }
}
impl FromValue for u64 {
    fn from_value(v: Value<'_>) -> Option<u64> {
        i64::from_value(v).and_then(|i| u64::try_from(i).ok())
    }
}
impl FromValue for bool {
    fn from_value(v: Value<'_>) -> Option<bool> {
        i64::from_value(v).map(|i| i != 0)
    }
}
impl FromValue for f64 {
    fn from_value(v: Value<'_>) -> Option<f64> {
        match v {
            Value::Real(f) => Some(f),
            Value::Int(i) => Some(i as f64),
            _ => None,
        }
    }
}
impl FromValue for String {
    fn from_value(v: Value<'_>) -> Option<String> {
        match v {
            Value::Text(s) => Some(s.to_owned()),
            _ => None,
        }
    }
}
impl FromValue for Vec<u8> {
    fn from_value(v: Value<'_>) -> Option<Vec<u8>> {
        match v {
            Value::Blob(b) => Some(b.to_vec()),
            // SQLite stores what it was given; a text column read as bytes.
            Value::Text(s) => Some(s.as_bytes().to_vec()),
            _ => None,
        }
    }
}
impl<T: FromValue> FromValue for Option<T> {
    fn from_value(v: Value<'_>) -> Option<Option<T>> {
        match v {
            Value::Null => Some(None),
            v => T::from_value(v).map(Some),
        }
    }
}

/// A database connection inside a transaction its backend manages.
///
/// Statements are written once for both engines: `?N` placeholders, the SQL
/// both accept, and [`Db::dialect`] where they differ. Each backend caches
/// the statements it prepares.
pub trait Db {
    /// The engine behind this connection.
    fn dialect(&self) -> Dialect;
    /// Runs a statement that returns no rows; the number of rows changed.
    fn execute(&self, sql: &str, args: &[&dyn Arg]) -> Result<usize>;
    /// Runs a query and calls `each` on every row, in order; an error from
    /// `each` stops it.
    fn query_each(
        &self,
        sql: &str,
        args: &[&dyn Arg],
        each: &mut dyn FnMut(&dyn Row) -> Result<()>,
    ) -> Result<()>;
}

impl dyn Db + '_ {
    /// The first row of a query, mapped; `None` if there is none.
    pub fn query_opt<T>(
        &self,
        sql: &str,
        args: &[&dyn Arg],
        mut map: impl FnMut(&dyn Row) -> Result<T>,
    ) -> Result<Option<T>> {
        let mut first = None;
        self.query_each(sql, args, &mut |r| {
            if first.is_none() {
                first = Some(map(r)?);
            }
            Ok(())
        })?;
        Ok(first)
    }

    /// The first row of a query, mapped; no row is an error.
    pub fn query_one<T>(
        &self,
        sql: &str,
        args: &[&dyn Arg],
        map: impl FnMut(&dyn Row) -> Result<T>,
    ) -> Result<T> {
        self.query_opt(sql, args, map)?
            .ok_or_else(|| Error::Storage(format!("no row from: {sql}")))
    }

    /// Every row of a query, mapped.
    pub fn query_all<T>(
        &self,
        sql: &str,
        args: &[&dyn Arg],
        mut map: impl FnMut(&dyn Row) -> Result<T>,
    ) -> Result<Vec<T>> {
        let mut all = Vec::new();
        self.query_each(sql, args, &mut |r| {
            all.push(map(r)?);
            Ok(())
        })?;
        Ok(all)
    }

    /// Whether a query returns any row.
    pub fn exists(&self, sql: &str, args: &[&dyn Arg]) -> Result<bool> {
        Ok(self.query_opt(sql, args, |_| Ok(()))?.is_some())
    }

    /// Column 0 of the first row as a `T`; no row is an error.
    pub fn query_value<T: FromValue>(&self, sql: &str, args: &[&dyn Arg]) -> Result<T> {
        self.query_one(sql, args, |r| r.get(0))
    }
}
