-- idem schema for PostgreSQL 15+, version 4: the tables, columns and
-- constraints of schema.sql (the SQLite schema at the same version), in
-- PostgreSQL's types: INTEGER is BIGINT (every integer idem stores is an
-- i64), BLOB is BYTEA, booleans stay 0/1 integers so that both engines run
-- the same SQL. Three additions, the leases that let several nodes share
-- work: deliveries.leased_by and leased_until, charges.expiry_leased_until.
-- Applied by `idem serve` (or `idem migrate`) to an empty database in one
-- transaction, together with its schema_migrations rows.
--
-- Timestamps are integer milliseconds since the Unix epoch (UTC). Money is
-- BIGINT minor units. Every table that a consumer owns carries consumer_id.

CREATE TABLE consumers (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    public_id   TEXT    NOT NULL UNIQUE,
    name        TEXT    NOT NULL UNIQUE,
    key_hash    BYTEA    NOT NULL UNIQUE CHECK (octet_length(key_hash) = 32),
    created_at  BIGINT  NOT NULL
);

CREATE TABLE accounts (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id     BIGINT  NOT NULL REFERENCES consumers(id),
    public_id       TEXT    NOT NULL,
    currency        TEXT    NOT NULL CHECK (length(currency) = 3),
    allow_negative  BIGINT  NOT NULL CHECK (allow_negative IN (0, 1)),
    metadata        TEXT    NOT NULL,
    balance         BIGINT  NOT NULL DEFAULT 0,
    created_at      BIGINT  NOT NULL,
    -- The sum of the amounts of the `requires_capture` charges drawing on
    -- this account (their holds): `available` = balance - held.
    held            BIGINT  NOT NULL DEFAULT 0
        CHECK (held >= 0),
    -- The sum of the amounts that those holds may still credit to this
    -- account: room reserved so that a capture can never overflow a balance.
    pending_credit  BIGINT  NOT NULL DEFAULT 0
        CHECK (pending_credit >= 0),
    UNIQUE (consumer_id, public_id)
);

CREATE TABLE charges (
    id                   BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id          BIGINT  NOT NULL REFERENCES consumers(id),
    public_id            TEXT    NOT NULL UNIQUE,
    amount               BIGINT  NOT NULL CHECK (amount > 0),
    currency             TEXT    NOT NULL,
    source_id            BIGINT  NOT NULL REFERENCES accounts(id),
    destination_id       BIGINT  NOT NULL REFERENCES accounts(id),
    -- 'succeeded' (captured: entries of amount_captured), 'requires_capture'
    -- (a hold of `amount` on the source, no entries) or 'canceled' (the hold
    -- released, no entries).
    status               TEXT    NOT NULL
        CHECK (status IN ('succeeded', 'requires_capture', 'canceled')),
    amount_captured      BIGINT  NOT NULL CHECK (amount_captured BETWEEN 0 AND amount),
    amount_refunded      BIGINT  NOT NULL DEFAULT 0 CHECK (amount_refunded >= 0),
    amount_disputed      BIGINT  NOT NULL DEFAULT 0 CHECK (amount_disputed >= 0),
    reference            TEXT,
    description          TEXT,
    metadata             TEXT    NOT NULL,
    -- SHA-256 of the canonical request body: a new key with the same reference
    -- is a replay only when this matches.
    fingerprint          BYTEA    NOT NULL,
    -- The reservation that produced the charge (idempotency_keys.op_id). Key rows
    -- are deleted after retention, so this is not a foreign key; UNIQUE proves
    -- that no reservation produced two charges.
    op_id                TEXT    NOT NULL UNIQUE,
    idempotency_key      TEXT    NOT NULL,
    authorization_id     TEXT    NOT NULL,
    -- When the reaper voids the hold of a 'requires_capture' charge.
    expires_at           BIGINT ,
    canceled_at          BIGINT ,
    cancellation_reason  TEXT    CHECK (cancellation_reason IN ('requested', 'expired')),
    -- The capture or cancel (its op_id) or the expiry ('expiry') that claimed
    -- this hold; the first claim wins and the others answer 409.
    claimed_by           TEXT,
    created_at           BIGINT  NOT NULL,
    -- When a hold was captured (NULL for a charge captured at once, and for
    -- captures before version 4): when its `charge.captured` event was written.
    captured_at          BIGINT ,
    -- PostgreSQL only: while claimed_by is 'expiry', until when (ms) the
    -- node whose reaper claimed it is voiding it; another node's reaper
    -- takes the expiry over only after that.
    expiry_leased_until  BIGINT  NOT NULL DEFAULT 0,
    CHECK (amount_refunded + amount_disputed <= amount_captured),
    CHECK ((status = 'succeeded') = (amount_captured > 0)),
    CHECK ((status = 'requires_capture') = (expires_at IS NOT NULL)),
    CHECK ((status = 'canceled') = (canceled_at IS NOT NULL)),
    CHECK ((status = 'canceled') = (cancellation_reason IS NOT NULL)),
    CHECK (status = 'requires_capture' OR claimed_by IS NULL)
);
CREATE INDEX charges_by_consumer ON charges(consumer_id, id);
CREATE UNIQUE INDEX charges_by_reference ON charges(consumer_id, reference)
    WHERE reference IS NOT NULL;
-- Holds the reaper expires, oldest first.
CREATE INDEX charges_expiring ON charges(expires_at) WHERE status = 'requires_capture';
-- An inbound notification names a charge by its acquirer authorization.
CREATE INDEX charges_by_authorization ON charges(consumer_id, authorization_id);

CREATE TABLE refunds (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id      BIGINT  NOT NULL REFERENCES consumers(id),
    public_id        TEXT    NOT NULL UNIQUE,
    charge_id        BIGINT  NOT NULL REFERENCES charges(id),
    amount           BIGINT  NOT NULL CHECK (amount > 0),
    op_id            TEXT    NOT NULL UNIQUE,
    idempotency_key  TEXT    NOT NULL,
    created_at       BIGINT  NOT NULL
);
CREATE INDEX refunds_by_charge ON refunds(charge_id);

-- Double entry: every charge writes one debit (negative) and one credit
-- (positive) entry; every refund writes their reverse.
CREATE TABLE entries (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    public_id   TEXT    NOT NULL UNIQUE,
    account_id  BIGINT  NOT NULL REFERENCES accounts(id),
    amount      BIGINT  NOT NULL CHECK (amount <> 0),
    charge_id   BIGINT  NOT NULL REFERENCES charges(id),
    refund_id   BIGINT  REFERENCES refunds(id),
    created_at  BIGINT  NOT NULL,
    -- Set on the two entries of a dispute (a chargeback: money forced back
    -- from the destination to the source).
    dispute_id  BIGINT  -- REFERENCES disputes(id), added below: disputes comes later
);
CREATE INDEX entries_by_account ON entries(account_id, id);
CREATE INDEX entries_by_charge ON entries(charge_id);

-- One row per (consumer, method, concrete path, key): the reservation, its
-- recovery point and, once completed, the stored answer.
CREATE TABLE idempotency_keys (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id      BIGINT  NOT NULL REFERENCES consumers(id),
    method           TEXT    NOT NULL,
    path             TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BYTEA    NOT NULL,
    op_id            TEXT    NOT NULL UNIQUE,
    state            TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed')),
    -- Fencing token: bumped by every takeover and checked by every later
    -- commit of the owner that holds it.
    generation       BIGINT  NOT NULL,
    -- When the current owner last proved it was alive (reservation or
    -- recovery point); 0 means unlocked: the next request takes over at once.
    locked_at        BIGINT  NOT NULL,
    -- Where the operation stands: 'reserved' (nothing left the database),
    -- 'authorized' (the acquirer authorised; see authorization), 'declined'
    -- (the ledger declined after the authorization: the answer is stored,
    -- the void is due), 'captured' / 'voided' (the acquirer captured or
    -- voided; the ledger phase is due), 'applied' (a refund's ledger effect
    -- and answer are committed; the acquirer's refund is due).
    recovery_point   TEXT    NOT NULL CHECK (recovery_point IN
        ('reserved', 'authorized', 'declined', 'captured', 'voided', 'applied')),
    -- The validated request as JSON, so the reaper can finish it alone.
    request          TEXT    NOT NULL,
    -- A charge's `reference`, claimed while the key is in progress so that
    -- two keys with one reference never both reach the acquirer.
    reference        TEXT,
    "authorization"  TEXT,
    response_status  BIGINT ,
    response_body    BYTEA,
    created_at       BIGINT  NOT NULL,
    completed_at     BIGINT ,
    UNIQUE (consumer_id, method, path, key),
    -- A completed key has its answer; an in-progress one may have it already
    -- (decided, with one acquirer call still due: 'declined', 'applied').
    CHECK ((state = 'completed') = (completed_at IS NOT NULL)),
    CHECK (state = 'in_progress' OR response_status IS NOT NULL),
    CHECK ((response_status IS NULL) = (response_body IS NULL))
);
CREATE INDEX idempotency_in_progress ON idempotency_keys(locked_at)
    WHERE state = 'in_progress';
CREATE INDEX idempotency_completed ON idempotency_keys(completed_at)
    WHERE state = 'completed';
CREATE UNIQUE INDEX idempotency_reference_claims ON idempotency_keys(consumer_id, reference)
    WHERE state = 'in_progress' AND reference IS NOT NULL;

-- How this database reached its version: one row per version, written in the
-- transaction that applied it (a new database records every version at once).
CREATE TABLE schema_migrations (
    version     BIGINT PRIMARY KEY,
    name        TEXT    NOT NULL,
    -- Milliseconds since the Unix epoch (UTC).
    applied_at  BIGINT  NOT NULL,
    -- The idem release that applied it (Cargo package version).
    applied_by  TEXT    NOT NULL
);

-- The transactional outbox: one row per state change, written in the
-- transaction that made the change. `body` is the event object exactly as
-- `GET /v1/events/{id}` serves it and every webhook attempt sends it.
-- Deleted by the reaper past --event-retention, oldest (lowest id) first.
CREATE TABLE events (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id BIGINT  NOT NULL REFERENCES consumers(id),
    public_id   TEXT    NOT NULL UNIQUE,
    type        TEXT    NOT NULL,
    -- The public id of the object the event is about (acct_, ch_, re_, dp_),
    -- so that `idem verify` can pair state changes with their events.
    object_id   TEXT    NOT NULL,
    body        BYTEA    NOT NULL,
    created_at  BIGINT  NOT NULL
);
CREATE INDEX events_by_consumer ON events(consumer_id, id);
CREATE INDEX events_by_type ON events(consumer_id, type, id);

-- One row: state changes before `pruned_before` (ms) may have lost their
-- event to retention (or happened before events existed); every later one
-- has its event.
CREATE TABLE event_horizon (
    id             BIGINT  PRIMARY KEY CHECK (id = 1),
    pruned_before  BIGINT  NOT NULL
);
INSERT INTO event_horizon (id, pruned_before) VALUES (1, 0);

-- Where a consumer's events are delivered (Standard Webhooks). The secret is
-- kept (it signs every delivery) and shown once, when the endpoint is created.
-- A deleted endpoint keeps its row (deliveries name it) with deleted_at set.
CREATE TABLE webhook_endpoints (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id     BIGINT  NOT NULL REFERENCES consumers(id),
    public_id       TEXT    NOT NULL UNIQUE,
    url             TEXT    NOT NULL,
    -- JSON array of event types, or ["*"].
    enabled_events  TEXT    NOT NULL,
    description     TEXT,
    secret          BYTEA    NOT NULL CHECK (octet_length(secret) = 32),
    created_at      BIGINT  NOT NULL,
    deleted_at      BIGINT 
);
CREATE INDEX webhook_endpoints_by_consumer ON webhook_endpoints(consumer_id, id);

-- One row per (event, subscribed endpoint), written with the event: the
-- durable state of its delivery.
CREATE TABLE deliveries (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id         BIGINT  NOT NULL REFERENCES events(id),
    endpoint_id      BIGINT  NOT NULL REFERENCES webhook_endpoints(id),
    status           TEXT    NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    attempts         BIGINT  NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- HTTP status of the last attempt (NULL: none yet, or no response).
    last_status      BIGINT ,
    last_error       TEXT,
    -- When the next attempt is due (ms); NULL once succeeded or failed.
    next_attempt_at  BIGINT ,
    updated_at       BIGINT  NOT NULL,
    -- PostgreSQL only: the node that claimed this delivery (FOR UPDATE SKIP
    -- LOCKED) and until when (ms); no other node sends it before then.
    leased_by        TEXT,
    leased_until     BIGINT  NOT NULL DEFAULT 0,
    UNIQUE (event_id, endpoint_id),
    CHECK ((status = 'pending') = (next_attempt_at IS NOT NULL))
);
CREATE INDEX deliveries_due ON deliveries(next_attempt_at) WHERE status = 'pending';

-- Senders of inbound notifications (an acquirer's webhooks), each with the
-- secret it signs with; owned by the consumer that created it.
CREATE TABLE notification_sources (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id  BIGINT  NOT NULL REFERENCES consumers(id),
    public_id    TEXT    NOT NULL UNIQUE,
    name         TEXT    NOT NULL,
    secret       BYTEA    NOT NULL CHECK (octet_length(secret) = 32),
    created_at   BIGINT  NOT NULL
);
CREATE INDEX notification_sources_by_consumer ON notification_sources(consumer_id, id);

-- Inbound notifications, keyed by the sender's webhook-id per source: the
-- row is the idempotency record (fingerprint, stored answer) and the
-- notification itself.
CREATE TABLE notifications (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id      BIGINT  NOT NULL REFERENCES consumers(id),
    source_id        BIGINT  NOT NULL REFERENCES notification_sources(id),
    public_id        TEXT    NOT NULL UNIQUE,
    webhook_id       TEXT    NOT NULL,
    fingerprint      BYTEA    NOT NULL CHECK (octet_length(fingerprint) = 32),
    type             TEXT    NOT NULL,
    -- 'applied' (its effect committed), 'ignored' (nothing to do),
    -- 'unmatched' (names an authorization not recorded yet: applied in the
    -- transaction that records it).
    status           TEXT    NOT NULL CHECK (status IN ('applied', 'ignored', 'unmatched')),
    "authorization"  TEXT,
    body             BYTEA    NOT NULL,
    detail           TEXT,
    response_status  BIGINT  NOT NULL,
    response_body    BYTEA    NOT NULL,
    received_at      BIGINT  NOT NULL,
    applied_at       BIGINT ,
    UNIQUE (source_id, webhook_id)
);
CREATE INDEX notifications_by_consumer ON notifications(consumer_id, id);
CREATE INDEX notifications_unmatched ON notifications(consumer_id, "authorization")
    WHERE status = 'unmatched';

-- A chargeback applied to a charge: its two entries carry dispute_id.
CREATE TABLE disputes (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id      BIGINT  NOT NULL REFERENCES consumers(id),
    public_id        TEXT    NOT NULL UNIQUE,
    charge_id        BIGINT  NOT NULL REFERENCES charges(id),
    notification_id  BIGINT  NOT NULL UNIQUE REFERENCES notifications(id),
    amount           BIGINT  NOT NULL CHECK (amount > 0),
    reason           TEXT,
    created_at       BIGINT  NOT NULL
);
CREATE INDEX disputes_by_charge ON disputes(charge_id);

ALTER TABLE entries ADD FOREIGN KEY (dispute_id) REFERENCES disputes(id);
