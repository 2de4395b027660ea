//! Secrets stay secret: API keys are stored only as hashes, and nothing a
//! client sends that could be a secret (its key, its Authorization header,
//! its request bodies, its idempotency keys) reaches the logs, even at
//! `RUST_LOG=trace`.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use rusqlite::Connection;
use serde_json::json;
use support::{ChildServer, Client, TempDir};

#[test]
fn keys_are_high_entropy_and_stored_only_as_hashes() {
    let dir = TempDir::new("key-storage");
    let db = dir.db();
    let keys: Vec<String> = (0..2)
        .map(|i| support::create_consumer_cli(&db, &format!("c{i}")))
        .collect();
    assert_ne!(keys[0], keys[1]);
    for key in &keys {
        let secret = key.strip_prefix("sk_").expect("sk_ prefix");
        assert_eq!(secret.len(), 64, "{key}");
        assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{key}");
    }
    // Nowhere in the file: not as text, not as its hex.
    let raw = std::fs::read(&db).unwrap();
    let wal = std::fs::read(dir.0.join("idem.db-wal")).unwrap_or_default();
    for key in &keys {
        for haystack in [&raw, &wal] {
            assert!(
                !haystack.windows(key.len()).any(|w| w == key.as_bytes()),
                "a secret key is stored in clear"
            );
        }
    }
    let conn = Connection::open(&db).unwrap();
    let hashes: Vec<Vec<u8>> = conn
        .prepare("SELECT key_hash FROM consumers ORDER BY id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(hashes.len(), 2);
    for (key, hash) in keys.iter().zip(&hashes) {
        assert_eq!(hash.as_slice(), idem::consumers::hash_key(key.as_bytes()));
    }
}

#[test]
fn trace_logs_never_contain_keys_authorization_or_bodies() {
    let dir = TempDir::new("trace-logs");
    let db = dir.db();
    let key = support::create_consumer_cli(&db, "pos");
    let server = ChildServer::start(&db, &[], &[("RUST_LOG", "trace")]);
    let client = Client::new(server.addr, &key);

    let idem_key = "idemkey-marker-7f3a";
    let body_marker = "body-marker-91c2";
    client.card_and_shop();
    let mut charge = support::charge_body(100);
    charge["description"] = json!(body_marker);
    charge["metadata"] = json!({"note": "meta-marker-44d1"});
    assert_eq!(client.charge(idem_key, &charge).status, 201);
    assert_eq!(client.charge(idem_key, &charge).status, 201);
    // A mismatch, a bad body, a bad key header and a wrong API key: every
    // error path that could echo what it was sent.
    charge["amount"] = json!(101);
    assert_eq!(client.charge(idem_key, &charge).status, 422);
    let bad = client.request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "bad-body-key-marker")],
        "{\"amount\": \"bad-json-marker",
    );
    assert_eq!(bad.status, 400);
    let bad_key = client.request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "bad\u{7f}key-marker")],
        &support::charge_body(5).to_string(),
    );
    assert_eq!(bad_key.status, 400);
    let wrong = Client::new(server.addr, "sk_wrong-key-marker-0c9e");
    assert_eq!(wrong.get("/v1/charges").status, 401);

    let pid = server.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !log.iter().any(|l: &String| l == "stopped") {
        assert!(Instant::now() < deadline, "no clean stop: {log:#?}");
        log.extend(server.stderr_lines());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = log.join("\n");
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "the test must see a verbose log to mean anything:\n{log}"
    );
    for secret in [
        key.as_str(),
        &key[3..],
        "Bearer",
        "authorization",
        "Authorization",
        idem_key,
        body_marker,
        "meta-marker-44d1",
        "bad-json-marker",
        "bad-body-key-marker",
        "key-marker",
        "wrong-key-marker",
    ] {
        assert!(!log.contains(secret), "the log contains {secret:?}:\n{log}");
    }
}
