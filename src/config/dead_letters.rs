//! The `[dead_letters]` section: how a dead letter is kept, in Postgres
//! and on the dead-letter topic, and for how long.
//!
//! In: the bound on the value a recorded letter keeps, the dead-letter
//! producer's compression, the retention of recorded letters and the pace
//! of their purge, and the most letters one listing or replay takes. Out:
//! a [`DeadLettersConfig`] the ingress's dead-letter writer, the operations
//! on recorded letters and their retention are built from (the section may
//! be left out). Guarantees: the codec is one the bundled librdkafka was
//! built with; the value bound is at least `kafka.message_max_bytes` (checked
//! in `config/mod.rs`, as it spans two sections) and at most 256 MiB; no
//! interval, batch or page is 0.

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

/// The compression codecs of the dead-letter producer: those of the
/// librdkafka that `rdkafka-sys` builds here (gzip through its `libz`
/// feature; lz4 and snappy are built in). zstd needs its `zstd` feature,
/// which Ductor does not build, and is refused rather than failing when
/// the producer is made.
pub const DEAD_LETTER_CODECS: [&str; 4] = ["none", "gzip", "snappy", "lz4"];

/// The largest `dead_letters.max_value_bytes`: a row stays far below
/// Postgres' 1 GB per value, and a replay's record below librdkafka's
/// `message.max.bytes` ceiling.
pub const MAX_DEAD_LETTER_VALUE_BYTES: u64 = 256 << 20;

/// Dead letters: every input the ingress refuses is recorded in Postgres
/// (`dead_letters`, with its whole value up to `max_value_bytes`) and
/// published, compressed with `compression`, to the dead-letter topic.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeadLettersConfig {
    /// The most bytes of an input's value its recorded letter keeps, and
    /// so the largest input a replay sends whole; a longer one keeps its
    /// first bytes and says how long it was. Also bounds the key and the
    /// headers a row keeps. Well above `kafka.message_max_bytes`: an input
    /// may have reached the broker compressed.
    pub max_value_bytes: u64,
    /// `compression.type` of the dead-letter producer: `lz4`, `gzip`,
    /// `snappy` or `none`. A letter as large as an input that reached the
    /// broker compressed fits the topic again only compressed.
    pub compression: String,
    /// How long a recorded letter is kept, whatever became of it
    /// (pending, replayed or discarded); 0 keeps every letter.
    pub retention_ms: u64,
    /// How often retention deletes old letters.
    pub purge_interval_ms: u64,
    /// Letters deleted per statement.
    pub purge_batch: usize,
    /// Statements per retention run.
    pub purge_max_rounds: u32,
    /// The most letters one listing returns, or one replay of a filtered
    /// set replays.
    pub max_page_rows: usize,
}

impl Default for DeadLettersConfig {
    fn default() -> Self {
        DeadLettersConfig {
            max_value_bytes: 16 << 20,
            compression: "lz4".into(),
            retention_ms: 30 * 86_400_000,
            purge_interval_ms: 60_000,
            purge_batch: 500,
            purge_max_rounds: 10,
            max_page_rows: 500,
        }
    }
}

impl DeadLettersConfig {
    /// A codec librdkafka has here, a bounded value, and no pace of 0.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !DEAD_LETTER_CODECS.contains(&self.compression.as_str()) {
            return Err(invalid(
                "dead_letters.compression",
                format!(
                    "{:?} is not one of {DEAD_LETTER_CODECS:?}, the codecs the bundled librdkafka \
                     is built with",
                    self.compression
                ),
            ));
        }
        if self.max_value_bytes > MAX_DEAD_LETTER_VALUE_BYTES {
            return Err(invalid(
                "dead_letters.max_value_bytes",
                format!("must be at most {MAX_DEAD_LETTER_VALUE_BYTES} (256 MiB)"),
            ));
        }
        for (key, value) in [
            ("dead_letters.purge_interval_ms", self.purge_interval_ms),
            ("dead_letters.purge_batch", self.purge_batch as u64),
            (
                "dead_letters.purge_max_rounds",
                u64::from(self.purge_max_rounds),
            ),
            ("dead_letters.max_page_rows", self.max_page_rows as u64),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_pass_and_zstd_is_refused_with_the_codecs_there_are() {
        assert!(DeadLettersConfig::default().validate().is_ok());
        let zstd = DeadLettersConfig {
            compression: "zstd".into(),
            ..DeadLettersConfig::default()
        };
        let err = zstd.validate().unwrap_err().to_string();
        assert!(
            err.contains("dead_letters.compression") && err.contains("lz4"),
            "{err}"
        );
        let huge = DeadLettersConfig {
            max_value_bytes: MAX_DEAD_LETTER_VALUE_BYTES + 1,
            ..DeadLettersConfig::default()
        };
        assert!(huge.validate().is_err());
    }
}
