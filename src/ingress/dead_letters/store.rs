//! The statements on `dead_letters`: record, read, claim, mark, purge.
//!
//! In: rows to record, ids, the caller's tenant scope. Out: what Postgres
//! answered. Guarantees: bound parameters only; a batch of letters is one
//! set-based insert that adds no row for a letter already recorded (the
//! same input at the same stage); a claim, a replay's record and a discard
//! each change a row only from the state it expects, so two callers racing
//! on one letter leave the first one's outcome; every read and change of
//! an operator is narrowed to the scope's tenant.

use sqlx::PgPool;
use sqlx::postgres::PgRow;

use super::record::LetterRow;
use super::replay::Stored;

/// One statement for a batch's letters, one row per letter: `UNNEST` of a
/// column each. A letter already recorded (a redelivery failing again)
/// conflicts on `dead_letters_once` and adds nothing.
const INSERT_SQL: &str = "\
    INSERT INTO dead_letters (source_topic, source_partition, source_offset, stage, class, \
        error, record_key, key_dropped, headers, headers_dropped, value, value_bytes, \
        input_type, tenant_scope, run_id) \
    SELECT * FROM UNNEST($1::text[], $2::int4[], $3::int8[], $4::text[], $5::text[], \
        $6::text[], $7::bytea[], $8::bool[], $9::jsonb[], $10::bool[], $11::bytea[], \
        $12::int4[], $13::text[], $14::text[], $15::text[]) \
    ON CONFLICT ON CONSTRAINT dead_letters_once DO NOTHING";

/// Records `rows`; returns how many were new.
pub async fn insert(pool: &PgPool, rows: &[LetterRow]) -> Result<u64, sqlx::Error> {
    fn col<T, F: Fn(&LetterRow) -> T>(rows: &[LetterRow], f: F) -> Vec<T> {
        rows.iter().map(f).collect()
    }
    let inserted = sqlx::query(INSERT_SQL)
        .bind(col(rows, |r| r.source_topic.clone()))
        .bind(col(rows, |r| r.source_partition))
        .bind(col(rows, |r| r.source_offset))
        .bind(col(rows, |r| r.stage.to_owned()))
        .bind(col(rows, |r| r.class.clone()))
        .bind(col(rows, |r| r.error.clone()))
        .bind(col(rows, |r| r.key.clone()))
        .bind(col(rows, |r| r.key_dropped))
        .bind(col(rows, |r| r.headers.clone()))
        .bind(col(rows, |r| r.headers_dropped))
        .bind(col(rows, |r| r.value.clone()))
        .bind(col(rows, |r| r.value_bytes))
        .bind(col(rows, |r| r.read.input_type.clone()))
        .bind(col(rows, |r| r.read.tenant.clone()))
        .bind(col(rows, |r| r.read.run_id.clone()))
        .execute(pool)
        .await?
        .rows_affected();
    Ok(inserted)
}

/// The scope's condition on `tenant_scope`, its tenant bound as `$2`.
const SCOPE: &str = "($2::text IS NULL OR tenant_scope = $2)";

/// One letter, whole, of the scope.
pub async fn letter(
    pool: &PgPool,
    tenant: Option<&str>,
    id: i64,
) -> Result<Option<PgRow>, sqlx::Error> {
    let sql = format!(
        "SELECT {}, record_key, headers, value FROM dead_letters WHERE id = $1 AND {SCOPE}",
        super::query::SUMMARY_COLUMNS
    );
    sqlx::query(&sql)
        .bind(id)
        .bind(tenant)
        .fetch_optional(pool)
        .await
}

/// Claims letter `id` for replay `replay_id` if it is unclaimed and not
/// discarded; a letter claimed already keeps its claim.
pub async fn claim(
    pool: &PgPool,
    tenant: Option<&str>,
    id: i64,
    replay_id: uuid::Uuid,
) -> Result<(), sqlx::Error> {
    let sql = format!(
        "UPDATE dead_letters SET replay_id = $3, replay_claimed_at = now() \
         WHERE id = $1 AND {SCOPE} AND replay_id IS NULL AND discarded_at IS NULL"
    );
    sqlx::query(&sql)
        .bind(id)
        .bind(tenant)
        .bind(replay_id)
        .execute(pool)
        .await?;
    Ok(())
}

/// What a replay reads of a letter: its raw parts.
pub fn stored(row: &PgRow) -> Result<Stored, sqlx::Error> {
    use sqlx::Row;
    Ok(Stored {
        id: row.try_get("id")?,
        source_topic: row.try_get("source_topic")?,
        key: row.try_get("record_key")?,
        key_dropped: row.try_get("key_dropped")?,
        headers: row.try_get("headers")?,
        headers_dropped: row.try_get("headers_dropped")?,
        value: row.try_get("value")?,
        value_bytes: row.try_get("value_bytes")?,
        input_type: row.try_get("input_type")?,
        tenant: row.try_get("tenant_scope")?,
    })
}

/// Where replay `replay_id` of letter `id` landed; false when the letter
/// was recorded as replayed already (by another caller of the same
/// replay).
pub async fn replayed(
    pool: &PgPool,
    id: i64,
    replay_id: uuid::Uuid,
    at: (i32, i64),
    signed: bool,
) -> Result<bool, sqlx::Error> {
    let recorded = sqlx::query(
        "UPDATE dead_letters SET replayed_at = now(), replayed_partition = $3, \
             replayed_offset = $4, replay_signed = $5 \
         WHERE id = $1 AND replay_id = $2 AND replayed_at IS NULL",
    )
    .bind(id)
    .bind(replay_id)
    .bind(at.0)
    .bind(at.1)
    .bind(signed)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(recorded == 1)
}

/// Discards letter `id` with `reason` if it is neither claimed for a
/// replay nor discarded already; true when this call discarded it.
pub async fn discard(
    pool: &PgPool,
    tenant: Option<&str>,
    id: i64,
    reason: &str,
) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "UPDATE dead_letters SET discarded_at = now(), discard_reason = $3 \
         WHERE id = $1 AND {SCOPE} AND replay_id IS NULL AND discarded_at IS NULL"
    );
    let discarded = sqlx::query(&sql)
        .bind(id)
        .bind(tenant)
        .bind(reason)
        .execute(pool)
        .await?
        .rows_affected();
    Ok(discarded == 1)
}

/// Whether run `run_id` exists now, for `tenant` when the letter named one.
pub async fn run_exists(
    pool: &PgPool,
    run_id: &str,
    tenant: Option<&str>,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM runs WHERE run_id = $1 \
             AND ($2::text IS NULL OR tenant_scope = $2))",
    )
    .bind(run_id)
    .bind(tenant)
    .fetch_one(pool)
    .await
}

/// Deletes up to `$2` letters recorded more than `$1` seconds ago,
/// through `ductor_purge_dead_letters` (migration
/// `20261205000020_dead_letters`), a function of the migrator: serve's
/// role may delete no letter itself. One row per letter deleted.
pub const PURGE_SQL: &str = "SELECT id FROM ductor_purge_dead_letters($1, $2) AS purged(id)";
