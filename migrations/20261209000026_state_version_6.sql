-- Run state version 6 (src/coordinator/stored.rs). A run keeps the task
-- steps that succeeded and name a compensation (`compensable`: each one's
-- compensation step, step key and output) and, once a catch began to
-- compensate it, why and how far (`compensating`). A binary of version 5
-- would ignore the fields and write the run back without them, so that a
-- later failure would undo nothing and a compensation's result could not
-- apply; the migration keeps such binaries away, since a binary refuses a
-- schema with a migration it does not know (`infra::db::check_migrated`).
--
-- Nothing is rewritten: a version 5 state loads as version 6 as it is (no
-- binary of version 5 compensated), and is written as version 6 with the
-- run's next transition. The column's comment names the newest version it
-- holds.

COMMENT ON COLUMN runs.state IS
    'The run state document (src/coordinator/stored.rs), its shape version in "v" (none: version 1). Since migration 20261209000026: state version 6, which binaries that know only version 5 or older never start on.';
