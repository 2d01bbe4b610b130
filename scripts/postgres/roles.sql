-- Ductor's three database roles and its database. Run as a superuser, with
-- psql: by scripts/stack on every `up`, and by the postgres image of
-- docker-compose.yml when it initialises its data. Safe to run again.
--
--   ductor_migrator  owns the database `ductor` and, through
--                    `ductor migrate`, every object of Ductor's schema.
--                    CREATEDB, so that the tests, the bench and the chaos
--                    runs can make databases of their own. A member of
--                    `ductor`, so that it may end the application role's
--                    sessions when it drops such a database.
--   ductor           the application role, for `serve`, `submit`, `inspect`,
--                    `outbox redrive`: it owns nothing and may create
--                    nothing (Postgres 15 gives no one but the owner CREATE
--                    on schema public); `ductor migrate` grants it, table
--                    by table, the statements serve runs, and no way to
--                    mint or alter an API key or to delete history.
--   ductor_keys      the role of `ductor keys`: `ductor migrate` grants it
--                    the rows of `api_keys` it needs to make, list and
--                    revoke keys, and nothing else. The migrator is a member,
--                    to end its sessions like the application role's.
--
-- None is a superuser. The names and passwords are those of the URLs that
-- `scripts/stack env` prints and docker-compose.yml sets.

SELECT 'CREATE ROLE ductor_migrator'
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ductor_migrator')\gexec
ALTER ROLE ductor_migrator WITH LOGIN CREATEDB NOSUPERUSER NOCREATEROLE PASSWORD 'ductor_migrator';

SELECT 'CREATE ROLE ductor'
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ductor')\gexec
-- NOCREATEDB: a stack made before the migrator existed gave it CREATEDB.
ALTER ROLE ductor WITH LOGIN NOCREATEDB NOSUPERUSER NOCREATEROLE PASSWORD 'ductor';

SELECT 'GRANT ductor TO ductor_migrator'
WHERE NOT pg_has_role('ductor_migrator', 'ductor', 'MEMBER')\gexec

SELECT 'CREATE ROLE ductor_keys'
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ductor_keys')\gexec
ALTER ROLE ductor_keys WITH LOGIN NOCREATEDB NOSUPERUSER NOCREATEROLE PASSWORD 'ductor_keys';

SELECT 'GRANT ductor_keys TO ductor_migrator'
WHERE NOT pg_has_role('ductor_migrator', 'ductor_keys', 'MEMBER')\gexec

SELECT 'CREATE DATABASE ductor OWNER ductor_migrator'
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'ductor')\gexec

-- A stack made before the migrator existed: `ductor` owned the database and
-- everything the migrations had made in it. Give it all to the migrator:
-- REASSIGN covers the objects of this database and every database `ductor`
-- owned (test databases left behind included). `ductor` is then granted
-- its rights again by the next `ductor migrate`.
\connect ductor
SELECT 'REASSIGN OWNED BY ductor TO ductor_migrator'
WHERE EXISTS (
    SELECT FROM pg_shdepend s
    WHERE s.refclassid = 'pg_authid'::regclass
      AND s.refobjid = (SELECT oid FROM pg_roles WHERE rolname = 'ductor')
      AND s.deptype = 'o'
      AND s.dbid IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
)\gexec
