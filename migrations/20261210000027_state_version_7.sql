-- Run state version 7 (src/coordinator/stored.rs). A child run keeps its
-- parent (`parent`: the parent's run and the stamp of the attempt of its
-- `child` step), which its outcome answers with an `attempt.result`. A
-- binary of version 6 would ignore the field and write the run back
-- without it, so that the parent's step would wait for an outcome that
-- never comes; the migration keeps such binaries away, since a binary
-- refuses a schema with a migration it does not know
-- (`infra::db::check_migrated`).
--
-- Nothing is rewritten: a version 6 state loads as version 7 as it is (no
-- binary of version 6 started child runs), and is written as version 7
-- with the run's next transition. The column's comment names the newest
-- version it holds.

COMMENT ON COLUMN runs.state IS
    'The run state document (src/coordinator/stored.rs), its shape version in "v" (none: version 1). Since migration 20261210000027: state version 7, which binaries that know only version 6 or older never start on.';
