//! The `[log]` section: how `serve` and the commands write their logs.
//!
//! In: a format and a `tracing` filter. Out: a [`LogConfig`] the
//! subscriber is set up from. Guarantees: nothing here is checked beyond
//! what deserializing gives (a format is one of two); a filter that does
//! not parse is not refused, the subscriber falls back to `info`.

use serde::{Deserialize, Serialize};

/// See [`LogConfig::format`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// `text` (readable) or `json` (one object per line).
    pub format: LogFormat,
    /// A `tracing` filter, e.g. `info` or `ductor=debug,rdkafka=warn`.
    /// `RUST_LOG` overrides it when set.
    pub filter: String,
}
