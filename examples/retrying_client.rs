//! A client with a 1 s timeout against a ledger whose acquirer takes 1.5 s:
//! the first attempt times out (but the charge goes through on the server),
//! the client retries with the SAME Idempotency-Key, gets 409 while the first
//! attempt is still in flight, then the stored answer — and exactly one charge
//! exists. This is the POS terminal story, offline, in one process.
//!
//! Run with `cargo run --example retrying_client`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = idem::Server::start_temporary(|config| {
        config.acquirer_latency = Duration::from_millis(1500);
    })?;
    let key = server.create_consumer("pos-terminal")?;
    let addr = server.addr();
    post(
        addr,
        &key,
        "/v1/accounts",
        None,
        r#"{"id":"card","currency":"BRL","allow_negative":true}"#,
    )?;
    post(
        addr,
        &key,
        "/v1/accounts",
        None,
        r#"{"id":"shop","currency":"BRL"}"#,
    )?;

    // One intent, one key, generated where the intent is formed.
    let intent = uuid::Uuid::new_v4().to_string();
    let charge = r#"{"amount":4990,"currency":"BRL","source":"card","destination":"shop"}"#;
    for attempt in 1.. {
        match post(addr, &key, "/v1/charges", Some(&intent), charge) {
            Err(e) => println!("attempt {attempt}: no answer ({e}); retrying with the same key"),
            Ok((409, _, _)) => {
                println!("attempt {attempt}: 409, still in flight; waiting Retry-After");
                std::thread::sleep(Duration::from_secs(1));
            }
            Ok((status, replayed, body)) => {
                println!("attempt {attempt}: {status} (Idempotent-Replayed: {replayed})\n  {body}");
                break;
            }
        }
    }
    let (_, _, list) = get(addr, &key, "/v1/charges")?;
    let charges: serde_json::Value = serde_json::from_str(&list)?;
    let n = charges["data"].as_array().map_or(0, Vec::len);
    println!("charges on the ledger: {n}");
    assert_eq!(n, 1, "the money moved once");
    server.shutdown();
    Ok(())
}

fn post(
    addr: SocketAddr,
    key: &str,
    path: &str,
    idem_key: Option<&str>,
    body: &str,
) -> std::io::Result<(u16, bool, String)> {
    let extra = idem_key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
    exchange(
        addr,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {key}\r\n{extra}\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
}

fn get(addr: SocketAddr, key: &str, path: &str) -> std::io::Result<(u16, bool, String)> {
    exchange(addr, &format!(
        "GET {path} HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n"
    ))
}

/// One request on its own connection, with the client's timeout.
fn exchange(addr: SocketAddr, request: &str) -> std::io::Result<(u16, bool, String)> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.write_all(request.as_bytes())?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let replayed = head
        .to_ascii_lowercase()
        .contains("idempotent-replayed: true");
    Ok((status, replayed, body.to_string()))
}
