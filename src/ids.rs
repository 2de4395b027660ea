//! Public identifiers: a type prefix and a UUIDv7 in simple form, so ids sort
//! by creation time and say what they name.

use uuid::Uuid;

pub const ACCOUNT: &str = "acct_";
pub const CHARGE: &str = "ch_";
pub const REFUND: &str = "re_";
pub const OPERATION: &str = "op_";
/// Entries written before version 4 kept `evt_`; ids are opaque, so they stay.
pub const ENTRY: &str = "ent_";
pub const EVENT: &str = "evt_";
pub const WEBHOOK_ENDPOINT: &str = "we_";
pub const NOTIFICATION_SOURCE: &str = "src_";
pub const NOTIFICATION: &str = "ntf_";
pub const DISPUTE: &str = "dp_";
pub const CONSUMER: &str = "cons_";

pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", Uuid::now_v7().simple())
}

/// A secret API key: `sk_` and 244 random bits (two UUIDv4) in hex. Only its
/// SHA-256 is ever stored.
pub fn new_secret_key() -> String {
    format!("sk_{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple())
}
