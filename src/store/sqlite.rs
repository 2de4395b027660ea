//! [`Db`] on an SQLite connection: the writer's (inside its savepoint) and
//! the readers'. Statements go through rusqlite's statement cache.

use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::Connection;

use super::sql::{Arg, Db, Dialect, Row, Value};
use crate::error::Result;

/// A parameter as rusqlite binds it, borrowed.
struct Bind<'a>(Value<'a>);

impl rusqlite::ToSql for Bind<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match self.0 {
            Value::Null => ValueRef::Null,
            Value::Int(i) => ValueRef::Integer(i),
            Value::Real(f) => ValueRef::Real(f),
            Value::Text(s) => ValueRef::Text(s.as_bytes()),
            Value::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

fn binds<'a>(args: &'a [&'a dyn Arg]) -> impl Iterator<Item = Bind<'a>> + 'a {
    args.iter().map(|a| Bind(a.value()))
}

struct SqliteRow<'s, 'r>(&'r rusqlite::Row<'s>);

impl Row for SqliteRow<'_, '_> {
    fn value(&self, i: usize) -> Result<Value<'_>> {
        Ok(match self.0.get_ref(i)? {
            ValueRef::Null => Value::Null,
            ValueRef::Integer(i) => Value::Int(i),
            ValueRef::Real(f) => Value::Real(f),
            ValueRef::Text(t) => Value::Text(std::str::from_utf8(t).map_err(|e| {
                crate::error::Error::Storage(format!("column {i} is not UTF-8: {e}"))
            })?),
            ValueRef::Blob(b) => Value::Blob(b),
        })
    }
}

impl Db for Connection {
    fn dialect(&self) -> Dialect {
        Dialect::Sqlite
    }

    fn execute(&self, sql: &str, args: &[&dyn Arg]) -> Result<usize> {
        Ok(self
            .prepare_cached(sql)?
            .execute(rusqlite::params_from_iter(binds(args)))?)
    }

    fn query_each(
        &self,
        sql: &str,
        args: &[&dyn Arg],
        each: &mut dyn FnMut(&dyn Row) -> Result<()>,
    ) -> Result<()> {
        let mut stmt = self.prepare_cached(sql)?;
        let mut rows = stmt.query(rusqlite::params_from_iter(binds(args)))?;
        while let Some(r) = rows.next()? {
            each(&SqliteRow(r))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::store::{params, Db};

    #[test]
    fn binds_and_reads_every_type_through_the_interface() {
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        let db: &dyn Db = &conn;
        db.execute("CREATE TABLE t (i INTEGER, s TEXT, b BLOB, n INTEGER)", params![])
            .unwrap();
        let none: Option<i64> = None;
        db.execute(
            "INSERT INTO t VALUES (?1, ?2, ?3, ?4)",
            params![i64::MIN, "é", [0u8, 255], none],
        )
        .unwrap();
        let (i, s, b, n) = db
            .query_one("SELECT i, s, b, n FROM t", params![], |r| {
                Ok((
                    r.get::<i64>(0)?,
                    r.get::<String>(1)?,
                    r.get::<Vec<u8>>(2)?,
                    r.get::<Option<i64>>(3)?,
                ))
            })
            .unwrap();
        assert_eq!((i, s.as_str(), b, n), (i64::MIN, "é", vec![0, 255], None));
        assert!(db.query_one("SELECT n FROM t", params![], |r| r.get::<i64>(0)).is_err());
        assert!(!db.exists("SELECT 1 FROM t WHERE i = ?1", params![1]).unwrap());
    }
}
