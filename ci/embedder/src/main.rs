//! Starts an in-process idem server on a temporary database, as an embedder's
//! test would, creates an account over real HTTP, and shuts it down.

use std::io::{Read, Write};
use std::net::TcpStream;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = idem::Server::start_temporary(|config| {
        config.workers = 2;
    })?;
    let key = server.create_consumer("embedder")?;
    let body = r#"{"id":"card","currency":"BRL","allow_negative":true}"#;
    let mut conn = TcpStream::connect(server.addr())?;
    write!(
        conn,
        "POST /v1/accounts HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)?;
    if !answer.starts_with("HTTP/1.1 201") {
        return Err(format!("expected 201, got: {answer}").into());
    }
    println!("embedded idem at {} created an account", server.url());
    server.shutdown();
    Ok(())
}
