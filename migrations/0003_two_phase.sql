-- Version 3: two-phase charges (authorize, capture, cancel).
--
-- A charge may now hold money instead of moving it: `requires_capture`
-- places a hold on its source (accounts.held) and reserves room on its
-- destination (accounts.pending_credit), until a capture moves up to the
-- held amount or a cancel (or the hold's expiry) releases it. The charges
-- table gains its status and amounts; its CHECKs change, so it is rebuilt
-- (SQLite's documented procedure: new table, copy, drop, rename, indexes).
-- Every v1 charge was captured at once: status 'succeeded', amount_captured
-- = amount. Key rows gain the recovery points of captures, cancels and
-- refunds, and may hold their decided answer before they complete (a
-- declined charge keeps its 402 while its authorization is voided).

ALTER TABLE accounts ADD COLUMN held INTEGER NOT NULL DEFAULT 0
    CHECK (typeof(held) = 'integer' AND held >= 0);
ALTER TABLE accounts ADD COLUMN pending_credit INTEGER NOT NULL DEFAULT 0
    CHECK (typeof(pending_credit) = 'integer' AND pending_credit >= 0);

CREATE TABLE charges_v3 (
    id                   INTEGER PRIMARY KEY,
    consumer_id          INTEGER NOT NULL REFERENCES consumers(id),
    public_id            TEXT    NOT NULL UNIQUE,
    amount               INTEGER NOT NULL CHECK (amount > 0),
    currency             TEXT    NOT NULL,
    source_id            INTEGER NOT NULL REFERENCES accounts(id),
    destination_id       INTEGER NOT NULL REFERENCES accounts(id),
    status               TEXT    NOT NULL
        CHECK (status IN ('succeeded', 'requires_capture', 'canceled')),
    amount_captured      INTEGER NOT NULL CHECK (amount_captured BETWEEN 0 AND amount),
    amount_refunded      INTEGER NOT NULL DEFAULT 0 CHECK (amount_refunded >= 0),
    amount_disputed      INTEGER NOT NULL DEFAULT 0 CHECK (amount_disputed >= 0),
    reference            TEXT,
    description          TEXT,
    metadata             TEXT    NOT NULL,
    fingerprint          BLOB    NOT NULL,
    op_id                TEXT    NOT NULL UNIQUE,
    idempotency_key      TEXT    NOT NULL,
    authorization_id     TEXT    NOT NULL,
    expires_at           INTEGER,
    canceled_at          INTEGER,
    cancellation_reason  TEXT    CHECK (cancellation_reason IN ('requested', 'expired')),
    claimed_by           TEXT,
    created_at           INTEGER NOT NULL,
    CHECK (amount_refunded + amount_disputed <= amount_captured),
    CHECK ((status = 'succeeded') = (amount_captured > 0)),
    CHECK ((status = 'requires_capture') = (expires_at IS NOT NULL)),
    CHECK ((status = 'canceled') = (canceled_at IS NOT NULL)),
    CHECK ((status = 'canceled') = (cancellation_reason IS NOT NULL)),
    CHECK (status = 'requires_capture' OR claimed_by IS NULL)
);
INSERT INTO charges_v3 (id, consumer_id, public_id, amount, currency, source_id,
    destination_id, status, amount_captured, amount_refunded, amount_disputed, reference,
    description, metadata, fingerprint, op_id, idempotency_key, authorization_id, created_at)
SELECT id, consumer_id, public_id, amount, currency, source_id, destination_id, 'succeeded',
    amount, amount_refunded, 0, reference, description, metadata, fingerprint, op_id,
    idempotency_key, authorization_id, created_at
FROM charges;
DROP TABLE charges;
ALTER TABLE charges_v3 RENAME TO charges;
CREATE INDEX charges_by_consumer ON charges(consumer_id, id);
CREATE UNIQUE INDEX charges_by_reference ON charges(consumer_id, reference)
    WHERE reference IS NOT NULL;
CREATE INDEX charges_expiring ON charges(expires_at) WHERE status = 'requires_capture';

CREATE TABLE idempotency_keys_v3 (
    id               INTEGER PRIMARY KEY,
    consumer_id      INTEGER NOT NULL REFERENCES consumers(id),
    method           TEXT    NOT NULL,
    path             TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    op_id            TEXT    NOT NULL UNIQUE,
    state            TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed')),
    generation       INTEGER NOT NULL,
    locked_at        INTEGER NOT NULL,
    recovery_point   TEXT    NOT NULL CHECK (recovery_point IN
        ('reserved', 'authorized', 'declined', 'captured', 'voided', 'applied')),
    request          TEXT    NOT NULL,
    reference        TEXT,
    authorization    TEXT,
    response_status  INTEGER,
    response_body    BLOB,
    created_at       INTEGER NOT NULL,
    completed_at     INTEGER,
    UNIQUE (consumer_id, method, path, key),
    CHECK ((state = 'completed') = (completed_at IS NOT NULL)),
    CHECK (state = 'in_progress' OR response_status IS NOT NULL),
    CHECK ((response_status IS NULL) = (response_body IS NULL))
);
INSERT INTO idempotency_keys_v3 (id, consumer_id, method, path, key, fingerprint, op_id, state,
    generation, locked_at, recovery_point, request, reference, authorization, response_status,
    response_body, created_at, completed_at)
SELECT id, consumer_id, method, path, key, fingerprint, op_id, state, generation, locked_at,
    recovery_point, request, reference, authorization, response_status, response_body,
    created_at, completed_at
FROM idempotency_keys;
DROP TABLE idempotency_keys;
ALTER TABLE idempotency_keys_v3 RENAME TO idempotency_keys;
CREATE INDEX idempotency_in_progress ON idempotency_keys(locked_at)
    WHERE state = 'in_progress';
CREATE INDEX idempotency_completed ON idempotency_keys(completed_at)
    WHERE state = 'completed';
CREATE UNIQUE INDEX idempotency_reference_claims ON idempotency_keys(consumer_id, reference)
    WHERE state = 'in_progress' AND reference IS NOT NULL;
