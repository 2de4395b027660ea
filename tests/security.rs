//! Secrets stay secret: API keys are stored only as hashes, and nothing a
//! client sends that could be a secret (its key, its Authorization header,
//! its request bodies, its idempotency keys) reaches the logs, even at
//! `RUST_LOG=trace`.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{ChildServer, Client, TempDir};

/// All that the database holds, as bytes to search: on SQLite the file and
/// its -wal read raw (free pages and old frames included); on PostgreSQL
/// every row of every table as text (`bytea` spelled in hex).
fn everything_stored(dir: &TempDir) -> Vec<Vec<u8>> {
    let db = dir.db();
    if !support::on_postgres() {
        let raw = std::fs::read(&db).unwrap();
        let wal = std::fs::read(dir.0.join("idem.db-wal")).unwrap_or_default();
        return vec![raw, wal];
    }
    let url = db.to_str().expect("a PostgreSQL URL");
    let mut client = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    let tables: Vec<String> = client
        .query(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(tables.iter().any(|t| t == "consumers"), "{tables:?}");
    let mut rows = Vec::new();
    for table in &tables {
        for row in client
            .query(&format!("SELECT t::text FROM \"{table}\" t"), &[])
            .unwrap()
        {
            rows.push(row.get::<_, String>(0).into_bytes());
        }
    }
    rows
}

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
    // Nowhere in the database: not as text, not as its hex, with or
    // without its prefix.
    let stored = everything_stored(&dir);
    for key in &keys {
        let hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        for needle in [&key[3..], hex.as_str()] {
            for haystack in &stored {
                assert!(
                    !haystack
                        .windows(needle.len())
                        .any(|w| w == needle.as_bytes()),
                    "a secret key is stored in clear"
                );
            }
        }
    }
    let hashes: Vec<Vec<u8>> = support::inspect(&db, |c| {
        c.query_all("SELECT key_hash FROM consumers ORDER BY id", &[], |r| {
            r.get(0)
        })
    });
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
