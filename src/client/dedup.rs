//! Consumer-side idempotency for the effects Ductor publishes.
//!
//! Ductor delivers effects at least once; every one carries a deterministic
//! `idempotency-key` header, the same on every redelivery. A downstream
//! consumer makes the effect *effectively once* by claiming the key in the
//! same Postgres transaction that applies the effect: the claim and the
//! effect commit together or not at all. The table lives in the consumer's
//! own database (create it with [`ensure_schema`] or run [`SCHEMA_SQL`] from
//! your migrations), keyed by a consumer name so that several consumers can
//! share one database and each see every key once.
//!
//! ```no_run
//! use ductor::client::dedup::{self, Claim};
//! use rdkafka::message::OwnedMessage;
//! use sqlx::PgPool;
//!
//! async fn on_message(pool: &PgPool, msg: &OwnedMessage) -> anyhow::Result<()> {
//!     let mut tx = pool.begin().await?;
//!     match dedup::claim_message(&mut tx, "billing", msg).await? {
//!         Claim::First => {
//!             // Apply the effect inside the same transaction.
//!             sqlx::query("INSERT INTO invoices (run_id, amount) VALUES ($1, $2)")
//!                 .bind("run-1")
//!                 .bind(42_i64)
//!                 .execute(&mut *tx)
//!                 .await?;
//!         }
//!         // Seen before: the effect is already committed, so there is
//!         // nothing to apply; committing writes nothing new.
//!         Claim::Duplicate => {}
//!     }
//!     tx.commit().await?;
//!     // Only now store the message's Kafka offset.
//!     Ok(())
//! }
//!
//! # async fn setup(pool: &PgPool) -> anyhow::Result<()> {
//! dedup::ensure_schema(pool).await?; // once, at start-up
//! // Periodically: forget keys older than any possible redelivery.
//! dedup::purge(pool, std::time::Duration::from_secs(7 * 24 * 3600), 10_000).await?;
//! # Ok(())
//! # }
//! ```
//!
//! If the transaction rolls back, so does the claim, and the redelivered
//! message is [`Claim::First`] again. Two transactions claiming the same key
//! at once serialise on the primary key: the second waits for the first and
//! then sees [`Claim::Duplicate`] if it committed, [`Claim::First`] if it
//! rolled back.
//!
//! In: the caller's transaction, a consumer name and a message (or its
//! key). Out: [`Claim::First`] or [`Claim::Duplicate`], and a row of
//! `ductor_dedup_seen` that commits or rolls back with the effect.
//! Guarantees: one [`Claim::First`] per consumer and key among committed
//! transactions, until [`purge`] forgets the key; a key that is missing,
//! empty, not UTF-8 or over [`MAX_KEY_BYTES`] is refused before the
//! database is asked.

use std::time::Duration;

use rdkafka::message::{Headers, Message};
use sqlx::{PgPool, Postgres, Transaction};

use crate::contract::headers::IDEMPOTENCY_KEY;

/// Longest consumer name and idempotency key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// The table, idempotent: safe to run at every start.
pub const SCHEMA_SQL: &str = "\
CREATE TABLE IF NOT EXISTS ductor_dedup_seen (
    consumer text NOT NULL,
    idempotency_key text NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, idempotency_key)
);
CREATE INDEX IF NOT EXISTS ductor_dedup_seen_seen_at ON ductor_dedup_seen (seen_at);
";

/// Serialises concurrent `ensure_schema` calls: two concurrent
/// `CREATE TABLE IF NOT EXISTS` can still collide in the catalog.
const SCHEMA_LOCK_KEY: i64 = 0x6475_6374_6f72_6464; // "ductordd"

/// Whether this transaction is the first to see the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Apply the effect in this transaction.
    First,
    /// Already applied by a committed transaction: apply nothing.
    Duplicate,
}

/// Why [`claim_message`] could not claim.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("message has no {IDEMPOTENCY_KEY} header")]
    MissingKey,
    #[error("{IDEMPOTENCY_KEY} header is not 1 to {MAX_KEY_BYTES} bytes of UTF-8")]
    InvalidKey,
    #[error("claiming idempotency key: {0}")]
    Database(#[from] sqlx::Error),
}

/// Creates the table and its index if they do not exist.
pub async fn ensure_schema(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(SCHEMA_LOCK_KEY)
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(SCHEMA_SQL).execute(&mut *tx).await?;
    tx.commit().await
}

/// Claims `key` for `consumer` inside the caller's transaction.
pub async fn claim(
    tx: &mut Transaction<'_, Postgres>,
    consumer: &str,
    key: &str,
) -> Result<Claim, sqlx::Error> {
    for (what, value) in [("consumer", consumer), ("idempotency key", key)] {
        if value.is_empty() || value.len() > MAX_KEY_BYTES {
            return Err(sqlx::Error::InvalidArgument(format!(
                "{what} must be 1 to {MAX_KEY_BYTES} bytes"
            )));
        }
    }
    let inserted = sqlx::query(
        "INSERT INTO ductor_dedup_seen (consumer, idempotency_key) VALUES ($1, $2) \
         ON CONFLICT (consumer, idempotency_key) DO NOTHING",
    )
    .bind(consumer)
    .bind(key)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    Ok(if inserted == 1 {
        Claim::First
    } else {
        Claim::Duplicate
    })
}

/// The message's `idempotency-key` header (the first, if repeated).
pub fn idempotency_key<M: Message>(msg: &M) -> Result<String, ClaimError> {
    let value = msg
        .headers()
        .and_then(|headers| headers.iter().find(|h| h.key == IDEMPOTENCY_KEY))
        .and_then(|h| h.value)
        .ok_or(ClaimError::MissingKey)?;
    match std::str::from_utf8(value) {
        Ok(key) if !key.is_empty() && key.len() <= MAX_KEY_BYTES => Ok(key.to_owned()),
        _ => Err(ClaimError::InvalidKey),
    }
}

/// [`claim`] with the key read from the message's `idempotency-key` header;
/// a message without one is an error. The header is read before the
/// returned future starts, so the future does not borrow the message.
pub fn claim_message<'a, 'c, M: Message>(
    tx: &'a mut Transaction<'c, Postgres>,
    consumer: &'a str,
    msg: &M,
) -> impl Future<Output = Result<Claim, ClaimError>> + Send + use<'a, 'c, M> {
    let key = idempotency_key(msg);
    async move {
        let key = key?;
        Ok(claim(tx, consumer, &key).await?)
    }
}

/// Deletes claims older than `older_than`, `batch_limit` rows per
/// statement (each its own short transaction), until none are left. Returns
/// how many were deleted. The retention must exceed the longest time a
/// message can be redelivered, or a late duplicate would be applied again.
pub async fn purge(
    pool: &PgPool,
    older_than: Duration,
    batch_limit: i64,
) -> Result<u64, sqlx::Error> {
    if batch_limit < 1 {
        return Err(sqlx::Error::InvalidArgument(
            "batch_limit must be at least 1".to_owned(),
        ));
    }
    let mut total = 0;
    loop {
        let deleted = sqlx::query(
            "WITH doomed AS ( \
                 SELECT consumer, idempotency_key FROM ductor_dedup_seen \
                 WHERE seen_at < now() - make_interval(secs => $1) \
                 ORDER BY seen_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
             DELETE FROM ductor_dedup_seen d USING doomed \
             WHERE d.consumer = doomed.consumer AND d.idempotency_key = doomed.idempotency_key",
        )
        .bind(older_than.as_secs_f64())
        .bind(batch_limit)
        .execute(pool)
        .await?
        .rows_affected();
        total += deleted;
        if deleted < batch_limit as u64 {
            return Ok(total);
        }
    }
}
