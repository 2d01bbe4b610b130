//! Ductor's configuration: one typed struct, layered
//! built-in defaults (`config/default.toml`) → an optional file → environment.
//!
//! In: the defaults compiled in, an optional TOML file and the process's
//! environment. Out: a [`Config`] that [`Config::validate`] accepted, or a
//! [`ConfigError`] that names the offending key. Guarantees: every struct
//! denies unknown fields, so a misspelt key is an error that names it;
//! values that parse but make no sense are refused before anything starts;
//! secrets (the database passwords, signing keys, Kafka SASL/TLS
//! credentials) are redacted in `Debug` output and therefore in logs.
//!
//! Environment variables are `DUCTOR__SECTION__KEY` (double underscores
//! separate the path). `DATABASE_URL` and `KAFKA_BOOTSTRAP_SERVERS` are also
//! honoured, because the local stack and docker-compose export those names,
//! and so are `DATABASE_MIGRATE_URL` (`database.migrate_url`, the migrator's)
//! and `DATABASE_KEYS_URL` (`database.keys_url`, the keys role's);
//! `DUCTOR__DATABASE__URL` and `DUCTOR__KAFKA__BOOTSTRAP_SERVERS` win over them.
//!
//! Each section is a file of its own with the checks of its own values
//! (`database`, `kafka`, `server`, `log`, `coordinator`, `drainer`,
//! `routing`, `runs`, `dead_letters`, `signatures`, `telemetry`); the types
//! that redact themselves are
//! in `secrets`. What relates two sections (an input against Kafka's
//! message bound, a claim's lease against a publish's timeout) is checked
//! here.

mod coordinator;
mod database;
mod dead_letters;
mod drainer;
mod kafka;
mod log;
mod routing;
mod runs;
mod secrets;
mod server;
mod signatures;
mod telemetry;

use std::path::{Path, PathBuf};

use crate::contract::names::TopicNames;
use crate::contract::{InputLimits, ShapeLimits};
use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

pub use coordinator::CoordinatorConfig;
pub use database::DatabaseConfig;
pub use dead_letters::{DEAD_LETTER_CODECS, DeadLettersConfig, MAX_DEAD_LETTER_VALUE_BYTES};
pub use drainer::DrainerConfig;
pub use kafka::{CONSUMER_GUARANTEES, KafkaConfig, PRODUCER_GUARANTEES};
pub use log::{LogConfig, LogFormat};
pub use routing::{DuplicatePolicy, PoolRouting, RoutingConfig};
pub use runs::RunsConfig;
pub use secrets::{DatabaseUrl, KafkaProperties, SigningKey};
pub use server::{AdminAuth, AuthMode, ServerConfig};
pub use signatures::{MIN_SIGNING_KEY_BYTES, SignaturesConfig};
pub use telemetry::TelemetryConfig;

/// Room an effect needs around the largest value it carries (a dispatch
/// carries a run's input or a step's output): its envelope fields, its
/// headers and the record's framing.
pub const EFFECT_ENVELOPE_BYTES: u64 = 16_384;

/// Room a run's state needs besides the largest values it holds (its input
/// and its newest output): ids, times, and the records of its attempts
/// and signals. `coordinator.max_state_bytes` must leave at least this.
pub const STATE_ENVELOPE_BYTES: u64 = 65_536;

/// librdkafka's ceiling on `message.max.bytes`.
pub const LIBRDKAFKA_MAX_MESSAGE_BYTES: u64 = 1_000_000_000;

/// The defaults, compiled in so the binary runs from any directory.
pub const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

/// Every error loading or validating the configuration. The message names the
/// offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration file {0} does not exist")]
    MissingFile(PathBuf),
    #[error("invalid configuration: {0}")]
    Parse(String),
    #[error("invalid configuration: {key}: {message}")]
    Invalid { key: &'static str, message: String },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub database: DatabaseConfig,
    pub kafka: KafkaConfig,
    pub server: ServerConfig,
    pub log: LogConfig,
    pub coordinator: CoordinatorConfig,
    pub drainer: DrainerConfig,
    pub routing: RoutingConfig,
    /// Retention of finished runs.
    #[serde(default)]
    pub runs: RunsConfig,
    /// Dead letters: recorded in Postgres, compressed on the topic, kept
    /// for a retention.
    #[serde(default)]
    pub dead_letters: DeadLettersConfig,
    /// Off unless configured: inputs signed per tenant.
    #[serde(default)]
    pub signatures: SignaturesConfig,
    /// Off unless configured: the OTLP exporter of the trace spans.
    #[serde(default)]
    pub telemetry: TelemetryConfig,
}

impl Config {
    /// Loads defaults, then `file` if given, then the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_from(file, std::env::vars())
    }

    /// [`Config::load`] with an explicit environment, for tests.
    pub fn load_from(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut figment = Figment::new().merge(Toml::string(DEFAULT_TOML));
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::MissingFile(path.to_path_buf()));
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        let env: Vec<(String, String)> = env.into_iter().collect();
        let plain = |name: &str| {
            env.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .filter(|v| !v.is_empty())
        };
        if let Some(url) = plain("DATABASE_URL") {
            figment = figment.merge(Serialized::default("database.url", url));
        }
        if let Some(url) = plain("DATABASE_MIGRATE_URL") {
            figment = figment.merge(Serialized::default("database.migrate_url", url));
        }
        if let Some(url) = plain("DATABASE_KEYS_URL") {
            figment = figment.merge(Serialized::default("database.keys_url", url));
        }
        if let Some(servers) = plain("KAFKA_BOOTSTRAP_SERVERS") {
            figment = figment.merge(Serialized::default("kafka.bootstrap_servers", servers));
        }
        for (name, value) in &env {
            let Some(path) = name.strip_prefix("DUCTOR__") else {
                continue;
            };
            let key = path
                .split("__")
                .map(str::to_ascii_lowercase)
                .collect::<Vec<_>>()
                .join(".");
            figment = figment.merge(Serialized::default(&key, env_value(value)));
        }
        let config: Config = figment
            .extract()
            .map_err(|e| ConfigError::Parse(flatten_figment_error(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Rejects values that deserialize but cannot work: each section's
    /// own, then what relates one section to another.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        self.database.validate()?;
        self.signatures.validate()?;
        self.validate_signature_window()?;
        self.kafka.validate()?;
        self.coordinator.validate()?;
        self.validate_batches()?;
        self.validate_state_bound()?;
        self.drainer.validate()?;
        self.validate_drainer_lease()?;
        self.routing.validate()?;
        self.runs.validate()?;
        self.dead_letters.validate()?;
        self.validate_dead_letter_bound()?;
        self.telemetry.validate()
    }

    /// What this configuration leaves open that an operator should know
    /// of, each said at start-up and on the admin `/readyz`.
    pub fn security_warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.server.auth == AuthMode::Required && !self.signatures.all_inputs {
            warnings.push(
                "inputs on Kafka are not signed (signatures.all_inputs = false): any writer of \
                 the input topics can act as any tenant, whatever the API's keys say. Safe only \
                 with topic ACLs that let each producer write its own tenant's inputs alone; \
                 otherwise set signatures.all_inputs = true with a signing key per tenant"
                    .to_owned(),
            );
        }
        warnings
    }

    /// A signed start replayed within the signatures' window still finds
    /// its decision.
    fn validate_signature_window(&self) -> Result<(), ConfigError> {
        let max_age_ms = self.signatures.max_age_ms;
        if max_age_ms < 1_000 || max_age_ms >= self.routing.completed_ttl_ms {
            return Err(invalid(
                "signatures.max_age_ms",
                format!(
                    "must be at least 1000 and below routing.completed_ttl_ms ({}): a signed \
                     start replayed within the window must still find its decision",
                    self.routing.completed_ttl_ms
                ),
            ));
        }
        Ok(())
    }

    /// Each apply lane has a connection to hold, and an input fits the
    /// effect that carries it.
    fn validate_batches(&self) -> Result<(), ConfigError> {
        if self.coordinator.apply_lanes >= self.database.max_connections as usize {
            return Err(invalid(
                "coordinator.apply_lanes",
                "must be below database.max_connections (each lane holds a connection while it applies)",
            ));
        }
        let budget = self.coordinator.max_input_bytes as u64 + EFFECT_ENVELOPE_BYTES;
        if budget > self.kafka.message_max_bytes {
            return Err(invalid(
                "coordinator.max_input_bytes",
                format!(
                    "{} bytes of input plus {EFFECT_ENVELOPE_BYTES} for the envelope and headers of the \
                     effect that carries it is {budget}, over kafka.message_max_bytes ({}): a step \
                     dispatch of such an input could never be published; lower the one or raise the other",
                    self.coordinator.max_input_bytes, self.kafka.message_max_bytes
                ),
            ));
        }
        Ok(())
    }

    /// A recorded letter keeps at least what the broker takes uncompressed,
    /// and the dead-letter producer's limit stays within librdkafka's.
    fn validate_dead_letter_bound(&self) -> Result<(), ConfigError> {
        let bound = self.dead_letters.max_value_bytes;
        if bound < self.kafka.message_max_bytes {
            return Err(invalid(
                "dead_letters.max_value_bytes",
                format!(
                    "{bound} is below kafka.message_max_bytes ({}): a recorded letter must keep \
                     at least an input the broker takes uncompressed, and more for one that \
                     reached it compressed",
                    self.kafka.message_max_bytes
                ),
            ));
        }
        if self.dead_letter_record_bytes() > LIBRDKAFKA_MAX_MESSAGE_BYTES {
            return Err(invalid(
                "dead_letters.max_value_bytes",
                format!(
                    "with kafka.message_max_bytes it makes the dead-letter producer's \
                     message.max.bytes {}, over librdkafka's ceiling {LIBRDKAFKA_MAX_MESSAGE_BYTES}",
                    self.dead_letter_record_bytes()
                ),
            ));
        }
        Ok(())
    }

    /// `message.max.bytes` of the dead-letter producer (and of a replay's):
    /// a value of `dead_letters.max_value_bytes`, and a record's worth of
    /// key and headers besides. librdkafka holds a record to it before
    /// compressing; the broker judges the compressed batch against the
    /// topic's `max.message.bytes`. See [`crate::ingress::dead_letter`].
    pub fn dead_letter_record_bytes(&self) -> u64 {
        self.dead_letters
            .max_value_bytes
            .saturating_add(self.kafka.message_max_bytes)
    }

    /// A claim outlives the publish it covers.
    fn validate_drainer_lease(&self) -> Result<(), ConfigError> {
        if self.drainer.lease_ms <= self.kafka.delivery_timeout_ms {
            return Err(invalid(
                "drainer.lease_ms",
                "must exceed kafka.delivery_timeout_ms, or an in-flight publish could be redriven",
            ));
        }
        Ok(())
    }

    /// `coordinator.max_state_bytes` holds a run's largest input and one
    /// output, or a run could fail for holding nothing but what it may.
    fn validate_state_bound(&self) -> Result<(), ConfigError> {
        let payload = self.input_limits().max_payload_bytes as u64;
        let least = payload
            .saturating_mul(2)
            .saturating_add(STATE_ENVELOPE_BYTES);
        let max = self.coordinator.max_state_bytes as u64;
        if max < least {
            return Err(ConfigError::Invalid {
                key: "coordinator.max_state_bytes",
                message: format!(
                    "{max} is below {least}: a run's input and one step's output (up to {payload} \
                     bytes each once written back, kafka.message_max_bytes less \
                     {EFFECT_ENVELOPE_BYTES}) plus {STATE_ENVELOPE_BYTES} for the rest of its \
                     state must fit; raise it or lower kafka.message_max_bytes"
                ),
            });
        }
        Ok(())
    }

    /// The bounds every input keeps, on Kafka and over HTTP.
    pub fn input_limits(&self) -> InputLimits {
        let c = &self.coordinator;
        InputLimits {
            max_bytes: c.max_input_bytes,
            shape: ShapeLimits {
                max_depth: c.max_json_depth,
                max_string_bytes: c.max_string_bytes,
                max_array_items: c.max_array_items,
                max_object_keys: c.max_object_keys,
            },
            max_payload_bytes: usize::try_from(
                self.kafka
                    .message_max_bytes
                    .saturating_sub(EFFECT_ENVELOPE_BYTES),
            )
            .unwrap_or(usize::MAX),
        }
    }

    /// The deployment's topic names, under `kafka.topic_prefix`.
    pub fn topic_names(&self) -> TopicNames {
        TopicNames {
            prefix: self.kafka.topic_prefix.clone(),
        }
    }

    /// Every topic `ductor topics create` makes.
    pub fn all_topics(&self) -> Vec<String> {
        let names = self.topic_names();
        let mut topics = names.inputs();
        topics.extend([names.events(), names.dead_letters()]);
        topics.extend(self.kafka.step_pools.iter().map(|p| names.steps(p)));
        topics.extend(self.kafka.extra_topics.iter().cloned());
        topics.sort();
        topics.dedup();
        topics
    }
}

/// The error of a setting `key` that breaks a rule.
fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        message: message.into(),
    }
}

/// Reads an environment value as a TOML value where it parses as one
/// (`5000`, `true`, `["a", "b"]`), otherwise as a plain string, so that
/// `DUCTOR__LOG__FILTER=info` needs no quotes.
fn env_value(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

/// Every error figment found, each with the key it concerns and where
/// its value came from, on one line.
fn flatten_figment_error(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            let key = if e.path.is_empty() {
                String::new()
            } else {
                format!("{}: ", e.path.join("."))
            };
            let source = e
                .metadata
                .as_ref()
                .map(|m| format!(" (from {})", m.name))
                .unwrap_or_default();
            format!("{key}{}{source}", e.kind)
        })
        .collect::<Vec<_>>()
        .join("; ")
}
