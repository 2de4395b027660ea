//! Strict JSON: request bodies read into a [`serde_json::Value`], except that
//! an object naming a member twice is refused.
//!
//! serde_json's own `Value` keeps the last of two members with one name, so
//! `{"amount":1,"amount":1000000}` reads as 1,000,000 while a proxy, a log
//! or an audit trail that reads the first sees 1: two readers of one body
//! would disagree on how much money it moves. RFC 8259 §4 leaves duplicate
//! names to the implementation; a payment API should refuse them. Names are
//! compared after unescaping (`"amount"` and `"\u0061mount"` are one name),
//! at every depth.
//!
//! Everything else is exactly serde_json's: this is a visitor driven by
//! serde_json's deserializer, so numbers are read as it reads them (the
//! crate's `float_roundtrip`: every float exact), strings are unescaped by
//! it, trailing characters are refused by it, and nesting is bounded by its
//! recursion limit (127 nested arrays or objects parse, the 128th is an
//! error), which keeps this recursive visitor far from the bottom of a
//! worker thread's stack. One difference is deliberate: serde_json's
//! `Value`, with the crate's `raw_value` feature, reads an object whose first
//! member is named `$serde_json::private::RawValue` as the JSON text held in
//! that member's string — a second body hidden inside the first. Here it is
//! a member name like any other, and JSON that idem keeps (the request in a
//! key row, metadata in the ledger) is read back with this module too
//! ([`deserialize`], [`from_slice`]), so it reads as it was written.

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// One step of a path into a JSON value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// An object member, by its (unescaped) name.
    Member(String),
    /// An array element, by its index.
    Index(usize),
}

/// Where a member sits in a body: the steps from the top-level value.
///
/// Displayed as `metadata.k`, `items[2].x`, or, for a name that is not
/// plain (`[A-Za-z0-9_-]+`), as a JSON string in brackets: `metadata["a b"]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Path(pub Vec<Segment>);

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, segment) in self.0.iter().enumerate() {
            match segment {
                Segment::Member(name) if plain(name) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    f.write_str(name)?;
                }
                Segment::Member(name) => {
                    let quoted = serde_json::to_string(name).map_err(|_| fmt::Error)?;
                    write!(f, "[{quoted}]")?;
                }
                Segment::Index(i) => write!(f, "[{i}]")?,
            }
        }
        Ok(())
    }
}

fn plain(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Why a text was refused.
#[derive(Debug)]
pub enum StrictError {
    /// An object names a member twice; the path ends with that name.
    Duplicate(Path),
    /// Not one JSON value: a syntax error, trailing characters, or nesting
    /// past serde_json's recursion limit.
    Malformed(serde_json::Error),
}

impl fmt::Display for StrictError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StrictError::Duplicate(path) => write!(f, "{path}: duplicate member"),
            StrictError::Malformed(e) => write!(f, "malformed JSON: {e}"),
        }
    }
}

impl std::error::Error for StrictError {}

/// Parses `bytes` as one JSON value, as `serde_json::from_slice::<Value>`
/// does, but refuses an object that names a member twice.
pub fn from_slice(bytes: &[u8]) -> Result<Value, StrictError> {
    let duplicate = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed = Strict {
        duplicate: &duplicate,
    }
    .deserialize(&mut de)
    .and_then(|value| de.end().map(|()| value));
    match (parsed, duplicate.into_inner()) {
        (Ok(value), None) => Ok(value),
        (_, Some(mut reversed)) => {
            reversed.reverse();
            Err(StrictError::Duplicate(Path(reversed)))
        }
        (Err(e), None) => Err(StrictError::Malformed(e)),
    }
}

/// [`from_slice`]'s reading through any serde deserializer, for
/// `#[serde(deserialize_with = "crate::json::deserialize")]` on a `Value`
/// that came from a client: a request kept in a key row then reads back
/// exactly as it was written (serde_json's own `Value` would read a metadata
/// key named like its raw-value token as another value).
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Value, D::Error> {
    let duplicate = RefCell::new(None);
    Strict {
        duplicate: &duplicate,
    }
    .deserialize(deserializer)
}

/// The seed and visitor. On a duplicate it records the member's name and
/// fails; as the error unwinds, each enclosing object or array appends its
/// step, so the path (built in reverse) costs nothing on the happy path.
#[derive(Clone, Copy)]
struct Strict<'a> {
    duplicate: &'a RefCell<Option<Vec<Segment>>>,
}

impl Strict<'_> {
    /// Adds an enclosing step to the path of a duplicate found below it.
    fn enclosing(self, segment: Segment) {
        if let Some(path) = self.duplicate.borrow_mut().as_mut() {
            path.push(segment);
        }
    }
}

impl<'de> DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any valid JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        // As serde_json's own visitor (JSON text has no NaN or infinity).
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        loop {
            match seq.next_element_seed(self) {
                Ok(Some(item)) => items.push(item),
                Ok(None) => return Ok(Value::Array(items)),
                Err(e) => {
                    self.enclosing(Segment::Index(items.len()));
                    return Err(e);
                }
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            if members.contains_key(&name) {
                *self.duplicate.borrow_mut() = Some(vec![Segment::Member(name)]);
                return Err(de::Error::custom("duplicate member"));
            }
            match map.next_value_seed(self) {
                Ok(value) => {
                    members.insert(name, value);
                }
                Err(e) => {
                    self.enclosing(Segment::Member(name));
                    return Err(e);
                }
            }
        }
        Ok(Value::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn duplicate(text: &str) -> String {
        match from_slice(text.as_bytes()) {
            Err(StrictError::Duplicate(path)) => path.to_string(),
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn a_repeated_name_is_refused_with_its_path() {
        let cases = [
            (r#"{"a":1,"a":1}"#, "a"),
            (r#"{"a":1,"\u0061":2}"#, "a"),
            (r#"{"x":{"a":1,"b":[{"c":1},{"c":1,"c":2}]}}"#, "x.b[1].c"),
            (r#"[0,{"a":{"a b":1,"a b":2}}]"#, r#"[1].a["a b"]"#),
            (r#"{"":1,"":2}"#, r#"[""]"#),
            (r#"{"é":{"\"":1,"\"":2}}"#, r#"["é"]["\""]"#),
        ];
        for (text, path) in cases {
            assert_eq!(duplicate(text), path, "{text}");
        }
    }

    /// The first duplicate in text order is the one named, and a duplicate
    /// wins over a syntax error that comes after it.
    #[test]
    fn the_first_duplicate_is_named() {
        assert_eq!(duplicate(r#"{"a":{"b":1,"b":2},"a":3}"#), "a.b");
        assert_eq!(duplicate(r#"{"a":1,"a":2,"#), "a");
    }

    #[test]
    fn without_duplicates_it_reads_what_serde_json_reads() {
        for text in [
            "{}",
            "[]",
            r#"{"a":[1,-2,3.5,1e300,-0.0,null,true,"x\u00e9"]}"#,
            r#"{"n":18446744073709551615,"m":-9223372036854775808,"f":0.1,"g":1e-7}"#,
            r#"{"big":123456789012345678901234567890,"neg0":-0,"exp":2.5E+10}"#,
            r#"{"a":{"a":{"a":1}},"b":{"a":1}}"#,
            r#" { "w" : [ ] } "#,
        ] {
            let want = serde_json::from_str::<Value>(text);
            let got = from_slice(text.as_bytes());
            match (want, got) {
                (Ok(want), Ok(got)) => assert_eq!(got, want, "{text}"),
                (Err(_), Err(StrictError::Malformed(_))) => {}
                (want, got) => panic!("{text}: serde_json {want:?}, strict {got:?}"),
            }
        }
    }

    #[test]
    fn malformed_text_is_refused_as_serde_json_refuses_it() {
        for text in [
            "",
            "{",
            r#"{"a":1}x"#,
            r#"{"a" 1}"#,
            "[1,]",
            "01",
            "NaN",
            "[1e400]",
        ] {
            assert!(serde_json::from_str::<Value>(text).is_err(), "{text}");
            assert!(
                matches!(from_slice(text.as_bytes()), Err(StrictError::Malformed(_))),
                "{text}"
            );
        }
    }

    #[test]
    fn nesting_stops_where_serde_json_stops() {
        let nested = |n: usize| "[".repeat(n) + &"]".repeat(n);
        assert!(from_slice(nested(127).as_bytes()).is_ok());
        assert!(matches!(
            from_slice(nested(128).as_bytes()),
            Err(StrictError::Malformed(_))
        ));
        let objects = |n: usize| r#"{"a":"#.repeat(n) + "1" + &"}".repeat(n);
        assert!(from_slice(objects(127).as_bytes()).is_ok());
        assert!(from_slice(objects(128).as_bytes()).is_err());
    }

    #[test]
    fn the_raw_value_token_is_an_ordinary_name() {
        let text = r#"{"$serde_json::private::RawValue":"{\"a\":1}"}"#;
        let quirk: Value = serde_json::from_str(text).unwrap();
        assert_eq!(quirk, serde_json::json!({"a": 1}), "serde_json's reading");
        let strict = from_slice(text.as_bytes()).unwrap();
        assert_eq!(
            strict,
            serde_json::json!({"$serde_json::private::RawValue": "{\"a\":1}"})
        );
    }
}
