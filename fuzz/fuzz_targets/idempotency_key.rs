//! `IdempotencyKey::parse` on any header value. Beyond "no panic":
//! - an accepted key is 1–255 bytes of 0x21–0x7E (the contract's syntax);
//! - a value that is not a structured-field string is the key itself (after
//!   trimming), so a plain UUID is never altered;
//! - a value that opens a quote must close it (`"abc` is invalid);
//! - writing the key back as a structured-field string (quoted, `\"` and
//!   `\\` escaped) parses to the same key: quoting is a lossless encoding, so
//!   two header spellings name one key only when they mean the same string.
#![no_main]

use idem::idempotency::IdempotencyKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(key) = IdempotencyKey::parse(data) else {
        return;
    };
    let s = key.as_str();
    assert!((1..=255).contains(&s.len()), "length {}", s.len());
    assert!(s.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{s:?}");

    let trimmed = data.trim_ascii();
    if trimmed.first() == Some(&b'"') {
        assert!(trimmed.len() >= 2 && trimmed.ends_with(b"\""), "{data:?}");
    } else {
        assert_eq!(s.as_bytes(), trimmed);
    }

    let mut quoted = String::from("\"");
    for c in s.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    assert_eq!(IdempotencyKey::parse(quoted.as_bytes()), Ok(key.clone()));
    // Surrounding whitespace is insignificant in either spelling.
    assert_eq!(
        IdempotencyKey::parse(format!(" \t{quoted} ").as_bytes()),
        Ok(key)
    );
});
