//! API consumers and their secret keys. A key is shown once, at creation;
//! only its SHA-256 is stored, and a presented key is compared with the
//! stored hash in constant time.

use sha2::{Digest, Sha256};

use crate::config::CONSUMER_NAME_LEN_MAX;
use crate::error::{Error, Result};
use crate::ids;
use crate::store::{params, Db};
use crate::time::{now_ms, rfc3339};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumer {
    pub id: i64,
    pub public_id: String,
    pub name: String,
    pub created_at: String,
}

pub fn hash_key(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// Equality whose time does not depend on where the inputs differ.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub fn valid_name(name: &str) -> bool {
    (1..=CONSUMER_NAME_LEN_MAX).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// Creates a consumer and returns it with its secret key (the only time the
/// key exists outside the client).
pub fn create(db: &dyn Db, name: &str) -> Result<(Consumer, String)> {
    if !valid_name(name) {
        return Err(Error::Usage(format!(
            "consumer name '{name}' must be 1 to {CONSUMER_NAME_LEN_MAX} characters of \
             A-Z a-z 0-9 _ - ."
        )));
    }
    if db.exists("SELECT 1 FROM consumers WHERE name = ?1", params![name])? {
        return Err(Error::Config(format!(
            "a consumer named '{name}' already exists"
        )));
    }
    let key = ids::new_secret_key();
    let now = now_ms();
    let public_id = ids::new_id(ids::CONSUMER);
    let id = db.query_value::<i64>(
        "INSERT INTO consumers (public_id, name, key_hash, created_at) VALUES (?1, ?2, ?3, ?4) \
         RETURNING id",
        params![public_id, name, hash_key(key.as_bytes()), now],
    )?;
    let consumer = Consumer {
        id,
        public_id,
        name: name.to_string(),
        created_at: rfc3339(now),
    };
    Ok((consumer, key))
}

#[cfg(any(feature = "cli", feature = "internals"))]
pub fn list(db: &dyn Db) -> Result<Vec<Consumer>> {
    db.query_all(
        "SELECT id, public_id, name, created_at FROM consumers ORDER BY id",
        params![],
        |r| {
            Ok(Consumer {
                id: r.get(0)?,
                public_id: r.get(1)?,
                name: r.get(2)?,
                created_at: rfc3339(r.get(3)?),
            })
        },
    )
}

pub fn count(db: &dyn Db) -> Result<i64> {
    db.query_value("SELECT count(*) FROM consumers", params![])
}

/// The consumer whose key hashes to `hash`, if any (compared in constant time).
pub fn authenticate(db: &dyn Db, hash: &[u8; 32]) -> Result<Option<i64>> {
    let found = db.query_opt(
        "SELECT id, key_hash FROM consumers WHERE key_hash = ?1",
        params![hash],
        |r| Ok((r.get::<i64>(0)?, r.get::<Vec<u8>>(1)?)),
    )?;
    Ok(found.and_then(|(id, stored)| ct_eq(&stored, hash).then_some(id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_equality() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
    }

    #[test]
    fn names() {
        assert!(valid_name("pos-terminal_1.a"));
        assert!(!valid_name(""));
        assert!(!valid_name("a b"));
        assert!(!valid_name(&"a".repeat(65)));
    }
}
