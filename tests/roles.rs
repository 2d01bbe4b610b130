//! The database roles against the real Postgres, as `ductor migrate`
//! leaves them: the application role (`serve`'s) and the keys role
//! (`ductor keys`') are each refused, as `insufficient_privilege`, what
//! they must not do, and can do what they do. Above all the application
//! role can neither mint, move, widen nor un-revoke an API key, nor delete
//! or rewrite a run's history; retention still purges finished runs, with
//! their history, through its own path.

mod common;

use common::*;
use ductor::auth::Scope;
use ductor::auth::store::{self, KeyRequest, Revoked};
use sqlx::PgPool;

const INSUFFICIENT_PRIVILEGE: &str = "42501";

fn sql_state(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

/// Asserts that `pool`'s role is refused each of `statements` for want of
/// a privilege (and not, say, by a trigger or a constraint).
async fn refused(pool: &PgPool, who: &str, statements: &[&str]) {
    for sql in statements {
        let err = sqlx::raw_sql(sql)
            .execute(pool)
            .await
            .expect_err(&format!("{who} may not: {sql}"));
        assert_eq!(
            sql_state(&err).as_deref(),
            Some(INSUFFICIENT_PRIVILEGE),
            "{who}: {sql}: {err}"
        );
    }
}

fn key_request(tenant: &str) -> KeyRequest {
    KeyRequest {
        tenant: tenant.into(),
        scopes: vec![Scope::RunsRead],
        label: Some("roles".into()),
        requests_per_second: None,
        expires_at: None,
    }
}

/// A run `run_id` that finished `finished_ago` ago (running when `None`),
/// with two transitions and one attempt, written as the owner.
async fn seed_run(db: &TestDb, run_id: &str, finished_ago: Option<&str>) {
    let (status, finished_at) = match finished_ago {
        Some(ago) => ("cancelled", format!("now() - interval '{ago}'")),
        None => ("running", "NULL".to_string()),
    };
    sqlx::raw_sql(&format!(
        "INSERT INTO runs (run_id, tenant_scope, pool_id, workflow_name, workflow_version, \
             status, last_transition_seq, state, created_at, updated_at, finished_at) \
         VALUES ('{run_id}', 'acme', 'default', 'wf', 1, '{status}', 2, '{{}}'::jsonb, \
             now() - interval '1 day', now(), {finished_at}); \
         INSERT INTO run_transitions (run_id, seq, input_ref, kind, to_status, step_index, \
             created_at) \
         VALUES ('{run_id}', 1, 'start', 'run.started', 'running', 0, now()), \
                ('{run_id}', 2, 'cancel', 'run.cancelled', '{status}', 0, now()); \
         INSERT INTO run_attempts (stamp, run_id, step_index, attempt, status, dispatched_at, \
             deadline, finished_at) \
         VALUES (gen_random_uuid(), '{run_id}', 0, 1, 'cancelled', now(), now(), now())"
    ))
    .execute(&db.owner)
    .await
    .expect("seeding a run as the owner");
}

async fn rows_of(db: &TestDb, table: &str, run_id: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE run_id = $1"))
        .bind(run_id)
        .fetch_one(&db.owner)
        .await
        .expect("counting rows as the owner")
}

#[tokio::test]
async fn the_application_role_cannot_mint_move_widen_or_unrevoke_a_key() {
    let db = TestDb::migrated().await;
    let key = ductor::auth::key::generate().unwrap();
    store::insert(&db.owner, &key, &key_request("acme"))
        .await
        .unwrap();
    let id = &key.key_id;
    refused(
        &db.pool,
        "the application role",
        &[
            "INSERT INTO api_keys (key_id, tenant_scope, scopes, secret_sha256) \
             VALUES ('00000000000000aa', 'acme', ARRAY['admin'], sha256('x'))",
            &format!("UPDATE api_keys SET tenant_scope = 'globex' WHERE key_id = '{id}'"),
            &format!("UPDATE api_keys SET revoked_at = NULL WHERE key_id = '{id}'"),
            &format!("UPDATE api_keys SET revoked_at = now() WHERE key_id = '{id}'"),
            &format!("UPDATE api_keys SET scopes = ARRAY['admin'] WHERE key_id = '{id}'"),
            &format!("UPDATE api_keys SET secret_sha256 = sha256('x') WHERE key_id = '{id}'"),
            &format!("UPDATE api_keys SET expires_at = NULL WHERE key_id = '{id}'"),
            &format!("UPDATE api_keys SET requests_per_second = 1000000 WHERE key_id = '{id}'"),
            &format!("DELETE FROM api_keys WHERE key_id = '{id}'"),
            "TRUNCATE api_keys",
        ],
    )
    .await;
    // What serve does with keys: it reads them and notes their use.
    let stored = store::load(&db.pool, id).await.unwrap().expect("the key");
    assert_eq!(stored.tenant, "acme");
    assert!(stored.use_unnoted, "a key never used");
    store::touch(&db.pool, id)
        .await
        .expect("noting a key's use");
    let stored = store::load(&db.pool, id).await.unwrap().unwrap();
    assert!(!stored.use_unnoted, "its use is noted");
    db.drop_db().await;
}

#[tokio::test]
async fn the_application_role_cannot_delete_or_rewrite_history() {
    let db = TestDb::migrated().await;
    seed_run(&db, "r-done", Some("2 hours")).await;
    seed_run(&db, "r-live", None).await;
    sqlx::query(
        "INSERT INTO run_tombstones (run_id, tenant_scope, workflow_name, workflow_version, \
             status, last_transition_seq, created_at, finished_at) \
         VALUES ('r-gone', 'acme', 'wf', 1, 'succeeded', 3, now(), now())",
    )
    .execute(&db.owner)
    .await
    .unwrap();
    refused(
        &db.pool,
        "the application role",
        &[
            "DELETE FROM run_transitions WHERE run_id = 'r-done'",
            "DELETE FROM run_attempts WHERE run_id = 'r-done'",
            // A run goes only through retention, and only once finished.
            "DELETE FROM runs WHERE run_id = 'r-live'",
            "DELETE FROM run_tombstones WHERE run_id = 'r-gone'",
            "TRUNCATE run_transitions",
            "TRUNCATE run_attempts",
            "TRUNCATE runs CASCADE",
            // The history, as written, stays as written (the privilege is
            // refused before the append-only trigger would fire).
            "UPDATE run_transitions SET kind = 'x' WHERE run_id = 'r-done'",
            "UPDATE run_transitions SET detail = '{}' WHERE run_id = 'r-done'",
            "UPDATE run_attempts SET run_id = 'r-live' WHERE run_id = 'r-done'",
            "UPDATE run_attempts SET attempt = 9 WHERE run_id = 'r-done'",
            "UPDATE runs SET tenant_scope = 'globex' WHERE run_id = 'r-live'",
            "UPDATE runs SET run_id = 'r-other' WHERE run_id = 'r-live'",
            "UPDATE runs SET created_at = now() WHERE run_id = 'r-live'",
            // A tombstone is retention's to write and to expire.
            "INSERT INTO run_tombstones (run_id, tenant_scope, workflow_name, workflow_version, \
                 status, last_transition_seq, created_at, finished_at) \
             VALUES ('r-fake', 'acme', 'wf', 1, 'succeeded', 1, now(), now())",
            "UPDATE run_tombstones SET tenant_scope = 'globex' WHERE run_id = 'r-gone'",
            // What an intent carries was fixed at commit.
            "UPDATE eec_effect_intent SET payload = '' WHERE run_id = 'r-live'",
            "UPDATE eec_effect_intent SET topic = 'elsewhere' WHERE run_id = 'r-live'",
            "UPDATE eec_effect_intent SET not_before = now() WHERE run_id = 'r-live'",
        ],
    )
    .await;
    for table in ["runs", "run_transitions", "run_attempts"] {
        assert!(rows_of(&db, table, "r-live").await > 0, "{table}");
        assert!(rows_of(&db, table, "r-done").await > 0, "{table}");
    }
    db.drop_db().await;
}

#[tokio::test]
async fn retention_still_purges_a_finished_run_with_its_history_as_the_application_role() {
    let db = TestDb::migrated().await;
    seed_run(&db, "r-done", Some("2 hours")).await;
    seed_run(&db, "r-young", Some("1 second")).await;
    seed_run(&db, "r-live", None).await;
    let mut runs = test_config(&db).runs;
    runs.retention_ms = 3_600_000;
    runs.tombstone_retention_ms = 3_600_000;
    runs.purge_batch = 1;
    let purged = ductor::apply::retention::purge(&db.pool, &runs)
        .await
        .expect("retention as the application role");
    assert_eq!((purged.runs, purged.tombstones), (1, 0));
    for table in ["runs", "run_transitions", "run_attempts"] {
        assert_eq!(rows_of(&db, table, "r-done").await, 0, "{table}");
        assert!(rows_of(&db, table, "r-young").await > 0, "{table}");
        assert!(rows_of(&db, table, "r-live").await > 0, "{table}");
    }
    assert_eq!(rows_of(&db, "run_tombstones", "r-done").await, 1);
    // Nothing else goes that way: a running run cannot be deleted directly.
    refused(
        &db.pool,
        "the application role",
        &["DELETE FROM runs WHERE run_id = 'r-live'"],
    )
    .await;
    // Tombstones expire through retention too.
    sqlx::query("UPDATE run_tombstones SET purged_at = now() - interval '2 hours'")
        .execute(&db.owner)
        .await
        .unwrap();
    let purged = ductor::apply::retention::purge(&db.pool, &runs)
        .await
        .expect("tombstone retention as the application role");
    assert_eq!((purged.runs, purged.tombstones), (0, 1));
    assert_eq!(rows_of(&db, "run_tombstones", "r-done").await, 0);
    db.drop_db().await;
}

/// Retention's functions run as their owner, so they must resolve no
/// name through a schema a caller could write, and take no argument that
/// would make them delete more than retention does.
#[tokio::test]
async fn the_purge_functions_are_pinned_and_check_their_arguments() {
    let db = TestDb::migrated().await;
    let pinned: Vec<(String, bool, Vec<String>)> = sqlx::query_as(
        "SELECT p.proname::text, p.prosecdef, coalesce(p.proconfig, '{}') FROM pg_proc p \
         WHERE p.pronamespace = current_schema()::regnamespace \
           AND p.proname LIKE 'ductor_purge_%' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(pinned.len(), 3, "{pinned:?}");
    for (name, definer, config) in &pinned {
        assert!(definer, "{name} runs as its owner");
        assert_eq!(config, &["search_path=public, pg_temp"], "{name}");
    }
    for sql in [
        "SELECT * FROM ductor_purge_finished_runs(-1, 10)",
        "SELECT * FROM ductor_purge_finished_runs(NULL, 10)",
        "SELECT * FROM ductor_purge_finished_runs(0, 0)",
        "SELECT * FROM ductor_purge_tombstones(-1, 10)",
        "SELECT * FROM ductor_purge_tombstones(0, 0)",
        "SELECT * FROM ductor_purge_dead_letters(-1, 10)",
        "SELECT * FROM ductor_purge_dead_letters(0, 0)",
    ] {
        let err = sqlx::raw_sql(sql).execute(&db.pool).await.expect_err(sql);
        assert_eq!(sql_state(&err).as_deref(), Some("22023"), "{sql}: {err}");
    }
    db.drop_db().await;
}

/// `ductor keys` as serve's role (no `database.keys_url`) is refused, and
/// says what to set; and `ductor migrate` will not make serve's role the
/// keys role.
#[tokio::test]
async fn keys_without_the_keys_role_are_refused_with_the_fix() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    config.database.keys_url = None;
    let args = ductor::cli::keys::CreateArgs {
        tenant: "acme".into(),
        scopes: "runs:read".into(),
        expires: None,
        label: None,
        requests_per_second: None,
    };
    let err = ductor::cli::keys::create(&config, args)
        .await
        .expect_err("serve's role may not make a key");
    let message = format!("{err:#}");
    assert!(message.contains("database.keys_url"), "{message}");
    assert_eq!(db.count("api_keys").await, 0);
    let key = ductor::auth::key::generate().unwrap();
    store::insert(&db.keys, &key, &key_request("acme"))
        .await
        .unwrap();
    let err = ductor::cli::keys::revoke(&config, &key.key_id)
        .await
        .expect_err("serve's role may not revoke a key");
    assert!(format!("{err:#}").contains("database.keys_url"), "{err:#}");

    config.database.keys_role = config.database.app_role();
    let err = ductor::infra::db::migrate_database(&config.database)
        .await
        .expect_err("the keys role must not be serve's");
    assert!(format!("{err:#}").contains("database.keys_role"), "{err:#}");
    db.drop_db().await;
}

#[tokio::test]
async fn the_keys_role_makes_lists_and_revokes_keys_and_touches_nothing_else() {
    let db = TestDb::migrated().await;
    seed_run(&db, "r-live", None).await;
    let key = ductor::auth::key::generate().unwrap();
    let made = store::insert(&db.keys, &key, &key_request("acme"))
        .await
        .expect("the keys role makes a key");
    assert_eq!(made.tenant, "acme");
    let listed = store::list(&db.keys, Some("acme"))
        .await
        .expect("the keys role lists keys");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key_id, key.key_id);
    let revoke = store::revoke(&db.keys, &key.key_id).await;
    assert_eq!(revoke.expect("the keys role revokes a key"), Revoked::Now);
    assert_eq!(
        store::revoke(&db.keys, &key.key_id).await.unwrap(),
        Revoked::Already
    );
    let id = &key.key_id;
    refused(
        &db.keys,
        "the keys role",
        &[
            "SELECT * FROM runs",
            "SELECT * FROM run_transitions",
            "SELECT * FROM run_attempts",
            "SELECT * FROM run_tombstones",
            "SELECT * FROM eec_effect_intent",
            "SELECT * FROM eec_routing_idempotency",
            "SELECT * FROM eec_drainer_member",
            "SELECT * FROM _sqlx_migrations",
            "INSERT INTO runs (run_id, tenant_scope, pool_id, workflow_name, workflow_version, \
                 status, last_transition_seq, state, created_at, updated_at) \
             VALUES ('r-keys', 'acme', 'default', 'wf', 1, 'running', 0, '{}', now(), now())",
            "UPDATE runs SET status = 'failed' WHERE run_id = 'r-live'",
            "DELETE FROM runs WHERE run_id = 'r-live'",
            "DELETE FROM run_transitions",
            "INSERT INTO eec_effect_intent (run_id, seq, effect_index, idempotency_key, \
                 tenant_scope, topic, message_key, headers, payload, ce_type, not_before) \
             VALUES ('r-live', 1, 0, 'k', 'acme', 't', '', '{}', '', 'x', now())",
            "DELETE FROM eec_effect_intent",
            "SELECT * FROM ductor_purge_finished_runs(0, 10)",
            "SELECT * FROM ductor_purge_tombstones(0, 10)",
            // Of a key, it writes what `ductor keys` writes and no more.
            &format!("UPDATE api_keys SET tenant_scope = 'globex' WHERE key_id = '{id}'"),
            &format!("UPDATE api_keys SET scopes = ARRAY['admin'] WHERE key_id = '{id}'"),
            &format!("UPDATE api_keys SET last_used_at = now() WHERE key_id = '{id}'"),
            &format!("DELETE FROM api_keys WHERE key_id = '{id}'"),
            "INSERT INTO api_keys (key_id, tenant_scope, scopes, secret_sha256, created_at) \
             VALUES ('00000000000000bb', 'acme', ARRAY['admin'], sha256('x'), now() - interval '1 year')",
            "TRUNCATE api_keys",
        ],
    )
    .await;
    assert_eq!(rows_of(&db, "runs", "r-live").await, 1);
    db.drop_db().await;
}

/// Every table of Ductor's schema is one the application role can read:
/// a table a migration adds without its grants in `ductor migrate` would
/// fail here before it failed in `serve`. And a table made later gets
/// nothing by default.
#[tokio::test]
async fn every_table_has_its_grants_and_a_later_one_gets_none_by_default() {
    let db = TestDb::migrated().await;
    let ungranted: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c \
         WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r' \
           AND NOT has_table_privilege(current_user, c.oid, 'SELECT') ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(ungranted.is_empty(), "no grants for serve on {ungranted:?}");
    sqlx::raw_sql("CREATE TABLE later_table (n int)")
        .execute(&db.owner)
        .await
        .unwrap();
    for pool in [&db.pool, &db.keys] {
        refused(
            pool,
            "a Ductor role",
            &[
                "SELECT * FROM later_table",
                "INSERT INTO later_table VALUES (1)",
            ],
        )
        .await;
    }
    db.drop_db().await;
}
