//! The statements on `dead_letters`: record, purge.
//!
//! In: rows to record. Out: what Postgres answered. Guarantees: bound
//! parameters only; a batch of letters is one set-based insert that adds
//! no row for a letter already recorded (the same input at the same
//! stage).

use sqlx::PgPool;

use super::record::LetterRow;

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

/// Deletes up to `$2` letters recorded more than `$1` seconds ago,
/// through `ductor_purge_dead_letters` (migration
/// `20261205000020_dead_letters`), a function of the migrator: serve's
/// role may delete no letter itself. One row per letter deleted.
pub const PURGE_SQL: &str = "SELECT id FROM ductor_purge_dead_letters($1, $2) AS purged(id)";
