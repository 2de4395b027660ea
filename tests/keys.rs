//! `idem keys list|show|evict` through the real binary, on databases written
//! by real servers (in-process and `idem serve` children), while they run and
//! after they crashed: a completed key evicted makes the next request new, a
//! live key in progress is never evicted, an orphan only while nothing has
//! left the database (its claim on a hold released), `idem verify` stays
//! green, and no secret of a stored answer or request is ever printed.

mod support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::{json, Value};
use support::{assert_verified, charge_body, ChildServer, Client, TempDir};

/// `idem keys ARGS --db DB`, with no `IDEM_*` from the test's environment;
/// on PostgreSQL with the `--acquirer-store` its servers use (`evict` asks
/// the simulator whether it has seen an operation).
fn keys(db: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    if let Some(store) = support::acquirer_store(db) {
        cmd.arg("--acquirer-store").arg(store);
    }
    cmd.arg("keys")
        .args(args)
        .arg("--db")
        .arg(db)
        .env_remove("IDEM_DB")
        .env_remove("IDEM_ACQUIRER_STORE")
        .env_remove("IDEM_INFLIGHT_TIMEOUT")
        .output()
        .expect("run idem keys")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `idem keys ARGS`, asserts exit 0, and parses its stdout as JSON.
fn keys_json(db: &Path, args: &[&str]) -> Value {
    let out = keys(db, args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "idem keys {args:?}: {}",
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("idem keys {args:?}: not JSON ({e}): {}", text(&out.stdout)))
}

/// Runs `idem keys ARGS` and asserts it exits 1 with `says` on stderr.
fn keys_fail(db: &Path, args: &[&str], says: &str) {
    let out = keys(db, args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "idem keys {args:?}: {err}");
    assert!(
        err.contains(says),
        "idem keys {args:?}: expected '{says}' in: {err}"
    );
}

#[test]
fn a_completed_key_is_listed_shown_and_evicted_while_the_server_runs() {
    let dir = TempDir::new("keys-completed");
    let db = dir.db();
    let server = ChildServer::start(&db, &[], &[]);
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let first = client.charge("order-1", &charge_body(500));
    assert_eq!(first.status, 201);
    let first_id = first.json()["id"].as_str().unwrap().to_string();
    assert_eq!(
        client.charge("order-1", &charge_body(500)).json()["id"],
        first_id.as_str()
    );

    let list = keys_json(&db, &["list", "--json"]);
    assert_eq!(list["object"], "list");
    assert_eq!(list["has_more"], false);
    let data = list["data"].as_array().unwrap();
    assert_eq!(
        data.len(),
        1,
        "accounts made without a key have none: {list}"
    );
    assert_eq!(data[0]["key"], "order-1");
    assert_eq!(data[0]["state"], "completed");
    assert_eq!(data[0]["response_status"], 201);

    let shown = keys_json(&db, &["show", "--consumer", "default", "order-1", "--json"]);
    assert_eq!(shown["path"], "/v1/charges");
    assert_eq!(shown["method"], "POST");
    assert_eq!(shown["operation"], "charge");
    // A charge's authorization commits with its ledger phase: the key
    // completes from `reserved`.
    assert_eq!(shown["recovery_point"], "reserved");
    assert_eq!(shown["generation"], 1);
    assert_eq!(shown["owner"], Value::Null);
    assert_eq!(shown["fingerprint"].as_str().unwrap().len(), 64);
    assert!(shown["op_id"].as_str().unwrap().starts_with("op_"));
    assert!(shown["completed_at"].is_string());
    let text_show = text(&keys(&db, &["show", "--consumer", "default", "order-1"]).stdout);
    assert!(
        text_show.contains("recovery_point   reserved"),
        "{text_show}"
    );

    // Filters.
    let in_progress = keys_json(&db, &["list", "--state", "in_progress", "--json"]);
    assert_eq!(in_progress["data"], json!([]));
    let limited = {
        assert_eq!(client.charge("order-2", &charge_body(1)).status, 201);
        keys_json(
            &db,
            &["list", "--consumer", "default", "--limit", "1", "--json"],
        )
    };
    assert_eq!(limited["data"].as_array().unwrap().len(), 1);
    assert_eq!(limited["data"][0]["key"], "order-2", "newest first");
    assert_eq!(limited["has_more"], true);
    keys_fail(
        &db,
        &["list", "--consumer", "nobody"],
        "no consumer named 'nobody'",
    );

    // Evict, while the server runs: the next request with the key is new.
    let out = keys(&db, &["evict", "--consumer", "default", "order-1"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("the next request with it is new"));
    keys_fail(
        &db,
        &["show", "--consumer", "default", "order-1"],
        "no key 'order-1'",
    );
    keys_fail(
        &db,
        &["evict", "--consumer", "default", "order-1"],
        "no key 'order-1'",
    );
    let second = client.charge("order-1", &charge_body(500));
    assert_eq!(second.status, 201);
    assert!(!second.replayed());
    assert_ne!(second.json()["id"], first_id.as_str(), "a second charge");
    assert_eq!(client.balance("shop"), 1001);
    assert_verified(&db);
}

#[test]
fn a_live_key_in_progress_is_never_evicted() {
    // An in-process server whose acquirer takes 2 s: an async charge holds
    // its key in progress, its owner alive, while the CLI tries.
    let dir = TempDir::new("keys-live");
    let mut config = support::config(&dir);
    config.acquirer_latency = Duration::from_secs(2);
    let server = idem::Server::start(config).expect("start server");
    let db = dir.db();
    let client = Client::new(server.addr(), server.initial_key().unwrap());
    client.card_and_shop();
    let accepted = client.request(
        "POST",
        "/v1/charges",
        &[("Idempotency-Key", "slow-1"), ("Prefer", "respond-async")],
        &charge_body(700).to_string(),
    );
    assert_eq!(accepted.status, 202);
    let shown = keys_json(&db, &["show", "--consumer", "default", "slow-1", "--json"]);
    assert_eq!(shown["state"], "in_progress");
    assert_eq!(shown["owner"], "live");
    assert_eq!(shown["recovery_point"], "reserved");
    keys_fail(
        &db,
        &["evict", "--consumer", "default", "slow-1"],
        "its owner is alive",
    );
    // It completes; the key was never touched.
    let done = support::eventually(Duration::from_secs(10), || {
        let r = client.charge("slow-1", &charge_body(700));
        (r.status == 201).then_some(r)
    });
    assert!(done.replayed());
    assert_eq!(client.all_charges().len(), 1);
    let out = keys(&db, &["evict", "--consumer", "default", "slow-1", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let evicted: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(evicted["evicted"]["state"], "completed");
    assert_eq!(evicted["released_charge"], Value::Null);
    // Verified beside the running server.
    assert_verified(&db);
    server.shutdown();
}

/// Sends a request the child server aborts inside (a fault point), and
/// waits for it to die.
fn lost(server: ChildServer, client: &Client, path: &str, key: &str, body: &Value) {
    let r = client.try_request("POST", path, &[("Idempotency-Key", key)], &body.to_string());
    assert!(r.is_err(), "the server died before answering: {r:?}");
    let status = server.wait_exit(Duration::from_secs(10));
    assert!(!status.success());
}

#[test]
fn an_orphaned_capture_is_evicted_with_its_claim_and_verify_stays_green() {
    let dir = TempDir::new("keys-orphan");
    let db = dir.db();
    let server = ChildServer::start(
        &db,
        &["--inflight-timeout", "1s"],
        &[("IDEM_FAULT", "capture:after_reserve")],
    );
    let mut client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let mut hold = charge_body(900);
    hold["capture"] = json!(false);
    let held = client.charge("hold-1", &hold);
    assert_eq!(held.status, 201);
    let charge = held.json()["id"].as_str().unwrap().to_string();
    let capture_path = format!("/v1/charges/{charge}/capture");
    lost(server, &client, &capture_path, "cap-1", &json!({}));

    let scope = [
        "--consumer",
        "default",
        "--path",
        capture_path.as_str(),
        "cap-1",
    ];
    let show = |timeout: &str| {
        let mut args = vec!["show", "--json", "--inflight-timeout", timeout];
        args.extend_from_slice(&scope);
        keys_json(&db, &args)
    };
    let shown = show("1h");
    assert_eq!(shown["operation"], "capture");
    assert_eq!(shown["recovery_point"], "reserved");
    assert_eq!(shown["owner"], "live", "silent for less than an hour");
    let mut evict = vec!["evict", "--inflight-timeout", "1h"];
    evict.extend_from_slice(&scope);
    keys_fail(&db, &evict, "its owner is alive");
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(show("1s")["owner"], "orphan");

    // A server runs again (its reaper idle, so the orphan stays one), and
    // the CLI evicts the orphan beside it.
    let server = ChildServer::start(
        &db,
        &["--inflight-timeout", "1s", "--reaper-interval", "1h"],
        &[],
    );
    client.addr = server.addr;
    let mut evict = vec!["evict", "--json", "--inflight-timeout", "1s"];
    evict.extend_from_slice(&scope);
    let evicted = keys_json(&db, &evict);
    assert_eq!(evicted["evicted"]["owner"], "orphan");
    assert_eq!(evicted["released_charge"], charge.as_str());
    assert_verified(&db);
    // The next capture with that key is new, and captures the hold once.
    let captured = client.post(&capture_path, Some("cap-1"), &json!({}));
    assert_eq!(captured.status, 200, "{}", text(&captured.body));
    assert!(!captured.replayed());
    assert_eq!(captured.json()["status"], "succeeded");
    assert_eq!(client.balance("shop"), 900);
    drop(server);
    assert_verified(&db);
}

#[test]
fn an_orphan_the_acquirer_has_acted_on_is_refused() {
    let dir = TempDir::new("keys-refused");
    let db = dir.db();
    // A charge whose owner died after the acquirer authorised, before the
    // recovery point: `reserved`, but the acquirer's file knows it.
    let server = ChildServer::start(
        &db,
        &["--inflight-timeout", "1s"],
        &[("IDEM_FAULT", "charge:after_acquirer")],
    );
    let mut client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    lost(server, &client, "/v1/charges", "sale-1", &charge_body(300));
    // A capture whose owner died after its recovery point: `captured`.
    // Its reaper idle: the first orphan must stay one.
    let server = ChildServer::start(
        &db,
        &["--inflight-timeout", "1s", "--reaper-interval", "1h"],
        &[("IDEM_FAULT", "capture:after_recovery_point")],
    );
    client.addr = server.addr;
    let mut hold = charge_body(800);
    hold["capture"] = json!(false);
    let held = client.charge("hold-2", &hold);
    assert_eq!(held.status, 201);
    let charge = held.json()["id"].as_str().unwrap().to_string();
    let capture_path = format!("/v1/charges/{charge}/capture");
    lost(server, &client, &capture_path, "cap-2", &json!({}));
    std::thread::sleep(Duration::from_millis(1_100));

    let sale = [
        "evict",
        "--inflight-timeout",
        "1s",
        "--consumer",
        "default",
        "sale-1",
    ];
    keys_fail(&db, &sale, "the acquirer has already seen its operation");
    let capture = [
        "evict",
        "--inflight-timeout",
        "1s",
        "--consumer",
        "default",
        "--path",
        capture_path.as_str(),
        "cap-2",
    ];
    keys_fail(&db, &capture, "recovery point 'captured'");
    assert_verified(&db);

    // A server finishes both (retries take them over); then they evict.
    let server = ChildServer::start(&db, &["--inflight-timeout", "1s"], &[]);
    client.addr = server.addr;
    assert_eq!(client.charge("sale-1", &charge_body(300)).status, 201);
    let captured = client.post(&capture_path, Some("cap-2"), &json!({}));
    assert_eq!(captured.status, 200, "{}", text(&captured.body));
    for args in [&sale[..], &capture[..]] {
        let out = keys(&db, args);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
    drop(server);
    assert_verified(&db);
}

#[test]
fn show_and_list_never_print_a_secret() {
    let dir = TempDir::new("keys-secrets");
    let db = dir.db();
    let server = ChildServer::start(&db, &[], &[]);
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let endpoint = client.post(
        "/v1/webhook_endpoints",
        Some("wh-1"),
        &json!({"url": "http://127.0.0.1:9/hook", "enabled_events": ["charge.succeeded"]}),
    );
    assert_eq!(endpoint.status, 201, "{}", text(&endpoint.body));
    let endpoint_secret = endpoint.json()["secret"].as_str().unwrap().to_string();
    let source = client.post(
        "/v1/notification_sources",
        Some("src-1"),
        &json!({"name": "acq"}),
    );
    assert_eq!(source.status, 201, "{}", text(&source.body));
    let source_secret = source.json()["secret"].as_str().unwrap().to_string();
    let mut body = charge_body(10);
    body["metadata"] = json!({"card_token": "tok_private_4242"});
    assert_eq!(client.charge("meta-1", &body).status, 201);

    let mut printed = String::new();
    for args in [
        &[
            "show",
            "--consumer",
            "default",
            "--path",
            "/v1/webhook_endpoints",
            "wh-1",
        ][..],
        &[
            "show",
            "--consumer",
            "default",
            "--path",
            "/v1/webhook_endpoints",
            "wh-1",
            "--json",
        ],
        &[
            "show",
            "--consumer",
            "default",
            "--path",
            "/v1/notification_sources",
            "src-1",
        ],
        &[
            "show",
            "--consumer",
            "default",
            "--path",
            "/v1/notification_sources",
            "src-1",
            "--json",
        ],
        &["show", "--consumer", "default", "meta-1", "--json"],
        &["show", "--consumer", "default", "meta-1"],
        &["list"],
        &["list", "--json"],
    ] {
        let out = keys(&db, args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            text(&out.stderr)
        );
        printed += &text(&out.stdout);
        printed += &text(&out.stderr);
    }
    for secret in [
        endpoint_secret.as_str(),
        source_secret.as_str(),
        "whsec_",
        "tok_private_4242",
    ] {
        assert!(!printed.contains(secret), "printed {secret}:\n{printed}");
    }
    assert!(printed.contains("webhook_endpoint") && printed.contains("notification_source"));
    let out = keys(
        &db,
        &[
            "evict",
            "--consumer",
            "default",
            "--path",
            "/v1/webhook_endpoints",
            "wh-1",
        ],
    );
    assert!(!text(&out.stdout).contains("whsec_") && !text(&out.stderr).contains("whsec_"));
}

#[test]
fn help_and_bad_usage() {
    let dir = TempDir::new("keys-usage");
    let db = dir.db();
    for args in [
        &["--help"][..],
        &["list", "--help"],
        &["show", "--help"],
        &["evict", "--help"],
    ] {
        let out = keys(&db, args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(text(&out.stdout).contains("Usage: idem keys"), "{args:?}");
    }
    let evict_help = text(&keys(&db, &["evict", "--help"]).stdout);
    for says in [
        "--inflight-timeout",
        "second charge",
        "reserved",
        "IDEM_INFLIGHT_TIMEOUT",
    ] {
        assert!(evict_help.contains(says), "evict --help lacks {says}");
    }
    for args in [
        &[][..],
        &["frobnicate"],
        &["list", "--state", "pending"],
        &["list", "--limit", "0"],
        &["list", "--limit", "many"],
        &["show", "k1"],
        &["show", "--consumer", "default"],
        &["show", "--consumer", "default", "two words"],
        &["show", "--consumer", "default", "--path", "charges", "k1"],
        &["evict", "--consumer", "default"],
        &[
            "evict",
            "--consumer",
            "default",
            "k1",
            "--inflight-timeout",
            "0s",
        ],
    ] {
        let out = keys(&db, args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    // A database that is not there is a failure, not bad usage (on
    // PostgreSQL the test's database is there, without idem's schema).
    let missing = if support::on_postgres() {
        "no idem schema"
    } else {
        "no database at"
    };
    keys_fail(&db, &["list"], missing);
}
