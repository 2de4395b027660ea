//! Shared by the client's tests: an embedded server, a fast policy, the two
//! accounts of the seed's story, a ledger check over HTTP, and a proxy that
//! loses answers.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_client::{Client, NewAccount, NewCharge, RetryPolicy};

/// A server on a temp database with a short in-flight timeout and reaper
/// interval, so orphans are taken over quickly.
pub fn server(configure: impl FnOnce(&mut idem::Config)) -> idem::Server {
    idem::Server::start_temporary(|config| {
        config.inflight_timeout = Duration::from_millis(300);
        config.reaper_interval = Duration::from_millis(100);
        configure(config);
    })
    .expect("server starts")
}

/// Waits of milliseconds, a 5 s deadline, 200 ms per attempt.
pub fn fast_policy() -> RetryPolicy {
    RetryPolicy {
        attempts_max: 50,
        base: Duration::from_millis(5),
        cap: Duration::from_millis(50),
        deadline: Duration::from_secs(5),
        per_request_timeout: Duration::from_millis(200),
        connect_timeout: Duration::from_millis(200),
    }
}

pub fn client(url: &str, server: &idem::Server, policy: RetryPolicy) -> Client {
    Client::builder(url, server.initial_key().expect("a fresh server has a key"))
        .policy(policy)
        .build()
        .unwrap()
}

/// `card` (a funding account) and `shop`, created through `client`.
pub fn accounts(client: &Client) {
    client
        .create_account(&NewAccount::new("BRL").id("card").allow_negative(true))
        .unwrap();
    client
        .create_account(&NewAccount::new("BRL").id("shop"))
        .unwrap();
}

/// A charge card → shop that names its intent in its metadata, so the
/// ledger can be checked per intent.
pub fn charge(amount: i64, intent: &str) -> NewCharge {
    let mut c = NewCharge::new(amount, "BRL", "card", "shop");
    c.metadata.insert("intent".into(), intent.into());
    c
}

/// Through the HTTP API: exactly one charge per intent in `intents` and no
/// other, each of `amount`, and balances that say the money moved once
/// per intent.
pub fn assert_one_charge_per_intent(client: &Client, intents: &[String], amount: i64) {
    let charges = client.all_charges().unwrap();
    for intent in intents {
        let n = charges
            .iter()
            .filter(|c| c.metadata.get("intent") == Some(intent))
            .count();
        assert_eq!(n, 1, "intent {intent}: {n} charges");
    }
    assert_eq!(charges.len(), intents.len(), "no charge without an intent");
    assert!(charges.iter().all(|c| c.amount == amount));
    let total = amount * intents.len() as i64;
    assert_eq!(client.get_account("shop").unwrap().value.balance, total);
    assert_eq!(client.get_account("card").unwrap().value.balance, -total);
}

/// A TCP proxy in front of a server that, for its first `drops`
/// connections, forwards the request, waits for the answer to start, and
/// closes the client's connection without passing it on: the seed's lost
/// answer (the charge committed, the client saw nothing).
pub struct LossyProxy {
    pub url: String,
    pub dropped: Arc<AtomicU32>,
}

impl LossyProxy {
    pub fn start(upstream: SocketAddr, drops: u32) -> LossyProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let left = Arc::new(AtomicU32::new(drops));
        let dropped = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&dropped);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(up) = TcpStream::connect(upstream) else {
                    continue;
                };
                let lose = left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                let (mut c_in, mut u_out) = (client.try_clone().unwrap(), up.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c_in, &mut u_out);
                    let _ = u_out.shutdown(Shutdown::Write);
                });
                let counted = Arc::clone(&counted);
                std::thread::spawn(move || {
                    let (mut up, mut client) = (up, client);
                    if lose {
                        let mut first = [0u8; 1];
                        let _ = up.read(&mut first);
                        counted.fetch_add(1, Ordering::SeqCst);
                        let _ = client.shutdown(Shutdown::Both);
                        let _ = up.shutdown(Shutdown::Both);
                    } else {
                        let mut buf = [0u8; 16 * 1024];
                        while let Ok(n) = up.read(&mut buf) {
                            if n == 0 || client.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = client.shutdown(Shutdown::Both);
                    }
                });
            }
        });
        LossyProxy { url, dropped }
    }
}
