-- Run state version 3 (src/coordinator/stored.rs). Since 7d5d594 a run's
-- state keeps `retries` (the action id of every retry it applied, so that
-- each applies once, and at most 64 do) and `failed_seq` (the run.failed
-- transition a retry must name). They were written as optional fields of
-- version 2, which the binaries before them read as their own version 2:
-- such a binary would ignore both and write the run back without them, so
-- that the run forgot which retries it had applied and which failure it
-- is failed by. The shape is version 3 from this migration on, and the
-- migration itself keeps the older binaries away: a binary refuses a
-- schema with a migration it does not know (`infra::db::check_migrated`),
-- so none that reads version 2 as its own starts once this has run.
--
-- Nothing is rewritten: a version 2 state, with retries or without, loads
-- as version 3 as it is, and is written as version 3 with the run's next
-- transition. The column's comment names the newest version it holds.

COMMENT ON COLUMN runs.state IS
    'The run state document (src/coordinator/stored.rs), its shape version in "v" (none: version 1). Since migration 20261206000021: state version 3, which binaries that know only version 2 never start on.';
