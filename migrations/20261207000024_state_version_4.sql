-- Run state version 4 (src/coordinator/stored.rs). A run of a workflow
-- that selects its steps' inputs or its output keeps its document of
-- results in its state (`results`: each finished step's result at its
-- result path). A binary of version 3 would ignore the field and write the
-- run back without it, so that a later step reading a result would find
-- nothing; the migration keeps such binaries away, since a binary refuses
-- a schema with a migration it does not know (`infra::db::check_migrated`).
--
-- Nothing is rewritten: a version 3 state loads as version 4 as it is (no
-- binary of version 3 selected data), and is written as version 4 with the
-- run's next transition. The column's comment names the newest version it
-- holds.

COMMENT ON COLUMN runs.state IS
    'The run state document (src/coordinator/stored.rs), its shape version in "v" (none: version 1). Since migration 20261207000024: state version 4, which binaries that know only version 3 or older never start on.';
