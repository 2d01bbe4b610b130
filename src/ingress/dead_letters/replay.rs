//! A replay: a recorded letter produced again to the topic it was read
//! from, once.
//!
//! In: a recorded letter (its raw key, headers and value), its replay id,
//! the input topics and the signatures' configuration. Out: the record to
//! produce ([`Outgoing`]), or why the letter cannot be replayed
//! ([`NotReplayable`]); and the outcome types the operation answers with.
//! Guarantees: pure; a replay sends the original key, value and headers
//! byte for byte, only to an input topic, and only when the row holds them
//! whole; it drops what would make the copy another input (an old replay
//! id, the forwarding count that would dead-letter it again as
//! `misrouted`), adds the replay id, and signs the value with the tenant's
//! key when the tenant has one.
//!
//! Why Ductor signs: a dead letter never keeps its input's signature, so
//! that whoever reads the dead-letter topic (or this table) holds no signed
//! input to replay. An operator's replay goes through Ductor, which holds
//! the tenants' keys (`signatures.tenant_keys`) and signs what it produces
//! for a tenant, as the API does for signals and cancels; so a replay of a
//! signed tenant's input passes the ingress's check again, with a fresh
//! time. It vouches for the letter's value as the tenant's: the tenant is
//! the one the value names, and a tenant's scope replays only its own
//! letters. Timers are never signed: `signatures.timer_key` stands for
//! "serve decided this timer", which no replay can say.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::Serialize;

use super::record::{Header, headers_of};
use crate::config::SignaturesConfig;
use crate::contract::formats::Timestamp;
use crate::contract::headers::{FORWARDED_FROM, FORWARDS, REPLAY_ID};
use crate::contract::signature::{SIGNATURE, sign};

/// A letter as a replay reads it: the raw parts of its input.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub id: i64,
    pub source_topic: String,
    pub key: Option<Vec<u8>>,
    pub key_dropped: bool,
    pub headers: serde_json::Value,
    pub headers_dropped: bool,
    pub value: Option<Vec<u8>>,
    pub value_bytes: i32,
    pub input_type: Option<String>,
    pub tenant: Option<String>,
}

/// The record a replay produces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    /// In order: the input's own, then the signature, then the replay id.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    pub signed: bool,
}

/// Why a letter cannot be replayed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReplayable {
    #[error(
        "its value was {value_bytes} bytes and only {kept} are recorded (dead_letters.max_value_bytes)"
    )]
    ValueCut { value_bytes: i32, kept: usize },
    #[error("its key was over dead_letters.max_value_bytes and is not recorded")]
    KeyDropped,
    #[error("its headers were over dead_letters.max_value_bytes and are not recorded")]
    HeadersDropped,
    #[error("a header does not decode from its record")]
    HeaderUnreadable,
    #[error("it was read from {0}, which is not one of this deployment's input topics")]
    NotAnInputTopic(String),
}

/// The record replaying `letter` as `replay_id` produces, signed at
/// `now_ms`; refused unless the letter came from one of `inputs` and its
/// row holds its key, headers and value whole.
pub fn outgoing(
    letter: &Stored,
    replay_id: uuid::Uuid,
    inputs: &[String],
    signatures: &SignaturesConfig,
    now_ms: i64,
) -> Result<Outgoing, NotReplayable> {
    if !inputs.contains(&letter.source_topic) {
        return Err(NotReplayable::NotAnInputTopic(letter.source_topic.clone()));
    }
    let kept = letter.value.as_ref().map_or(0, Vec::len);
    if letter.value.is_some() && kept < letter.value_bytes as usize {
        return Err(NotReplayable::ValueCut {
            value_bytes: letter.value_bytes,
            kept,
        });
    }
    if letter.key_dropped {
        return Err(NotReplayable::KeyDropped);
    }
    if letter.headers_dropped {
        return Err(NotReplayable::HeadersDropped);
    }
    let mut headers = Vec::new();
    for Header { key, value } in headers_of(&letter.headers) {
        if [SIGNATURE, REPLAY_ID, FORWARDS, FORWARDED_FROM].contains(&key.as_str()) {
            continue;
        }
        let value = match value {
            Some(bytes) => Some(bytes.to_vec().ok_or(NotReplayable::HeaderUnreadable)?),
            None => None,
        };
        headers.push((key, value));
    }
    let signature = signature(letter, signatures, now_ms);
    let signed = signature.is_some();
    if let Some(signature) = signature {
        headers.push((SIGNATURE.to_owned(), Some(signature.into_bytes())));
    }
    headers.push((
        REPLAY_ID.to_owned(),
        Some(replay_id.to_string().into_bytes()),
    ));
    Ok(Outgoing {
        topic: letter.source_topic.clone(),
        key: letter.key.clone(),
        value: letter.value.clone(),
        headers,
        signed,
    })
}

/// The signature a replay of `letter` carries: its tenant's, when the
/// tenant has a key and the letter is no timer.
fn signature(letter: &Stored, signatures: &SignaturesConfig, now_ms: i64) -> Option<String> {
    if letter.input_type.as_deref() == Some("wakeup.timer") {
        return None;
    }
    let key = signatures.key(letter.tenant.as_deref()?)?;
    Some(sign(
        key,
        letter.value.as_deref().unwrap_or_default(),
        now_ms,
    ))
}

/// What a replay found of the letter, and so what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Produce the record as replay `0`: the letter is claimed by it and
    /// not yet recorded as replayed (this replay's claim, or one cut
    /// short, which this one finishes with the same id).
    Produce(uuid::Uuid),
    /// Replayed already: answer with that replay's outcome.
    Answer,
    /// Discarded: never replayed.
    Discarded,
    /// Neither claimed nor discarded after the claim: nothing this
    /// replay may act on (the claim is read back after it is written, so
    /// only a row changed behind it gets here).
    Unclaimed,
}

/// What to do with a letter, read after a claim: claimed by `replay_id`
/// (if any), recorded as replayed or not, discarded or not.
pub fn next(replay_id: Option<uuid::Uuid>, replayed: bool, discarded: bool) -> Next {
    match (discarded, replay_id, replayed) {
        (true, _, _) => Next::Discarded,
        // Canary: a replay that ignores that its replay id was recorded
        // produces the letter again. Only for proving the chaos checker
        // notices.
        (false, Some(id), true) if cfg!(feature = "canary-replay-ignores-id") => Next::Produce(id),
        (false, Some(_), true) => Next::Answer,
        (false, Some(id), false) => Next::Produce(id),
        (false, None, _) => Next::Unclaimed,
    }
}

/// Whether this call produced the record, or an earlier replay had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReplayStatus {
    /// This call produced the record.
    Replayed,
    /// An earlier replay had produced it: this is its outcome, and
    /// nothing was produced now.
    AlreadyReplayed,
}

/// The run a replayed input names, as it stands now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct RunReached {
    pub run_id: String,
    /// Whether the run exists now (for the letter's tenant). A start
    /// applies a moment after its replay, so right after a replay this
    /// may still be `false`; the outcome read again says.
    pub exists: bool,
}

/// The outcome of a letter's replay: the first one's, however often it is
/// asked for.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(rename = "DeadLetterReplay")]
pub struct ReplayOutcome {
    pub id: i64,
    pub status: ReplayStatus,
    /// The `ductor-replay-id` the record carries.
    #[schemars(with = "uuid::Uuid")]
    pub replay_id: String,
    /// Where the record landed: the letter's source topic.
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    #[schemars(with = "Timestamp")]
    pub replayed_at: DateTime<Utc>,
    /// Whether Ductor signed it with the tenant's key.
    pub signed: bool,
    /// The run the input names (`run_id`); `null` for an input that names
    /// none (a start the routing plane decides: its run is in the
    /// `run.accepted` event).
    pub run: Option<RunReached>,
}

/// A letter a replay of a set did not replay, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct ReplayRefusal {
    pub id: i64,
    pub reason: String,
}

/// A replay of a filtered set, oldest letter first.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(rename = "DeadLetterReplayBatch")]
pub struct ReplayBatch {
    pub replayed: Vec<ReplayOutcome>,
    pub refused: Vec<ReplayRefusal>,
    /// The cursor of the next set; `null` when this one was the last.
    pub next: Option<i64>,
}

/// Whether this call discarded the letter, or an earlier one had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DiscardStatus {
    Discarded,
    /// An earlier discard had: its time and reason stand.
    AlreadyDiscarded,
}

/// The outcome of a discard: the first one's, however often it is asked
/// for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
#[schemars(rename = "DeadLetterDiscard")]
pub struct DiscardOutcome {
    pub id: i64,
    pub status: DiscardStatus,
    #[schemars(with = "Timestamp")]
    pub discarded_at: DateTime<Utc>,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SigningKey;
    use crate::ingress::dead_letters::record::{LetterRow, Refused};

    const VALUE: &[u8] = br#"{"type":"run.start","schema_version":1,"run_id":"r-1","tenant":"acme","workflow":"example"}"#;

    fn stored(headers: &[(&str, Option<&[u8]>)]) -> Stored {
        let row = LetterRow::of(
            Refused {
                topic: "p.requests",
                partition: 0,
                offset: 7,
                key: Some(b"r-1"),
                headers,
                value: Some(VALUE),
            },
            "decode",
            "unauthenticated",
            "not signed",
            1 << 20,
        );
        Stored {
            id: 1,
            source_topic: row.source_topic,
            key: row.key,
            key_dropped: row.key_dropped,
            headers: row.headers,
            headers_dropped: row.headers_dropped,
            value: row.value,
            value_bytes: row.value_bytes,
            input_type: row.read.input_type,
            tenant: row.read.tenant,
        }
    }

    fn keys(acme: bool) -> SignaturesConfig {
        SignaturesConfig {
            tenant_keys: if acme {
                [("acme".to_string(), SigningKey("acme-key-0123456789".into()))].into()
            } else {
                Default::default()
            },
            ..SignaturesConfig::default()
        }
    }

    fn inputs() -> Vec<String> {
        vec!["p.requests".to_string(), "p.wakeups".to_string()]
    }

    #[test]
    fn a_replay_sends_the_original_bytes_with_its_id_and_the_tenants_signature() {
        let id = uuid::Uuid::new_v4();
        let letter = stored(&[
            ("trace", Some(b"t-1")),
            (FORWARDS, Some(b"2")),
            (REPLAY_ID, Some(b"old")),
        ]);
        let out = outgoing(&letter, id, &inputs(), &keys(true), 1_000).unwrap();
        assert_eq!(out.topic, "p.requests");
        assert_eq!(out.key.as_deref(), Some(&b"r-1"[..]));
        assert_eq!(out.value.as_deref(), Some(VALUE));
        let names: Vec<&str> = out.headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["trace", SIGNATURE, REPLAY_ID]);
        let signature = out.headers[1].1.clone().unwrap();
        assert!(
            crate::contract::signature::verify(
                b"acme-key-0123456789",
                VALUE,
                &signature,
                1_000,
                300_000
            )
            .is_ok()
        );
        assert_eq!(out.headers[2].1.as_deref(), Some(id.to_string().as_bytes()));
        assert!(out.signed);
        let unsigned = outgoing(&letter, id, &inputs(), &keys(false), 1_000).unwrap();
        assert!(!unsigned.signed);
        assert!(unsigned.headers.iter().all(|(k, _)| k != SIGNATURE));
    }

    #[test]
    fn a_timer_is_never_signed_and_only_whole_letters_of_input_topics_replay() {
        let id = uuid::Uuid::new_v4();
        let mut timer = stored(&[]);
        timer.input_type = Some("wakeup.timer".into());
        assert!(
            !outgoing(&timer, id, &inputs(), &keys(true), 0)
                .unwrap()
                .signed
        );
        let mut elsewhere = stored(&[]);
        elsewhere.source_topic = "p.events".into();
        assert_eq!(
            outgoing(&elsewhere, id, &inputs(), &keys(true), 0),
            Err(NotReplayable::NotAnInputTopic("p.events".into()))
        );
        let mut cut = stored(&[]);
        cut.value_bytes += 1;
        assert!(matches!(
            outgoing(&cut, id, &inputs(), &keys(true), 0),
            Err(NotReplayable::ValueCut { .. })
        ));
        let mut dropped = stored(&[]);
        dropped.headers_dropped = true;
        assert_eq!(
            outgoing(&dropped, id, &inputs(), &keys(true), 0),
            Err(NotReplayable::HeadersDropped)
        );
    }

    #[test]
    fn a_replay_produces_once_answers_after_and_never_for_a_discarded_letter() {
        let id = uuid::Uuid::new_v4();
        assert_eq!(next(Some(id), false, false), Next::Produce(id));
        assert_eq!(next(Some(id), true, false), Next::Answer);
        assert_eq!(next(None, false, true), Next::Discarded);
        assert_eq!(next(Some(id), false, true), Next::Discarded);
        assert_eq!(next(None, false, false), Next::Unclaimed);
    }
}
