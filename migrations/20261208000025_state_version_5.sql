-- Run state version 5 (src/coordinator/stored.rs). A run in a `parallel`
-- step keeps where each of its branches stands in its state (`lanes`:
-- each branch's step, outstanding attempt, pending retry, wait and
-- output). A binary of version 4 would ignore the field and write the run
-- back without it, so that no result of a branch could apply any more;
-- the migration keeps such binaries away, since a binary refuses a schema
-- with a migration it does not know (`infra::db::check_migrated`).
--
-- Nothing is rewritten: a version 4 state loads as version 5 as it is (no
-- binary of version 4 ran branches), and is written as version 5 with the
-- run's next transition. The column's comment names the newest version it
-- holds.

COMMENT ON COLUMN runs.state IS
    'The run state document (src/coordinator/stored.rs), its shape version in "v" (none: version 1). Since migration 20261208000025: state version 5, which binaries that know only version 4 or older never start on.';
