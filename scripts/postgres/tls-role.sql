-- The local stack's role for the tests of TLS: `ductor_tls` has the
-- application role's rights (it is a member of `ductor`), and pg_hba.conf
-- (written by scripts/stack) lets it in over TLS only. Run by scripts/stack
-- on every `up`, as a superuser, after roles.sql; safe to run again. Not
-- part of docker-compose.yml, whose Postgres serves no TLS.

SELECT 'CREATE ROLE ductor_tls'
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ductor_tls')\gexec
ALTER ROLE ductor_tls WITH LOGIN INHERIT NOCREATEDB NOSUPERUSER NOCREATEROLE PASSWORD 'ductor_tls';

SELECT 'GRANT ductor TO ductor_tls'
WHERE NOT pg_has_role('ductor_tls', 'ductor', 'MEMBER')\gexec

-- So that the migrator may end this role's sessions when it drops a test
-- database, as it may the application role's.
SELECT 'GRANT ductor_tls TO ductor_migrator'
WHERE NOT pg_has_role('ductor_migrator', 'ductor_tls', 'MEMBER')\gexec
