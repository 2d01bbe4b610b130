//! The load driver's log: one JSON object per line.
//!
//! Each line is written with one `write` to a file opened for appending and
//! is therefore in the kernel's hands before the driver moves on; a crash of
//! the system under test cannot lose it. The file is fsync'd every second and
//! at the end, so even a machine crash loses at most the last second.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// What a line describes.
pub const EV_INPUT: &str = "input";
pub const EV_HTTP: &str = "http";
/// A serve reported stalled apply lanes (`ductor_ingress_stalled_lanes`
/// above zero); `server` names it, `note` says how many lanes.
pub const EV_STALL: &str = "stall";
/// One call of an operator's replay of dead letters over the admin API
/// (see [`super::replays`]); `kind` says which.
pub const EV_REPLAY: &str = "replay";

/// Input kinds (`Record::kind`).
pub const KIND_START: &str = "start";
pub const KIND_ROUTED: &str = "routed";
pub const KIND_SIGNAL: &str = "signal";
pub const KIND_CANCEL: &str = "cancel";
pub const KIND_RETRY: &str = "retry";
pub const KIND_RESULT: &str = "result";
pub const KIND_BAD: &str = "bad";
/// A replay of one letter (`POST /v1/dead-letters/{id}/replay`), or one
/// letter a replay of a set replayed (`note` = [`NOTE_IN_SET`]).
pub const KIND_REPLAY: &str = "replay";
/// A replay of the letters a filter finds (`POST /v1/dead-letters/replay`):
/// the call itself, its filter in `class` and `topic`.
pub const KIND_REPLAY_SET: &str = "replay_set";
/// The note of a letter a replay of a set replayed.
pub const NOTE_IN_SET: &str = "in_set";
/// The note of a letter's replay asked for again on purpose.
pub const NOTE_AGAIN: &str = "again";

/// One logged event. Fields that do not apply are absent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// [`EV_INPUT`] (a message produced to Kafka), [`EV_HTTP`] (one
    /// `POST /v1/runs` exchange), [`EV_STALL`] or [`EV_REPLAY`].
    pub ev: String,
    /// Wall clock, milliseconds since the Unix epoch, when the fate of the
    /// event was known (acknowledgement or answer).
    pub t_ms: i64,
    /// Input kind: `start` (client-chosen run id), `routed` (a start without
    /// run id, routed by the coordinator), `signal`, `cancel`, `retry`,
    /// `result`, `bad`; for an [`EV_REPLAY`], `replay` or `replay_set`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Intended good (must be applied or be a harmless duplicate, never
    /// dead-lettered) or bad (must be dead-lettered).
    #[serde(default)]
    pub good: bool,
    /// The broker acknowledged the message / the server answered 2xx.
    #[serde(default)]
    pub acked: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Routing pool of a start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// The `input_ref` the coordinator records when it applies the input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<i64>,
    /// Idempotency key of a routed start (Kafka field or HTTP header).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Correlation id of a start; unique per request, so `run.accepted`
    /// events and runs can be traced back to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub corr: Option<String>,
    /// For bad inputs: what is wrong with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bad: Option<String>,
    /// A retry: the failure it names (the seq of the run's `run.failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_seq: Option<i64>,
    /// Free-form qualifier: `dup`, `late`, `conflict`, `replay`, `burst`...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// HTTP: the server the request went to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// HTTP status; absent when no answer came back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// HTTP: the decision's run id and tenant as answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_tenant: Option<String>,
    /// A replay: the dead letter's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub letter: Option<i64>,
    /// A replay: the `ductor-replay-id` the answer named (its record is at
    /// `topic`, `partition`, `offset`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_id: Option<String>,
    /// A replay: what the answer said it did (`replayed`, `already_replayed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// A replay: the letter's class, or the one a set's filter names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// Why the event failed (bounded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Longest error text kept in a record.
const MAX_ERROR_LEN: usize = 200;

impl Record {
    pub fn with_error(mut self, error: impl std::fmt::Display) -> Self {
        let mut e = error.to_string();
        if let Some((i, _)) = e.char_indices().nth(MAX_ERROR_LEN) {
            e.truncate(i);
        }
        self.error = Some(e);
        self
    }
}

/// Appends records to the log; cheap to share behind an `Arc`.
pub struct LogWriter {
    file: Mutex<(File, Instant)>,
}

/// How often the log is fsync'd.
const SYNC_INTERVAL: Duration = Duration::from_secs(1);

impl LogWriter {
    pub fn create(path: &Path) -> anyhow::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening log {}", path.display()))?;
        Ok(Self {
            file: Mutex::new((file, Instant::now())),
        })
    }

    /// Writes one line. Errors are reported once and otherwise ignored: a
    /// load driver that cannot log is useless, but it must not panic inside
    /// a task.
    pub fn write(&self, record: &Record) {
        let mut line = match serde_json::to_vec(record) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "encoding a log record failed");
                return;
            }
        };
        line.push(b'\n');
        let Ok(mut guard) = self.file.lock() else {
            return;
        };
        let (file, last_sync) = &mut *guard;
        if let Err(e) = file.write_all(&line) {
            tracing::error!(error = %e, "writing the chaos log failed");
            return;
        }
        if last_sync.elapsed() >= SYNC_INTERVAL {
            let _ = file.sync_data();
            *last_sync = Instant::now();
        }
    }

    /// Flushes everything to disk.
    pub fn sync(&self) -> anyhow::Result<()> {
        let guard = self
            .file
            .lock()
            .map_err(|_| anyhow::anyhow!("log lock poisoned"))?;
        guard.0.sync_all().context("syncing the chaos log")
    }
}

/// Reads a log. A torn last line (the writer died mid-write) is skipped; any
/// other undecodable line is an error.
pub fn read(path: &Path) -> anyhow::Result<Vec<Record>> {
    let file = File::open(path).with_context(|| format!("opening log {}", path.display()))?;
    let lines: Vec<String> = BufReader::new(file)
        .lines()
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading log {}", path.display()))?;
    let mut out = Vec::with_capacity(lines.len());
    let last = lines.len().saturating_sub(1);
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Record>(line) {
            Ok(r) => out.push(r),
            Err(_) if i == last => break,
            Err(e) => anyhow::bail!("{}: line {}: {e}", path.display(), i + 1),
        }
    }
    Ok(out)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
