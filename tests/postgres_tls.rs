//! TLS to PostgreSQL: `sslmode=require` with the server's certificate
//! verified against `sslrootcert`. Needs the PostgreSQL pass of the suite
//! (`IDEM_TEST_POSTGRES`) and the CA that server's certificate is signed by
//! (`IDEM_TEST_POSTGRES_CA`; `ci/postgres` makes both); otherwise each test
//! says it is skipped.

mod support;

use std::path::{Path, PathBuf};

use support::{charge_body, ChildServer, Client, TempDir};

/// The CA of the test cluster, when this pass has one.
fn ca() -> Option<PathBuf> {
    if !support::on_postgres() {
        eprintln!("skipped: needs IDEM_TEST_POSTGRES");
        return None;
    }
    match std::env::var_os("IDEM_TEST_POSTGRES_CA") {
        Some(path) if !path.is_empty() => Some(PathBuf::from(path)),
        _ => {
            eprintln!("skipped: needs IDEM_TEST_POSTGRES_CA (the cluster's CA certificate)");
            None
        }
    }
}

/// `db` with TLS parameters added to its URL.
fn with_tls(db: &Path, params: &str) -> PathBuf {
    PathBuf::from(format!("{}?{params}", db.display()))
}

/// How many connections to the test's database are encrypted, seen from a
/// plain connection of the test's own.
fn encrypted_connections(db: &Path) -> i64 {
    support::inspect(db, |c| {
        c.query_value(
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a ON a.pid = s.pid \
             WHERE s.ssl AND a.datname = current_database()",
            &[],
        )
    })
}

#[test]
fn a_server_on_sslmode_require_talks_tls_and_moves_money() {
    let Some(ca) = ca() else { return };
    let dir = TempDir::new("pg-tls");
    let db = dir.db();
    let url = with_tls(
        &db,
        &format!("sslmode=require&sslrootcert={}", ca.display()),
    );
    let store = support::acquirer_store(&db).unwrap();
    let store_arg = store.to_str().unwrap();
    // ChildServer names the database's simulator file (the URL's query aside).
    let server = ChildServer::start(&url, &[], &[]);
    let client = Client::new(server.addr, server.initial_key.as_deref().unwrap());
    client.card_and_shop();
    let r = client.charge("tls-1", &charge_body(250));
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(client.balance("shop"), 250);
    // Every connection of the server's pool is encrypted; the test's own
    // (plain, sslmode unset) is not counted.
    assert!(encrypted_connections(&db) >= 1);
    let (code, report) = {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["verify", "--acquirer-store", store_arg, "--db"])
            .arg(&url)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    assert_eq!(code, Some(0), "{report}");
}

#[test]
fn a_certificate_that_does_not_verify_is_refused_with_a_reason() {
    let Some(_) = ca() else { return };
    let dir = TempDir::new("pg-tls-bad");
    let db = dir.db();
    // The Mozilla roots do not vouch for the test cluster's own CA.
    let url = with_tls(&db, "sslmode=require");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["migrate", "--db"])
        .arg(&url)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("TLS"), "{stderr}");
    // Nothing was created: the database is still empty.
    let tables: i64 = support::inspect(&db, |c| {
        c.query_value(
            "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()",
            &[],
        )
    });
    assert_eq!(tables, 0);
    // A root file that holds no certificate is named, before any connection.
    let empty = dir.0.join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let url = with_tls(
        &db,
        &format!("sslmode=require&sslrootcert={}", empty.display()),
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["migrate", "--db"])
        .arg(&url)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("empty.pem"), "{stderr}");
}
