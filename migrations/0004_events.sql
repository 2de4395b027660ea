-- Version 4: events out and in.
--
-- Every state change writes an event in its own transaction (the
-- transactional outbox); each webhook endpoint subscribed to its type gets a
-- delivery row in that same transaction, so an event committed before a
-- crash is delivered after the restart. Inbound notifications (the
-- acquirer's webhooks) are keyed by the sender's `webhook-id` per source; a
-- chargeback becomes a dispute with its own entries. No existing table is
-- rebuilt: every change is a new table, a new nullable column or an index.

CREATE TABLE events (
    id          INTEGER PRIMARY KEY,
    consumer_id INTEGER NOT NULL REFERENCES consumers(id),
    public_id   TEXT    NOT NULL UNIQUE,
    type        TEXT    NOT NULL,
    object_id   TEXT    NOT NULL,
    body        BLOB    NOT NULL,
    created_at  INTEGER NOT NULL
);
CREATE INDEX events_by_consumer ON events(consumer_id, id);
CREATE INDEX events_by_type ON events(consumer_id, type, id);

CREATE TABLE event_horizon (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    pruned_before  INTEGER NOT NULL
);
-- Nothing before this migration wrote events.
INSERT INTO event_horizon (id, pruned_before) VALUES (1, CAST(strftime('%s', 'now') AS INTEGER) * 1000);

CREATE TABLE webhook_endpoints (
    id              INTEGER PRIMARY KEY,
    consumer_id     INTEGER NOT NULL REFERENCES consumers(id),
    public_id       TEXT    NOT NULL UNIQUE,
    url             TEXT    NOT NULL,
    enabled_events  TEXT    NOT NULL,
    description     TEXT,
    secret          BLOB    NOT NULL CHECK (length(secret) = 32),
    created_at      INTEGER NOT NULL,
    deleted_at      INTEGER
);
CREATE INDEX webhook_endpoints_by_consumer ON webhook_endpoints(consumer_id, id);

CREATE TABLE deliveries (
    id               INTEGER PRIMARY KEY,
    event_id         INTEGER NOT NULL REFERENCES events(id),
    endpoint_id      INTEGER NOT NULL REFERENCES webhook_endpoints(id),
    status           TEXT    NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_status      INTEGER,
    last_error       TEXT,
    next_attempt_at  INTEGER,
    updated_at       INTEGER NOT NULL,
    UNIQUE (event_id, endpoint_id),
    CHECK ((status = 'pending') = (next_attempt_at IS NOT NULL))
);
CREATE INDEX deliveries_due ON deliveries(next_attempt_at) WHERE status = 'pending';

CREATE TABLE notification_sources (
    id           INTEGER PRIMARY KEY,
    consumer_id  INTEGER NOT NULL REFERENCES consumers(id),
    public_id    TEXT    NOT NULL UNIQUE,
    name         TEXT    NOT NULL,
    secret       BLOB    NOT NULL CHECK (length(secret) = 32),
    created_at   INTEGER NOT NULL
);
CREATE INDEX notification_sources_by_consumer ON notification_sources(consumer_id, id);

CREATE TABLE notifications (
    id               INTEGER PRIMARY KEY,
    consumer_id      INTEGER NOT NULL REFERENCES consumers(id),
    source_id        INTEGER NOT NULL REFERENCES notification_sources(id),
    public_id        TEXT    NOT NULL UNIQUE,
    webhook_id       TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    type             TEXT    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('applied', 'ignored', 'unmatched')),
    authorization    TEXT,
    body             BLOB    NOT NULL,
    detail           TEXT,
    response_status  INTEGER NOT NULL,
    response_body    BLOB    NOT NULL,
    received_at      INTEGER NOT NULL,
    applied_at       INTEGER,
    UNIQUE (source_id, webhook_id)
);
CREATE INDEX notifications_by_consumer ON notifications(consumer_id, id);
CREATE INDEX notifications_unmatched ON notifications(consumer_id, authorization)
    WHERE status = 'unmatched';

CREATE TABLE disputes (
    id               INTEGER PRIMARY KEY,
    consumer_id      INTEGER NOT NULL REFERENCES consumers(id),
    public_id        TEXT    NOT NULL UNIQUE,
    charge_id        INTEGER NOT NULL REFERENCES charges(id),
    notification_id  INTEGER NOT NULL UNIQUE REFERENCES notifications(id),
    amount           INTEGER NOT NULL CHECK (amount > 0),
    reason           TEXT,
    created_at       INTEGER NOT NULL
);
CREATE INDEX disputes_by_charge ON disputes(charge_id);

ALTER TABLE entries ADD COLUMN dispute_id INTEGER REFERENCES disputes(id);
ALTER TABLE charges ADD COLUMN captured_at INTEGER;
CREATE INDEX charges_by_authorization ON charges(consumer_id, authorization_id);
