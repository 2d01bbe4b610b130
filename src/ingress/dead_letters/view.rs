//! What the operations answer: recorded letters, pages and counts of them,
//! and the outcomes of a replay or a discard, as the operator API, the CLI
//! and the console show them.
//!
//! In: rows of `dead_letters` ([`super::query::SUMMARY_COLUMNS`], and the
//! key, headers and value for one letter). Out: typed answers that
//! serialize as JSON and describe themselves as JSON Schemas. Guarantees:
//! a letter's status is derived from its columns in one place
//! ([`LetterStatus::of`]); bytes are shown as text when they are UTF-8,
//! else base64 ([`Bytes`]), so nothing is lost on the way to JSON.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::Serialize;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::query::LetterStatus;
use super::record::{Bytes, Header, headers_of};
use crate::contract::formats::Timestamp;

/// One recorded dead letter, without its key, headers and value.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(rename = "DeadLetterSummary")]
pub struct LetterSummary {
    /// The letter's id: keyset pages go by it.
    pub id: i64,
    /// Where the input was read.
    pub source_topic: String,
    pub source_partition: i32,
    pub source_offset: i64,
    /// The stage that refused it: `decode`, `validate`, `route`, `apply`.
    pub stage: String,
    /// The stable error class (README, "Dead letters").
    pub class: String,
    /// The bounded error message.
    pub error: String,
    /// The input's `type`, when its value names one.
    pub input_type: Option<String>,
    /// The input's tenant, when its value names one: the tenant whose
    /// scope sees the letter.
    pub tenant: Option<String>,
    /// The run the input names, when it names one.
    pub run_id: Option<String>,
    #[schemars(with = "Timestamp")]
    pub dead_lettered_at: DateTime<Utc>,
    pub status: LetterStatus,
    /// The input's value length in bytes (0 without a value).
    pub value_bytes: i64,
    /// The recorded value is only the first `dead_letters.max_value_bytes`
    /// of it: such a letter cannot be replayed.
    pub value_cut: bool,
    /// The input's key was over `dead_letters.max_value_bytes` and is not
    /// recorded: such a letter cannot be replayed.
    pub key_dropped: bool,
    /// The input's headers were over `dead_letters.max_value_bytes` and are
    /// not recorded: such a letter cannot be replayed.
    pub headers_dropped: bool,
    /// Its replay, once one claimed it.
    pub replay: Option<ReplayState>,
    /// Its discard, once discarded.
    pub discard: Option<DiscardState>,
}

/// A letter's replay, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct ReplayState {
    /// The `ductor-replay-id` its record carries.
    #[schemars(with = "uuid::Uuid")]
    pub replay_id: String,
    #[schemars(with = "Timestamp")]
    pub claimed_at: DateTime<Utc>,
    /// `null` while the replay has not recorded where its record landed.
    #[schemars(with = "Option<Timestamp>")]
    pub replayed_at: Option<DateTime<Utc>>,
    /// Where the record landed on the source topic.
    pub partition: Option<i32>,
    pub offset: Option<i64>,
    /// Whether Ductor signed the record with the tenant's key.
    pub signed: Option<bool>,
}

/// A letter's discard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct DiscardState {
    #[schemars(with = "Timestamp")]
    pub discarded_at: DateTime<Utc>,
    pub reason: String,
}

/// One recorded dead letter, whole.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(rename = "DeadLetter")]
pub struct Letter {
    #[serde(flatten)]
    pub summary: LetterSummary,
    /// The input's key; `null` without one (or when dropped).
    pub key: Option<Bytes>,
    /// The input's headers, in order, without its signature.
    pub headers: Vec<Header>,
    /// The input's value, whole unless `value_cut`; `null` without one.
    pub value: Option<Bytes>,
}

/// One page of a listing, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(rename = "DeadLetterPage")]
pub struct LetterPage {
    pub letters: Vec<LetterSummary>,
    /// The cursor of the next page; `null` on the last.
    pub next: Option<i64>,
}

/// How many letters of a stage and class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
#[schemars(rename = "DeadLetterClassCount")]
pub struct ClassCount {
    pub stage: String,
    pub class: String,
    pub letters: i64,
}

/// The summary of a row read with [`super::query::SUMMARY_COLUMNS`].
pub fn summary(row: &PgRow) -> Result<LetterSummary, sqlx::Error> {
    let no_value: bool = row.try_get("no_value")?;
    let value_kept: i32 = row.try_get("value_kept")?;
    let value_bytes: i32 = row.try_get("value_bytes")?;
    let replay_id: Option<uuid::Uuid> = row.try_get("replay_id")?;
    let replayed_at: Option<DateTime<Utc>> = row.try_get("replayed_at")?;
    let discarded_at: Option<DateTime<Utc>> = row.try_get("discarded_at")?;
    let replay = match (replay_id, row.try_get("replay_claimed_at")?) {
        (Some(id), Some(claimed_at)) => Some(ReplayState {
            replay_id: id.to_string(),
            claimed_at,
            replayed_at,
            partition: row.try_get("replayed_partition")?,
            offset: row.try_get("replayed_offset")?,
            signed: row.try_get("replay_signed")?,
        }),
        _ => None,
    };
    let discard = match discarded_at {
        Some(discarded_at) => Some(DiscardState {
            discarded_at,
            reason: row.try_get("discard_reason")?,
        }),
        None => None,
    };
    Ok(LetterSummary {
        id: row.try_get("id")?,
        source_topic: row.try_get("source_topic")?,
        source_partition: row.try_get("source_partition")?,
        source_offset: row.try_get("source_offset")?,
        stage: row.try_get("stage")?,
        class: row.try_get("class")?,
        error: row.try_get("error")?,
        input_type: row.try_get("input_type")?,
        tenant: row.try_get("tenant_scope")?,
        run_id: row.try_get("run_id")?,
        dead_lettered_at: row.try_get("dead_lettered_at")?,
        status: LetterStatus::of(
            replay_id.is_some(),
            replayed_at.is_some(),
            discarded_at.is_some(),
        ),
        value_bytes: i64::from(value_bytes),
        value_cut: !no_value && value_kept < value_bytes,
        key_dropped: row.try_get("key_dropped")?,
        headers_dropped: row.try_get("headers_dropped")?,
        replay,
        discard,
    })
}

/// The whole letter of a row read with [`super::query::SUMMARY_COLUMNS`],
/// `record_key`, `headers` and `value`.
pub fn letter(row: &PgRow) -> Result<Letter, sqlx::Error> {
    let key: Option<Vec<u8>> = row.try_get("record_key")?;
    let value: Option<Vec<u8>> = row.try_get("value")?;
    let headers: serde_json::Value = row.try_get("headers")?;
    Ok(Letter {
        summary: summary(row)?,
        key: key.as_deref().map(Bytes::of),
        headers: headers_of(&headers),
        value: value.as_deref().map(Bytes::of),
    })
}
