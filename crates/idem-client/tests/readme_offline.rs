//! The README's "Test your retries offline" test, verbatim: keep the two in
//! step.

use std::time::{Duration, Instant};

use idem_client::{Client, NewAccount, NewCharge, RetryPolicy};

#[test]
fn a_lost_answer_is_retried_and_the_card_is_charged_once() {
    // A sandbox server in this process, on a temporary database.
    let server = idem::Server::start_temporary(|config| config.sandbox = true).unwrap();
    // The terminal's timeout, scaled down: 100 ms stands for the seed's 30 s.
    let client = Client::builder(server.url(), server.initial_key().unwrap())
        .policy(RetryPolicy {
            per_request_timeout: Duration::from_millis(100),
            base: Duration::from_millis(10),
            deadline: Duration::from_secs(5),
            ..RetryPolicy::default()
        })
        .build()
        .unwrap();
    client
        .create_account(&NewAccount::new("BRL").id("card").allow_negative(true))
        .unwrap();
    client
        .create_account(&NewAccount::new("BRL").id("shop"))
        .unwrap();

    let started = Instant::now();
    // The server charges the card, then answers only after 300 ms (the
    // seed's 34 s): the first attempt times out, the client retries with
    // the same key and gets the stored answer.
    let intent = client.intent().simulate("response=delay:300ms");
    let reply = intent
        .create_charge(&NewCharge::new(4990, "BRL", "card", "shop"))
        .unwrap();

    assert_eq!(reply.attempts, 2);
    assert!(reply.replayed, "the first attempt's charge, not a new one");
    assert_eq!(client.all_charges().unwrap().len(), 1);
    assert_eq!(client.get_account("shop").unwrap().value.balance, 4990);
    assert!(started.elapsed() < Duration::from_secs(1));
}
