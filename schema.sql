-- idem schema, version 2 (PRAGMA user_version = 2): the whole current schema,
-- applied as it is to a new database. An existing database reaches the same
-- schema through the numbered steps in migrations/ (tests/migrations.rs proves
-- that both ways give the same schema).
--
-- Timestamps are integer milliseconds since the Unix epoch (UTC); the API
-- renders them as RFC 3339. Money is INTEGER minor units. Every table that a
-- consumer owns carries consumer_id, and every lookup by public id is scoped by
-- it, so another consumer's id is indistinguishable from one that does not exist.

CREATE TABLE consumers (
    id          INTEGER PRIMARY KEY,
    public_id   TEXT    NOT NULL UNIQUE,
    name        TEXT    NOT NULL UNIQUE,
    key_hash    BLOB    NOT NULL UNIQUE CHECK (length(key_hash) = 32),
    created_at  INTEGER NOT NULL
);

CREATE TABLE accounts (
    id              INTEGER PRIMARY KEY,
    consumer_id     INTEGER NOT NULL REFERENCES consumers(id),
    public_id       TEXT    NOT NULL,
    currency        TEXT    NOT NULL CHECK (length(currency) = 3),
    allow_negative  INTEGER NOT NULL CHECK (allow_negative IN (0, 1)),
    metadata        TEXT    NOT NULL,
    balance         INTEGER NOT NULL DEFAULT 0,
    created_at      INTEGER NOT NULL,
    UNIQUE (consumer_id, public_id)
);

CREATE TABLE charges (
    id                INTEGER PRIMARY KEY,
    consumer_id       INTEGER NOT NULL REFERENCES consumers(id),
    public_id         TEXT    NOT NULL UNIQUE,
    amount            INTEGER NOT NULL CHECK (amount > 0),
    currency          TEXT    NOT NULL,
    source_id         INTEGER NOT NULL REFERENCES accounts(id),
    destination_id    INTEGER NOT NULL REFERENCES accounts(id),
    amount_refunded   INTEGER NOT NULL DEFAULT 0 CHECK (amount_refunded BETWEEN 0 AND amount),
    reference         TEXT,
    description       TEXT,
    metadata          TEXT    NOT NULL,
    -- SHA-256 of the canonical request body: a new key with the same reference
    -- is a replay only when this matches.
    fingerprint       BLOB    NOT NULL,
    -- The reservation that produced the charge (idempotency_keys.op_id). Key rows
    -- are deleted after retention, so this is not a foreign key; UNIQUE proves
    -- that no reservation produced two charges.
    op_id             TEXT    NOT NULL UNIQUE,
    idempotency_key   TEXT    NOT NULL,
    authorization_id  TEXT    NOT NULL,
    created_at        INTEGER NOT NULL
);
CREATE INDEX charges_by_consumer ON charges(consumer_id, id);
CREATE UNIQUE INDEX charges_by_reference ON charges(consumer_id, reference)
    WHERE reference IS NOT NULL;

CREATE TABLE refunds (
    id               INTEGER PRIMARY KEY,
    consumer_id      INTEGER NOT NULL REFERENCES consumers(id),
    public_id        TEXT    NOT NULL UNIQUE,
    charge_id        INTEGER NOT NULL REFERENCES charges(id),
    amount           INTEGER NOT NULL CHECK (amount > 0),
    op_id            TEXT    NOT NULL UNIQUE,
    idempotency_key  TEXT    NOT NULL,
    created_at       INTEGER NOT NULL
);
CREATE INDEX refunds_by_charge ON refunds(charge_id);

-- Double entry: every charge writes one debit (negative) and one credit
-- (positive) entry; every refund writes their reverse.
CREATE TABLE entries (
    id          INTEGER PRIMARY KEY,
    public_id   TEXT    NOT NULL UNIQUE,
    account_id  INTEGER NOT NULL REFERENCES accounts(id),
    amount      INTEGER NOT NULL CHECK (amount <> 0),
    charge_id   INTEGER NOT NULL REFERENCES charges(id),
    refund_id   INTEGER REFERENCES refunds(id),
    created_at  INTEGER NOT NULL
);
CREATE INDEX entries_by_account ON entries(account_id, id);
CREATE INDEX entries_by_charge ON entries(charge_id);

-- One row per (consumer, method, concrete path, key): the reservation, its
-- recovery point and, once completed, the stored answer.
CREATE TABLE idempotency_keys (
    id               INTEGER PRIMARY KEY,
    consumer_id      INTEGER NOT NULL REFERENCES consumers(id),
    method           TEXT    NOT NULL,
    path             TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    op_id            TEXT    NOT NULL UNIQUE,
    state            TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed')),
    -- Fencing token: bumped by every takeover and checked by every later
    -- commit of the owner that holds it.
    generation       INTEGER NOT NULL,
    -- When the current owner last proved it was alive (reservation or
    -- recovery point); 0 means unlocked: the next request takes over at once.
    locked_at        INTEGER NOT NULL,
    -- 'reserved' or 'authorized' (the acquirer answered; see authorization).
    recovery_point   TEXT    NOT NULL CHECK (recovery_point IN ('reserved', 'authorized')),
    -- The validated request as JSON, so the reaper can finish it alone.
    request          TEXT    NOT NULL,
    -- A charge's `reference`, claimed while the key is in progress so that
    -- two keys with one reference never both reach the acquirer.
    reference        TEXT,
    authorization    TEXT,
    response_status  INTEGER,
    response_body    BLOB,
    created_at       INTEGER NOT NULL,
    completed_at     INTEGER,
    UNIQUE (consumer_id, method, path, key),
    CHECK ((state = 'completed') = (response_status IS NOT NULL AND completed_at IS NOT NULL))
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
    version     INTEGER PRIMARY KEY,
    name        TEXT    NOT NULL,
    -- Milliseconds since the Unix epoch (UTC).
    applied_at  INTEGER NOT NULL,
    -- The idem release that applied it (Cargo package version).
    applied_by  TEXT    NOT NULL
);
