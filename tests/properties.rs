//! Property tests (proptest) for the two pure hearts of the idempotency
//! protocol: the canonical fingerprint and the decision table.
//!
//! Fingerprint: any JSON value, sent with its object members in any order
//! (at any depth), with any whitespace and any JSON-equivalent spelling of
//! its strings and numbers, fingerprints alike; two values that differ
//! fingerprint apart. "Differ" is JSON semantics as the contract's
//! canonicalisation (RFC 8785) defines it: a number is its value, so `1`,
//! `1.0` and `1e0` are one number, `-0` is `0`; integers are kept exact
//! (idem never rounds them to a double, so 2^53 + 1 and 2^53 differ); a
//! string is its code points, however escaped.
//!
//! Strict parsing (`idem::json`): a body without a repeated member reads
//! exactly as serde_json reads it, however it is spelled; a body that
//! repeats a member anywhere is refused, naming that member's path.
//!
//! Decision: the contract's table (API.md, "Decisions for a request whose
//! key row exists") as properties over every row, mode and clock.
//!
//! Case counts are kept small enough for the whole file to run in seconds;
//! `PROPTEST_CASES=10000 cargo test --test properties` searches harder.

use std::time::Duration;

use idem::idempotency::{
    decide, fingerprint, write_canonical, Decision, KeyState, Mode, RowView, Timeouts,
};
use idem::json::{Segment, StrictError};
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{Map, Number, Value};

// ---------------------------------------------------------------------------
// Strategies

/// Characters that stress escaping and ordering, mixed with any `char`.
fn json_char() -> impl Strategy<Value = char> {
    prop_oneof![
        3 => prop::sample::select(vec![
            'a', 'b', 'A', 'z', '0', ' ', '"', '\\', '/', '\u{0}', '\u{8}', '\u{1f}', '\u{7f}',
            '\u{e9}', '\u{2028}', '\u{FF61}', '\u{FFFF}', '\u{1F600}', '\u{10FFFF}',
        ]),
        1 => any::<char>(),
    ]
}

fn json_string(len_max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(json_char(), 0..len_max).prop_map(String::from_iter)
}

fn json_number() -> impl Strategy<Value = Number> {
    prop_oneof![
        (-3i64..3).prop_map(Number::from),
        any::<i64>().prop_map(Number::from),
        any::<u64>().prop_map(Number::from),
        // Around 2^53, where doubles stop holding every integer.
        (-3i64..3).prop_map(|d| Number::from((1i64 << 53) + d)),
        (prop::num::f64::NORMAL | prop::num::f64::SUBNORMAL | prop::num::f64::ZERO)
            .prop_map(|f| Number::from_f64(f).expect("finite")),
        (-1000i32..1000).prop_map(|n| Number::from_f64(f64::from(n) / 8.0).expect("finite")),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        json_number().prop_map(Value::Number),
        json_string(8).prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((json_string(4), inner), 0..6)
                .prop_map(|members| Value::Object(members.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

// ---------------------------------------------------------------------------
// Re-spelling a value as a client might: members shuffled, whitespace,
// escapes, other number spellings. Driven by a seed so proptest can replay it.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*; never zero.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

fn respell(v: &Value, seed: u64) -> String {
    let mut out = String::new();
    write_respelled(v, &mut Rng(seed | 1), None, &mut out);
    out
}

/// `respell`, but the member at `path` is written twice: once with its own
/// value, then again (its name spelled anew) with its value or another.
fn respell_with_duplicate(v: &Value, seed: u64, path: &[Segment]) -> String {
    let mut out = String::new();
    write_respelled(v, &mut Rng(seed | 1), Some(path), &mut out);
    out
}

fn space(rng: &mut Rng, out: &mut String) {
    for _ in 0..rng.below(3) {
        out.push([' ', '\n', '\t', '\r'][rng.below(4)]);
    }
}

/// Writes `v` re-spelled; `repeat`, if any, is the path (below `v`) of a
/// member to write twice.
fn write_respelled(v: &Value, rng: &mut Rng, repeat: Option<&[Segment]>, out: &mut String) {
    // The rest of `repeat` for the child at `step`, if the path goes there.
    let below = |step: &Segment| match repeat {
        Some([first, rest @ ..]) if first == step && !rest.is_empty() => Some(rest),
        _ => None,
    };
    space(rng, out);
    match v {
        Value::Number(n) => out.push_str(&respell_number(n, rng)),
        Value::String(s) => write_string(s, rng, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_respelled(item, rng, below(&Segment::Index(i)), out);
            }
            space(rng, out);
            out.push(']');
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            for i in (1..members.len()).rev() {
                members.swap(i, rng.below(i + 1));
            }
            out.push('{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let step = Segment::Member(k.clone());
                space(rng, out);
                write_string(k, rng, out);
                space(rng, out);
                out.push(':');
                write_respelled(v, rng, below(&step), out);
                if repeat == Some(&[step][..]) {
                    out.push(',');
                    write_string(k, rng, out);
                    out.push(':');
                    let again = if rng.coin() { v.clone() } else { Value::Null };
                    write_respelled(&again, rng, None, out);
                }
            }
            space(rng, out);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
    space(rng, out);
}

/// The same string: each character either as is (escaped where JSON needs
/// it) or as `\uXXXX` escapes (a surrogate pair above the BMP).
fn write_string(s: &str, rng: &mut Rng, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        if rng.coin() {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            let one = serde_json::to_string(&c.to_string()).expect("string");
            out.push_str(&one[1..one.len() - 1]);
        }
    }
    out.push('"');
}

/// Another spelling of the same number, where one exists exactly.
fn respell_number(n: &Number, rng: &mut Rng) -> String {
    let exact_in_double = |i: i128| i.unsigned_abs() <= 1 << 53;
    let int = n.as_i64().map(i128::from).or(n.as_u64().map(i128::from));
    match int {
        Some(i) if exact_in_double(i) => match rng.below(4) {
            0 => format!("{i}.0"),
            1 => format!("{i}e0"),
            2 if i != 0 => format!("{i}0E-1"),
            _ => i.to_string(),
        },
        Some(i) => i.to_string(),
        None => {
            let f = n.as_f64().expect("float");
            match rng.below(3) {
                0 => format!("{f:e}"),
                1 => format!("{f:E}"),
                _ => format!("{f:?}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// JSON semantics, independent of the code under test

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

fn same_number(x: &Number, y: &Number) -> bool {
    let exact = |n: &Number| n.as_i64().map(i128::from).or(n.as_u64().map(i128::from));
    let float_as_int = |f: f64| (f.fract() == 0.0 && f.abs() < 1e38).then_some(f as i128);
    match (exact(x), exact(y)) {
        (Some(a), Some(b)) => a == b,
        (Some(a), None) => float_as_int(y.as_f64().expect("float")) == Some(a),
        (None, Some(b)) => float_as_int(x.as_f64().expect("float")) == Some(b),
        (None, None) => x.as_f64() == y.as_f64(),
    }
}

/// `v` with one small change somewhere, chosen by `seed`; it may or may not
/// change the value (a changed number can land on an equal one, two
/// swapped elements can be equal), which is why the property compares with
/// `same` instead of assuming a difference.
fn mutate(v: &Value, seed: u64) -> Value {
    let mut v = v.clone();
    let mut rng = Rng(seed | 1);
    mutate_in(&mut v, &mut rng);
    v
}

fn mutate_in(v: &mut Value, rng: &mut Rng) {
    match v {
        Value::Array(items) if !items.is_empty() && rng.below(3) > 0 => {
            let (i, j) = (rng.below(items.len()), rng.below(items.len()));
            match rng.below(4) {
                0 if items.len() > 1 => items.swap(i, j),
                1 => {
                    items.remove(i);
                }
                _ => mutate_in(&mut items[i], rng),
            }
        }
        Value::Object(map) if !map.is_empty() && rng.below(3) > 0 => {
            let key = map.keys().nth(rng.below(map.len())).expect("key").clone();
            match rng.below(4) {
                0 => {
                    let value = map.remove(&key).expect("value");
                    map.insert(format!("{key}\u{e9}"), value);
                }
                1 => {
                    map.remove(&key);
                }
                _ => mutate_in(map.get_mut(&key).expect("value"), rng),
            }
        }
        Value::Number(n) => {
            *v = match (n.as_i64(), n.as_u64(), n.as_f64()) {
                (Some(i), _, _) => Value::from(i.wrapping_add(1)),
                (None, Some(u), _) => Value::from(u.wrapping_sub(1)),
                (_, _, Some(f)) => Value::from(if rng.coin() { f * 2.0 } else { -f }),
                _ => unreachable!("a number is one of the three"),
            }
        }
        Value::String(s) => s.push(['x', '\u{e9}', '\u{1F600}', '\u{0}'][rng.below(4)]),
        Value::Bool(b) => *b = !*b,
        other => {
            *other = match rng.below(4) {
                0 => Value::Null,
                1 => Value::from(0),
                2 => Value::from(""),
                _ => Value::Array(vec![other.clone()]),
            }
        }
    }
}

fn collect_objects<'a>(v: &'a Value, out: &mut Vec<&'a Map<String, Value>>) {
    match v {
        Value::Object(o) => {
            out.push(o);
            o.values().for_each(|child| collect_objects(child, out));
        }
        Value::Array(items) => items.iter().for_each(|child| collect_objects(child, out)),
        _ => {}
    }
}

fn canonical(v: &Value) -> String {
    let mut s = String::new();
    write_canonical(v, &mut s);
    s
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------
// Fingerprint properties

proptest! {
    #![proptest_config(config(384))]

    /// Any value, re-sent with members reordered at every depth, other
    /// whitespace, other escapes and other spellings of its numbers,
    /// fingerprints alike.
    #[test]
    fn reordered_and_respelled_values_fingerprint_alike(v in json_value(), seed in any::<u64>()) {
        let text = respell(&v, seed);
        let reread: Value = serde_json::from_str(&text).expect("respelled text is JSON");
        prop_assert!(same(&v, &reread), "respelling changed the value: {text}");
        prop_assert_eq!(fingerprint(&v), fingerprint(&reread), "{} vs {}", v, text);
    }

    /// Every object, at every depth, is written with its members sorted by
    /// the UTF-16 code units of their names (RFC 8785 §3.2.3) — not by the
    /// code points serde_json's map keeps them in, which differ above
    /// U+FFFF. (Reordered input alone cannot show this: the parser sorts.)
    #[test]
    fn members_are_written_in_utf16_order(v in json_value()) {
        let mut objects = Vec::new();
        collect_objects(&v, &mut objects);
        for o in objects {
            let mut names: Vec<&String> = o.keys().collect();
            names.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
            let members: Vec<String> = names
                .iter()
                .map(|n| format!("{}:{}", canonical(&Value::String((*n).clone())), canonical(&o[*n])))
                .collect();
            let expected = format!("{{{}}}", members.join(","));
            prop_assert_eq!(canonical(&Value::Object(o.clone())), expected);
        }
    }

    /// The canonical form is JSON that reads back as the same value, is a
    /// fixed point, and the fingerprint is its SHA-256.
    #[test]
    fn canonical_form_reads_back_and_is_a_fixed_point(v in json_value()) {
        let c = canonical(&v);
        let reread: Value = serde_json::from_str(&c).expect("canonical form is JSON");
        prop_assert!(same(&v, &reread), "{} read back as {}", c, reread);
        prop_assert_eq!(&canonical(&reread), &c);
        use sha2::Digest;
        let digest: [u8; 32] = sha2::Sha256::digest(c.as_bytes()).into();
        prop_assert_eq!(fingerprint(&v), digest);
    }

    /// A value and a near neighbour fingerprint alike exactly when they are
    /// the same JSON value: a real change always shows.
    #[test]
    fn values_that_differ_fingerprint_apart(v in json_value(), seed in any::<u64>()) {
        let m = mutate(&v, seed);
        prop_assert_eq!(
            same(&v, &m),
            fingerprint(&v) == fingerprint(&m),
            "{} vs {}: {} vs {}", v, m, canonical(&v), canonical(&m)
        );
    }

    /// Two unrelated values: alike exactly when equal.
    #[test]
    fn independent_values_fingerprint_alike_only_when_equal(a in json_value(), b in json_value()) {
        prop_assert_eq!(same(&a, &b), fingerprint(&a) == fingerprint(&b), "{} vs {}", a, b);
    }

    /// Numbers: every exact spelling of an integer is one value; a
    /// neighbouring integer is another, beyond 2^53 too.
    #[test]
    fn integers_by_value(i in any::<i64>()) {
        let fp = |text: &str| fingerprint(&serde_json::from_str(text).expect("JSON"));
        let base = fp(&i.to_string());
        if i.unsigned_abs() <= 1 << 53 {
            prop_assert_eq!(base, fp(&format!("{i}.0")));
            prop_assert_eq!(base, fp(&format!("{i}e0")));
            prop_assert_eq!(base, fp(&format!("{i}00e-2")));
        }
        if let Some(next) = i.checked_add(1) {
            prop_assert_ne!(base, fp(&next.to_string()));
        }
    }
}

#[test]
fn number_edges_follow_the_contract() {
    let fp = |text: &str| fingerprint(&serde_json::from_str(text).expect("JSON"));
    // -0 is 0; one number has one fingerprint however it is spelled.
    assert_eq!(fp("0"), fp("-0"));
    assert_eq!(fp("0"), fp("-0.0"));
    assert_eq!(fp("1"), fp("1.0"));
    assert_eq!(fp("100"), fp("1e2"));
    assert_eq!(fp("0.5"), fp("5e-1"));
    assert_eq!(fp("10000000000000000000"), fp("1e19"));
    // Integers stay exact: 2^53 + 1 is not 2^53, u64::MAX is not u64::MAX - 1.
    assert_ne!(fp("9007199254740993"), fp("9007199254740992"));
    assert_ne!(fp("18446744073709551615"), fp("18446744073709551614"));
    // A string is not a number, null is not 0, [] is not {}.
    assert_ne!(fp(r#"{"a":1}"#), fp(r#"{"a":"1"}"#));
    assert_ne!(fp("null"), fp("0"));
    assert_ne!(fp("[]"), fp("{}"));
}

// ---------------------------------------------------------------------------
// Strict parsing properties

/// The path of every member of every object in `v`, at every depth.
fn member_paths(v: &Value, here: &mut Vec<Segment>, out: &mut Vec<Vec<Segment>>) {
    let mut visit = |step: Segment, child: &Value, here: &mut Vec<Segment>| {
        here.push(step);
        if matches!(here.last(), Some(Segment::Member(_))) {
            out.push(here.clone());
        }
        member_paths(child, here, out);
        here.pop();
    };
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                visit(Segment::Member(k.clone()), child, here);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                visit(Segment::Index(i), child, here);
            }
        }
        _ => {}
    }
}

proptest! {
    #![proptest_config(config(384))]

    /// Without a repeated member, the strict parser reads exactly what
    /// serde_json reads (the same numbers, strings and structure, so the
    /// same fingerprint), however the value is spelled.
    #[test]
    fn strict_parsing_reads_what_serde_json_reads(v in json_value(), seed in any::<u64>()) {
        let text = respell(&v, seed);
        let strict = idem::json::from_slice(text.as_bytes());
        let strict = strict.map_err(|e| e.to_string());
        let serde: Value = serde_json::from_str(&text).expect("respelled text is JSON");
        prop_assert_eq!(strict.as_ref(), Ok(&serde), "{}", text);
        prop_assert_eq!(fingerprint(&serde), fingerprint(strict.as_ref().unwrap()));
    }

    /// Any member of any object, at any depth, written a second time (its
    /// name spelled anew, its value the same or another): refused with that
    /// member's path, where serde_json would keep the last.
    #[test]
    fn a_repeated_member_is_refused_with_its_path(
        v in json_value(),
        name in json_string(4),
        seed in any::<u64>(),
        pick in any::<prop::sample::Index>(),
    ) {
        let mut paths = Vec::new();
        member_paths(&v, &mut Vec::new(), &mut paths);
        // A value without an object member goes inside one.
        let v = if paths.is_empty() {
            paths.push(vec![Segment::Member(name.clone())]);
            Value::Object(Map::from_iter([(name, v)]))
        } else {
            v
        };
        let path = pick.get(&paths);
        let text = respell_with_duplicate(&v, seed, path);
        prop_assert!(serde_json::from_str::<Value>(&text).is_ok(), "{}", text);
        match idem::json::from_slice(text.as_bytes()) {
            Err(StrictError::Duplicate(found)) => prop_assert_eq!(&found.0, path, "{}", text),
            other => prop_assert!(false, "{}: {:?}", text, other),
        }
    }
}

// ---------------------------------------------------------------------------
// Decision properties

const NOW_MS: i64 = 1_800_000_000_000;

fn timeouts() -> impl Strategy<Value = Timeouts> {
    (1u64..120_000, 1u64..172_800_000).prop_map(|(inflight, retention)| Timeouts {
        inflight: Duration::from_millis(inflight),
        retention: Duration::from_millis(retention),
    })
}

/// A timestamp `now - age`, with ages clustered on the boundaries that
/// matter (the in-flight timeout and the retention, ± 1 ms) and 0 (an
/// unlocked row).
fn past(t: Timeouts) -> impl Strategy<Value = i64> {
    let inflight = t.inflight.as_millis() as i64;
    let retention = t.retention.as_millis() as i64;
    prop_oneof![
        Just(0),
        (-1i64..=1).prop_map(move |d| NOW_MS - inflight + d),
        (-1i64..=1).prop_map(move |d| NOW_MS - retention + d),
        (0i64..=2 * retention.max(inflight)).prop_map(|age| NOW_MS - age),
    ]
}

fn row(t: Timeouts) -> impl Strategy<Value = RowView> {
    (
        prop_oneof![Just(KeyState::InProgress), Just(KeyState::Completed)],
        any::<bool>(),
        past(t),
        past(t),
    )
        .prop_map(
            |(state, same_fingerprint, locked_at_ms, completed_at)| RowView {
                state,
                same_fingerprint,
                locked_at_ms,
                completed_at_ms: (state == KeyState::Completed).then_some(completed_at),
            },
        )
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![Just(Mode::Sync), Just(Mode::Async)]
}

fn case() -> impl Strategy<Value = (RowView, Mode, Timeouts)> {
    timeouts().prop_flat_map(|t| (row(t), mode(), Just(t)))
}

fn expired(r: &RowView, t: Timeouts) -> bool {
    r.completed_at_ms
        .is_some_and(|at| NOW_MS - at > t.retention.as_millis() as i64)
}

fn orphaned(r: &RowView, t: Timeouts) -> bool {
    NOW_MS - r.locked_at_ms > t.inflight.as_millis() as i64
}

proptest! {
    #![proptest_config(config(2048))]

    /// The table, row by row: every row and mode gets exactly the contract's
    /// answer.
    #[test]
    fn decide_follows_the_table((r, m, t) in case()) {
        let want = match r.state {
            KeyState::Completed if expired(&r, t) => Decision::Execute,
            _ if !r.same_fingerprint => Decision::Reused,
            KeyState::Completed => Decision::Replay,
            KeyState::InProgress if orphaned(&r, t) => Decision::TakeOver,
            KeyState::InProgress if m == Mode::Sync => Decision::InUse,
            KeyState::InProgress => Decision::Accepted,
        };
        prop_assert_eq!(decide(Some(r), m, NOW_MS, t), want);
    }

    /// No row: execute, in either mode.
    #[test]
    fn no_row_executes(m in mode(), t in timeouts()) {
        prop_assert_eq!(decide(None, m, NOW_MS, t), Decision::Execute);
    }

    /// Safety: an in-progress row is never executed anew (only taken over,
    /// which bumps the fencing token), and nothing but a completed row with
    /// the same fingerprint is replayed.
    #[test]
    fn in_progress_never_executes_and_only_same_completed_replays((r, m, t) in case()) {
        let d = decide(Some(r), m, NOW_MS, t);
        if r.state == KeyState::InProgress {
            prop_assert_ne!(d, Decision::Execute);
            prop_assert_ne!(d, Decision::Replay);
        }
        if d == Decision::Replay {
            prop_assert!(r.state == KeyState::Completed && r.same_fingerprint);
        }
        if d == Decision::TakeOver {
            prop_assert!(r.state == KeyState::InProgress && r.same_fingerprint && orphaned(&r, t));
        }
    }

    /// Another fingerprint is 422 whatever the state and mode, unless the
    /// row is a completed one past retention (which counts as absent).
    #[test]
    fn other_fingerprint_is_reused((r, m, t) in case()) {
        let r = RowView { same_fingerprint: false, ..r };
        let d = decide(Some(r), m, NOW_MS, t);
        if r.state == KeyState::Completed && expired(&r, t) {
            prop_assert_eq!(d, Decision::Execute);
        } else {
            prop_assert_eq!(d, Decision::Reused);
        }
    }

    /// The mode matters only for a live owner: 409 for sync, 202 for async.
    #[test]
    fn mode_only_splits_in_use_from_accepted((r, _m, t) in case()) {
        let sync = decide(Some(r), Mode::Sync, NOW_MS, t);
        let async_ = decide(Some(r), Mode::Async, NOW_MS, t);
        if sync == Decision::InUse {
            prop_assert_eq!(async_, Decision::Accepted);
        } else {
            prop_assert_eq!(sync, async_);
            prop_assert_ne!(sync, Decision::Accepted);
        }
    }

    /// Time only moves a row forward: an orphan stays an orphan and an
    /// expired key stays expired as the clock advances; nothing becomes
    /// replayable or in use again.
    #[test]
    fn later_never_undoes((r, m, t) in case(), later_ms in 0i64..200_000_000) {
        let now = decide(Some(r), m, NOW_MS, t);
        let then = decide(Some(r), m, NOW_MS + later_ms, t);
        match now {
            Decision::TakeOver | Decision::Execute => prop_assert_eq!(then, now),
            Decision::Replay | Decision::Reused => {
                prop_assert!(then == now || then == Decision::Execute)
            }
            Decision::InUse | Decision::Accepted => {
                prop_assert!(then == now || then == Decision::TakeOver)
            }
        }
    }
}
