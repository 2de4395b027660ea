//! A client with a 1 s timeout against a ledger whose acquirer takes 1.5 s,
//! written on the client crate (`crates/idem-client`): the first attempt
//! times out (but the charge goes through on the server), the client retries
//! under the SAME Idempotency-Key, is told 409 while the first attempt is
//! still in flight and waits its `Retry-After`, then gets the stored answer
//! (`Idempotent-Replayed: true`) — and exactly one charge exists. This is
//! the POS terminal story, offline, in one process.
//!
//! Run with `cargo run --example retrying_client`.

use std::time::Duration;

use idem_client::{Client, NewAccount, NewCharge, RetryPolicy};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = idem::Server::start_temporary(|config| {
        config.acquirer_latency = Duration::from_millis(1500);
    })?;
    let key = server.create_consumer("pos-terminal")?;
    let client = Client::builder(server.url(), &key)
        .policy(RetryPolicy {
            per_request_timeout: Duration::from_secs(1),
            deadline: Duration::from_secs(10),
            ..RetryPolicy::default()
        })
        .on_retry(|r| {
            println!(
                "attempt {}: {}; retrying in {:.2} s with the same key {}",
                r.attempt,
                r.cause,
                r.delay.as_secs_f64(),
                r.key.unwrap_or("-")
            )
        })
        .build()?;
    client.create_account(&NewAccount::new("BRL").id("card").allow_negative(true))?;
    client.create_account(&NewAccount::new("BRL").id("shop"))?;

    // One intent, one key, made where the intent is formed; every retry of
    // it carries the key.
    let intent = client.intent();
    let reply = intent.create_charge(&NewCharge::new(4990, "BRL", "card", "shop"))?;
    println!(
        "attempt {}: {} (Idempotent-Replayed: {}) {} of {} BRL cents",
        reply.attempts, reply.status, reply.replayed, reply.value.id, reply.value.amount
    );

    let charges = client.all_charges()?;
    println!("charges on the ledger: {}", charges.len());
    assert_eq!(charges.len(), 1, "the money moved once");
    assert_eq!(client.get_account("shop")?.value.balance, 4990);
    server.shutdown();
    Ok(())
}
