//! The canonical JSON form (`write_canonical`, RFC 8785 JCS) and the
//! fingerprint taken of it, on arbitrary bytes parsed as JSON. Asserts:
//! - the canonical form is JSON and re-parses to a value equal to the input
//!   under JSON semantics (numbers by value: `1`, `1.0` and `1e0` are one
//!   number; object key order is insignificant);
//! - canonicalising again is a fixed point, and the fingerprint is stable;
//! - re-serialising the input (compact or pretty, which reorders nothing but
//!   whitespace) fingerprints alike;
//! - every float is written as ECMAScript's `Number.prototype.toString`
//!   writes it (checked against ryu-js), except the integral ones between
//!   2^53 and 1e21, which idem writes exactly (see `write_number`);
//! - object members come out sorted by UTF-16 code units, with no whitespace
//!   outside strings;
//! - when the input holds two JSON texts separated by a 0xFF byte (never
//!   valid inside JSON): they fingerprint alike exactly when they are equal
//!   under the same semantics — equal values hash alike, different values
//!   hash apart;
//! - the strict parser the server reads bodies with (`idem::json`) agrees
//!   with serde_json: what it accepts, serde_json reads as the same value;
//!   what serde_json refuses, it refuses; it refuses more only for a
//!   repeated member (or where serde_json reads its raw-value token, a
//!   member name that hides a second body).
#![no_main]

use idem::idempotency::{fingerprint, write_canonical};
use idem::json::StrictError;
use libfuzzer_sys::fuzz_target;
use serde_json::{Number, Value};

fuzz_target!(|data: &[u8]| {
    strict_agrees(data);
    match data.iter().position(|&b| b == 0xFF) {
        None => {
            if let Ok(v) = serde_json::from_slice::<Value>(data) {
                check_one(&v);
            }
        }
        Some(i) => {
            let a = serde_json::from_slice::<Value>(&data[..i]);
            let b = serde_json::from_slice::<Value>(&data[i + 1..]);
            if let (Ok(a), Ok(b)) = (a, b) {
                check_one(&a);
                check_one(&b);
                assert_eq!(
                    same(&a, &b),
                    fingerprint(&a) == fingerprint(&b),
                    "{a} vs {b}: {} vs {}",
                    canonical(&a),
                    canonical(&b)
                );
            }
        }
    }
});

/// serde_json's `Value` with `raw_value` reads an object whose first member
/// has this name (however escaped) as the JSON text in its string; idem
/// reads a member.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

fn names_raw_token(v: &Value) -> bool {
    match v {
        Value::Object(map) => map
            .iter()
            .any(|(k, v)| k == RAW_VALUE_TOKEN || names_raw_token(v)),
        Value::Array(items) => items.iter().any(names_raw_token),
        _ => false,
    }
}

fn strict_agrees(data: &[u8]) {
    let strict = idem::json::from_slice(data);
    let serde = serde_json::from_slice::<Value>(data);
    match (strict, serde) {
        (Ok(a), Ok(b)) => assert!(
            a == b || names_raw_token(&a),
            "strict {a} vs serde_json {b}"
        ),
        (Ok(a), Err(e)) => assert!(names_raw_token(&a), "strict accepted {a}, serde_json: {e}"),
        (Err(StrictError::Duplicate(_)), _) => {}
        (Err(StrictError::Malformed(_)), Err(_)) => {}
        (Err(StrictError::Malformed(e)), Ok(b)) => panic!("strict refused {b}: {e}"),
    }
}

fn canonical(v: &Value) -> String {
    let mut s = String::new();
    write_canonical(v, &mut s);
    s
}

fn check_one(v: &Value) {
    let c1 = canonical(v);
    let v2: Value = serde_json::from_str(&c1).unwrap_or_else(|e| panic!("{c1:?}: {e}"));
    assert!(
        same(v, &v2),
        "{v} canonicalised to {c1}, which reads back as {v2}"
    );
    let c2 = canonical(&v2);
    assert_eq!(c1, c2, "not a fixed point");
    let fp = fingerprint(v);
    assert_eq!(fp, fingerprint(v));
    assert_eq!(fp, fingerprint(&v2));
    for text in [
        serde_json::to_string(v).unwrap(),
        serde_json::to_string_pretty(v).unwrap(),
    ] {
        let reread: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(fp, fingerprint(&reread), "{text}");
    }
    check_shape(&v2, &c1);
    numbers_as_ecmascript(v);
}

fn numbers_as_ecmascript(v: &Value) {
    match v {
        Value::Number(n) if n.as_i64().is_none() && n.as_u64().is_none() => {
            let f = n.as_f64().expect("finite");
            let exact_integral = f.fract() == 0.0 && (2f64.powi(53)..1e21).contains(&f.abs());
            if !exact_integral {
                let want = ryu_js::Buffer::new().format_finite(f).to_string();
                assert_eq!(canonical(v), want, "{f:e}");
            }
        }
        Value::Array(items) => items.iter().for_each(numbers_as_ecmascript),
        Value::Object(map) => map.values().for_each(numbers_as_ecmascript),
        _ => {}
    }
}

/// Members sorted by UTF-16 code units at every depth; no whitespace
/// outside strings.
fn check_shape(v: &Value, c: &str) {
    let mut in_string = false;
    let mut escaped = false;
    for ch in c.chars() {
        if in_string {
            match (escaped, ch) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if ch == '"' {
            in_string = true;
        } else {
            assert!(!ch.is_whitespace(), "whitespace in {c}");
        }
    }
    sorted(v);
}

fn sorted(v: &Value) {
    match v {
        Value::Array(items) => items.iter().for_each(sorted),
        Value::Object(map) => {
            // serde_json's map iterates in its own (UTF-8) order; the
            // canonical text must be in UTF-16 order: rebuild it and compare.
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
            let mut expected = String::from("{");
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    expected.push(',');
                }
                expected.push_str(&serde_json::to_string(k).unwrap());
                expected.push(':');
                expected.push_str(&canonical(&map[k.as_str()]));
            }
            expected.push('}');
            assert_eq!(canonical(v), expected);
            map.values().for_each(sorted);
        }
        _ => {}
    }
}

/// Equality under JSON semantics: numbers by value, objects as maps.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => same_number(x, y),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, a)| y.get(k).is_some_and(|b| same(a, b)))
        }
        _ => a == b,
    }
}

/// Integers compare exactly (idem keeps them exact, beyond 2^53 too); a
/// float equals an integer only if it has exactly that value.
fn same_number(x: &Number, y: &Number) -> bool {
    fn exact(n: &Number) -> Option<i128> {
        n.as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
    }
    fn float_as_int(f: f64) -> Option<i128> {
        (f.fract() == 0.0 && f.abs() < 1e38).then_some(f as i128)
    }
    match (exact(x), exact(y)) {
        (Some(a), Some(b)) => a == b,
        (Some(a), None) => float_as_int(y.as_f64().unwrap()) == Some(a),
        (None, Some(b)) => float_as_int(x.as_f64().unwrap()) == Some(b),
        (None, None) => x.as_f64().unwrap() == y.as_f64().unwrap(),
    }
}
