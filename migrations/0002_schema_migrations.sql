-- Version 2: a record of how this database reached its schema version.
--
-- `PRAGMA user_version` says which version a database is at; this table says
-- when each version was applied and by which idem, so an operator reading an
-- old file (or a support ticket) can tell whether it was created at this
-- version or migrated, and when. Rows are written by the migration runner
-- (src/store/migrations.rs) in the same transaction as each step.

CREATE TABLE schema_migrations (
    version     INTEGER PRIMARY KEY,
    name        TEXT    NOT NULL,
    -- Milliseconds since the Unix epoch (UTC).
    applied_at  INTEGER NOT NULL,
    -- The idem release that applied it (Cargo package version).
    applied_by  TEXT    NOT NULL
);
