//! Ductor's configuration: one typed struct, layered
//! built-in defaults (`config/default.toml`) → an optional file → environment.
//!
//! Environment variables are `DUCTOR__SECTION__KEY` (double underscores
//! separate the path). `DATABASE_URL` and `KAFKA_BOOTSTRAP_SERVERS` are also
//! honoured, because the local stack and docker-compose export those names,
//! and so are `DATABASE_MIGRATE_URL` (`database.migrate_url`, the migrator's)
//! and `DATABASE_KEYS_URL` (`database.keys_url`, the keys role's);
//! `DUCTOR__DATABASE__URL` and `DUCTOR__KAFKA__BOOTSTRAP_SERVERS` win over them.
//!
//! Every struct denies unknown fields, so a misspelt key is an error that names
//! it, and [`Config::validate`] rejects values that parse but make no sense.
//! Secrets (the database password, Kafka SASL/TLS credentials) are redacted in
//! `Debug` output and therefore in logs.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::contract::names::TopicNames;
use crate::contract::{InputLimits, ShapeLimits};
use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

/// Room an effect needs around the largest value it carries (a dispatch
/// carries a run's input or a step's output): its envelope fields, its
/// headers and the record's framing.
pub const EFFECT_ENVELOPE_BYTES: u64 = 16_384;

/// Room a run's state needs besides the largest values it holds (its input
/// and its newest output): ids, times, and the records of its attempts
/// and signals. `coordinator.max_state_bytes` must leave at least this.
pub const STATE_ENVELOPE_BYTES: u64 = 65_536;

/// The defaults, compiled in so the binary runs from any directory.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// The producer settings a delivery report's truth rests on, with the value
/// Ductor gives each; every producer Ductor makes sets them.
/// [`Config::validate`] refuses pass-through properties that change them.
pub const PRODUCER_GUARANTEES: [(&str, &str); 3] = [
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("max.in.flight.requests.per.connection", "1"),
];

/// The consumer settings the single writer and exactly-once rest on, with
/// the value Ductor gives each; the ingress's consumer sets them and
/// [`Config::validate`] refuses pass-through properties that change them:
/// - the range assignor over the classic group protocol gives partition p
///   of every input topic to one member (one writer per run); another
///   assignor, or the consumer protocol with its broker-side assignors,
///   may split a run's inputs between two processes;
/// - offsets are stored only after the transaction that applied them
///   committed; an automatic store would commit inputs never applied;
/// - inputs of aborted producer transactions are never applied.
pub const CONSUMER_GUARANTEES: [(&str, &str); 4] = [
    ("partition.assignment.strategy", "range"),
    ("group.protocol", "classic"),
    ("enable.auto.offset.store", "false"),
    ("isolation.level", "read_committed"),
];

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
    /// Off unless configured: inputs signed per tenant.
    #[serde(default)]
    pub signatures: SignaturesConfig,
}

/// Signed inputs (`ductor-signature`, HMAC-SHA256 of the time of signing
/// and the record's value with the tenant's key; see
/// [`crate::contract::signature`]). Where they are required, an unsigned,
/// mis-signed or stale input is dead-lettered with class
/// `unauthenticated`. Kafka ACLs decide who may write a topic at all;
/// signatures decide which tenant a writer may speak for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignaturesConfig {
    /// Pools whose `run.start` inputs must be signed.
    #[serde(default)]
    pub pools: Vec<String>,
    /// Every input from outside Ductor must be signed: starts of any pool,
    /// attempt results, signals and cancels (a result or a signal names no
    /// pool, so only this covers them). Requires `timer_key`, so that
    /// Ductor's own timers, which share the wakeups topic with signals and
    /// cancels, cannot be forged by a writer of signals either.
    #[serde(default)]
    pub all_inputs: bool,
    /// How far the time a signature names may lie from when its input
    /// reached Kafka (the record's `LogAppendTime`, which `ductor topics
    /// create` gives the input topics, else when the ingress reads it),
    /// before or after: a copy replayed later is refused. Within it a
    /// replay is deduplicated, which is why a signed start must carry an
    /// idempotency key or a run id, and why this must stay below
    /// `routing.completed_ttl_ms`. On a topic without `LogAppendTime`, an
    /// ingress that falls this far behind refuses the signed inputs it
    /// reads late.
    #[serde(default = "default_signature_max_age_ms")]
    pub max_age_ms: u64,
    /// The key `serve` signs its own timers with (`wakeup.timer`: timeouts,
    /// retries, wakes), set through `DUCTOR__SIGNATURES__TIMER_KEY`. Set,
    /// every timer the ingress reads must carry its signature, so that a
    /// writer of the wakeups topic who knows an attempt's stamp (every
    /// worker of the pool sees it) cannot time an attempt out or end a
    /// wait. Only serve holds it; at least 16 bytes. Timers already on the
    /// topic when it is first set are refused, so set it on a quiet
    /// system or before the first run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timer_key: Option<SigningKey>,
    /// Each tenant's signing key. Set them through the environment
    /// (`DUCTOR__SIGNATURES__TENANT_KEYS__ACME=...`) rather than a file;
    /// they are redacted wherever the configuration is printed. The HTTP
    /// API signs the signals and cancels it puts on Kafka with them.
    #[serde(default)]
    pub tenant_keys: BTreeMap<String, SigningKey>,
}

impl SignaturesConfig {
    /// Whether an input of this kind (a start of `start_pool`, or another
    /// input from outside Ductor) must be signed.
    pub fn required(&self, start_pool: Option<&str>) -> bool {
        self.all_inputs || start_pool.is_some_and(|pool| self.pools.iter().any(|p| p == pool))
    }

    /// `tenant`'s key, if it has one.
    pub fn key(&self, tenant: &str) -> Option<&[u8]> {
        self.tenant_keys.get(tenant).map(|k| k.0.as_bytes())
    }

    /// Serve's timer key, if set.
    pub fn timer_key(&self) -> Option<&[u8]> {
        self.timer_key.as_ref().map(|k| k.0.as_bytes())
    }
}

fn default_signature_max_age_ms() -> u64 {
    300_000
}

/// Shortest signing key accepted: a key guessed is a tenant impersonated.
pub const MIN_SIGNING_KEY_BYTES: usize = 16;

/// A tenant's signing key: printed as `[redacted]`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SigningKey(pub String);

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"[redacted]\"")
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Postgres connection URL, `postgres://user:password@host:port/db`,
    /// of the application role: every command but `ductor migrate`
    /// connects with it. That role needs no DDL rights (`ductor migrate`
    /// grants it what it does need). The password is redacted wherever the
    /// configuration is printed.
    ///
    /// TLS is set in the query, with libpq's names and meanings:
    /// `?sslmode=verify-full&sslrootcert=/etc/ductor/db-ca.pem` encrypts
    /// and checks that the server's certificate chains to that CA and
    /// names the host dialled; `verify-ca` skips the name, `require`
    /// encrypts without checking anything, and the default, `prefer`,
    /// encrypts when the server offers TLS, unchecked, and falls back to
    /// plain text when not. Unlike libpq, the system's trusted roots count
    /// besides `sslrootcert` (sqlx with rustls). A client certificate:
    /// `sslcert` and `sslkey`.
    pub url: DatabaseUrl,
    /// Postgres connection URL of the migrator: a role that owns the schema
    /// and every object the migrations create. `ductor migrate` (and
    /// `serve` with `migrate_on_start`) connects with it; nothing else
    /// does. Unset: `url`, one role for both, which then owns the schema.
    /// Redacted like `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate_url: Option<DatabaseUrl>,
    /// The role to which `ductor migrate` grants what `serve` needs (and
    /// nothing else: what it held before is revoked): CONNECT, USAGE on
    /// the schema, and table by table the statements serve runs (SELECT
    /// everywhere, INSERT where it adds rows, UPDATE of the columns it
    /// changes, DELETE only of outbox, routing and drainer rows; on
    /// `api_keys` only SELECT and UPDATE of `last_used_at`); EXECUTE on
    /// the write guard and on retention's purge functions, its only way to
    /// delete runs and their history. Nothing by default on what later
    /// migrations create. Unset: the user of `url`. Nothing is granted
    /// when it is the migrator itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_role: Option<String>,
    /// Postgres connection URL of the keys role, for `ductor keys` (and
    /// nothing else): it may make, list and revoke API keys and touches no
    /// other table. Unset: `url`, which works only where that role owns
    /// the schema (one role for everything); with a separate application
    /// role, `ductor keys` is then refused and says to set this. Redacted
    /// like `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys_url: Option<DatabaseUrl>,
    /// The role to which `ductor migrate` grants what `ductor keys` needs:
    /// SELECT on `api_keys`, INSERT of a new key's own columns, UPDATE of
    /// `revoked_at`, CONNECT and USAGE on the schema; nothing else. Unset:
    /// the user of `keys_url`, and no keys role at all when `keys_url` is
    /// unset too. Must differ from `app_role`, or serve could mint keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys_role: Option<String>,
    /// Upper bound on pooled connections per process, for the ingress,
    /// the drainer and maintenance.
    pub max_connections: u32,
    /// Connections of the public API's own pool, apart from
    /// `max_connections`, so that callers, however many, cannot take the
    /// connections the ingress and the drainer need. A request that finds
    /// them all busy waits up to `acquire_timeout_ms`, then gets 503.
    pub api_max_connections: u32,
    /// Connections kept open while idle.
    pub min_connections: u32,
    /// How long a task waits for a pooled connection before failing.
    pub acquire_timeout_ms: u64,
    /// A pooled connection that has been idle at least this long is tested
    /// with a round trip before it is handed out, so that one the server
    /// closed meanwhile (a restart, an idle timeout) is replaced instead of
    /// failing its next statement. A connection returned more recently is
    /// handed out untested: under load each apply lane takes one per batch,
    /// and the test cost a batch 1.3-2.1 ms of a cycle of about 10-15 ms
    /// (`ductor-bench --latency-at 1300 --loads 50` on two cores). A
    /// statement on a connection that died within this window fails, and
    /// its batch is retried like after any database error. 0 tests every
    /// connection.
    pub test_idle_after_ms: u64,
    /// `statement_timeout` set on every connection, so a stuck statement
    /// cannot hold a batch (and its partition) forever.
    pub statement_timeout_ms: u64,
    /// Apply pending migrations, as the migrator (`migrate_url`), when
    /// `serve` starts. Off by default: migrating is `ductor migrate`'s job,
    /// and `serve` then only checks that every migration it knows is
    /// applied, and refuses to start on an older schema.
    pub migrate_on_start: bool,
}

impl DatabaseConfig {
    /// The URL migrations run with: `migrate_url`, else `url`.
    pub fn migrate_url(&self) -> &DatabaseUrl {
        self.migrate_url.as_ref().unwrap_or(&self.url)
    }

    /// The role `ductor migrate` grants serve's rights to: `app_role`,
    /// else the user of `url`.
    pub fn app_role(&self) -> Option<String> {
        self.app_role.clone().or_else(|| self.url.user())
    }

    /// The URL `ductor keys` connects with: `keys_url`, else `url`.
    pub fn keys_url(&self) -> &DatabaseUrl {
        self.keys_url.as_ref().unwrap_or(&self.url)
    }

    /// The role `ductor migrate` grants the rights of `ductor keys` to:
    /// `keys_role`, else the user of `keys_url`; none when neither is set.
    pub fn keys_role(&self) -> Option<String> {
        self.keys_role
            .clone()
            .or_else(|| self.keys_url.as_ref().and_then(DatabaseUrl::user))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers` for every client.
    pub bootstrap_servers: String,
    /// Prefix of every topic Ductor owns: `<prefix>requests`,
    /// `<prefix>wakeups`, `<prefix>attempt-results`, `<prefix>steps.<pool>`,
    /// `<prefix>events`, `<prefix>dlq`.
    pub topic_prefix: String,
    /// `client.id` prefix; each client appends its role.
    pub client_id: String,
    /// Consumer group of the coordinator's ingress. Every `serve` process with
    /// the same group shares the input partitions.
    pub group_id: String,
    /// Static group membership of the ingress (`group.instance.id`): a
    /// name that stays the same across restarts of one `serve` (a pod's
    /// name, `serve-1`), unique in the group. A restarted `serve` then
    /// takes its partitions back at once, without a rebalance and without
    /// waiting out `session_timeout_ms`; one that does not come back has
    /// its partitions moved after `session_timeout_ms` (a clean stop
    /// included: a static member does not leave the group). Unset, the
    /// default: dynamic membership.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_instance_id: Option<String>,
    /// Refuse input topics of different partition counts (`serve` and
    /// `topics create`): only co-partitioned topics give each run one
    /// writer. `false` only warns, and leaves the optimistic lock alone to
    /// keep concurrent writers of a run apart (the chaos harness tests it
    /// so).
    #[serde(default = "yes")]
    pub require_copartitioned: bool,
    /// Partition count used by `ductor topics create`. It is the most
    /// consumers of a topic that can work at once: the coordinator's apply
    /// lanes over all `serve` processes, and the worker processes of each
    /// step pool. Raise it before creating the topics when more of them
    /// should share the work. Every partition also costs requests: librdkafka
    /// sends one produce request per partition, so traffic spread over more
    /// partitions than its consumers need pays the broker's cost per request
    /// more often. Measured with `ductor-bench --latency-at R --loads 50` on
    /// two cores, in six interleaved pairs at 2330-2800 inputs/s, two
    /// partitions (one per default apply lane) against six: Kafka used about
    /// 0.12 cores less in every pair, p99 was lower in every pair (48-118 ms
    /// against 102-213 ms), and capacity did not change (6337 and 6567
    /// inputs/s against 6692 and 6267).
    pub partitions: i32,
    /// Replication factor used by `ductor topics create`.
    pub replication_factor: i32,
    /// Step pools whose `<prefix>steps.<pool>` topics `topics create` makes.
    pub step_pools: Vec<String>,
    /// Further topics `topics create` makes (workflow output topics).
    pub extra_topics: Vec<String>,
    /// `session.timeout.ms` of the consumers.
    pub session_timeout_ms: u64,
    /// `max.poll.interval.ms` of the consumers.
    pub max_poll_interval_ms: u64,
    /// `fetch.wait.max.ms` of the consumers: how long the broker may hold a
    /// fetch open waiting for data, i.e. the idle latency floor.
    pub fetch_max_wait_ms: u64,
    /// `linger.ms` of the producers.
    pub linger_ms: u64,
    /// `message.max.bytes` of the producers.
    pub message_max_bytes: u64,
    /// `request.timeout.ms` of the producers.
    pub request_timeout_ms: u64,
    /// `delivery.timeout.ms` (`message.timeout.ms`) of the producers: how long
    /// a publish may be retried before it is reported failed.
    pub delivery_timeout_ms: u64,
    /// Timeout of admin and metadata requests.
    pub admin_timeout_ms: u64,
    /// librdkafka properties applied to every client after Ductor's own
    /// settings: how Ductor authenticates to the brokers and encrypts, e.g.
    /// `"security.protocol" = "SASL_SSL"`, `"sasl.mechanism" =
    /// "SCRAM-SHA-512"`, `"sasl.username"`, `"sasl.password"`,
    /// `"ssl.ca.location" = "/etc/ductor/kafka-ca.pem"`. Set them in the
    /// file: an environment variable cannot name them (its `__` become the
    /// dots between sections, so a dotted key would be read as a nested
    /// section and refused). Values of keys that look secret are redacted
    /// in logs and in `ductor config`.
    pub properties: KafkaProperties,
    /// librdkafka properties for consumers only.
    pub consumer_properties: KafkaProperties,
    /// librdkafka properties for producers only. Neither this map nor
    /// `properties` may change `enable.idempotence`, `acks` or
    /// `max.in.flight.requests.per.connection` from Ductor's values
    /// ([`PRODUCER_GUARANTEES`]): the outbox trusts delivery
    /// reports, and those settings are what make them true.
    pub producer_properties: KafkaProperties,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Address of the public HTTP listener: the routing API, `/healthz`,
    /// and a `/readyz` that answers ready or not, without detail.
    pub listen: SocketAddr,
    /// Address of the admin HTTP listener: `/metrics`, `/healthz`, the
    /// detailed `/readyz` (each dependency's check with its error, the
    /// stalled lanes) and the operator endpoints. Loopback by default:
    /// what it tells (hosts, users, error texts, the process's own
    /// numbers) is for the operator and the scraper beside the process,
    /// not for every client that can reach the API. Must differ from
    /// `listen`.
    pub admin_listen: SocketAddr,
    /// After SIGINT/SIGTERM, how long in-flight work may take to finish
    /// before the process exits anyway.
    pub shutdown_grace_ms: u64,
    /// Bound on each dependency check of readiness.
    pub readiness_timeout_ms: u64,
    /// How often one background task checks readiness (Postgres on a
    /// connection of its own, Kafka's metadata, the ingress). `/readyz`,
    /// on either listener, answers the latest verdict and costs nothing
    /// else, so a flood of it takes nothing from the ingress; the verdict
    /// is at most this (plus `readiness_timeout_ms`) old.
    pub readiness_interval_ms: u64,
    /// Connections each listener keeps open at once. One more is closed as
    /// soon as it is accepted (counted in
    /// `ductor_http_connections_refused_total`), so that clients that open
    /// connections and send nothing, however many, cannot use up the
    /// process's file descriptors; an idle one is closed anyway after
    /// `header_read_timeout_ms`.
    pub max_connections: usize,
    /// Who may use the admin listener: `loopback` (the default) trusts
    /// whoever reaches it, and so requires `admin_listen` to be a loopback
    /// address; `key` requires, on every admin route but `/healthz`, an API
    /// key with the `admin` scope (`Authorization: Bearer <key>`, made with
    /// `ductor keys create --scopes admin`), and is what a non-loopback
    /// `admin_listen` needs (with `admin_tls_cert_file`, so that the key
    /// does not cross the network in clear).
    pub admin_auth: AdminAuth,
    /// Bound on the whole of one API request, from its headers to its
    /// answer: past it, 503 `timeout` (a decision cut short rolls back, and a
    /// retry with the same idempotency key gets the one decision).
    pub request_timeout_ms: u64,
    /// Bound on reading a request's body once its headers are in: past it,
    /// 408 `body_timeout`, so a caller that trickles a body cannot hold a
    /// slot for long.
    pub body_read_timeout_ms: u64,
    /// API requests handled at once; one more is shed at once with 503
    /// `overloaded` and `Retry-After`, instead of queueing behind the rest.
    pub max_concurrent_requests: usize,
    /// Requests per second an API key may make, unless the key has its own
    /// rate (`ductor keys create --requests-per-second`); past it, 429
    /// `rate_limited` with `Retry-After`.
    pub requests_per_second: u32,
    /// Requests a key may make at once above its rate (its bucket's size).
    pub request_burst: u32,
    /// Failed authentications per second a client address may make, on
    /// either listener, once its `auth_failure_burst` is spent; past it,
    /// 429 `rate_limited` with `Retry-After`, before its key is looked up.
    /// A client whose key is valid never fails, so this holds back only
    /// those that guess.
    pub auth_failures_per_second: u32,
    /// Failed authentications a client address may make at once.
    pub auth_failure_burst: u32,
    /// How long a key id found in no row is remembered as unknown: a
    /// request with it is refused (401) without a query. Key ids are
    /// random, so a key made meanwhile is never among them.
    pub unknown_key_cache_ms: u64,
    /// Bound on reading a request's head (its request line and headers)
    /// on either listener, counted from the connection's opening or the
    /// previous answer; with TLS, the handshake is held to it too. Past it
    /// the connection is closed without an answer, so a client that
    /// trickles its headers, or sends none, cannot hold a connection.
    pub header_read_timeout_ms: u64,
    /// PEM file of the public listener's certificate chain (the server's
    /// certificate first). Set with `tls_key_file`, the public listener
    /// speaks only TLS; unset (the default), only plain HTTP. Both files are
    /// read at start-up, where one that cannot be read or that does not
    /// match the other keeps `serve` from starting; they are read again on
    /// SIGHUP and when either's modification time changes (see
    /// `tls_check_interval_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM file of the private key of `tls_cert_file` (PKCS#8, PKCS#1 or
    /// SEC1). Both or neither.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// `tls_cert_file` for the admin listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_tls_cert_file: Option<PathBuf>,
    /// `tls_key_file` for the admin listener. Both or neither.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_tls_key_file: Option<PathBuf>,
    /// How often `serve` looks at the modification times of the TLS files.
    /// A change loads the new pair for new connections (open ones keep
    /// theirs); a pair that does not load is logged and the old one kept.
    pub tls_check_interval_ms: u64,
    /// Whether the public API requires an API key (`Authorization: Bearer
    /// <key>`, made with `ductor keys create`): `required` (the default),
    /// or `disabled`, for local development only, where every request names
    /// its own tenant and `serve` warns at start-up.
    pub auth: AuthMode,
}

/// See [`ServerConfig::admin_auth`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdminAuth {
    Loopback,
    Key,
}

/// See [`ServerConfig::auth`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    Required,
    Disabled,
}

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

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// Directory of workflow definitions (`*.toml`, one workflow each).
    /// A run keeps the version it started with, so a version must stay
    /// here while running runs need it: `serve` refuses to start when one
    /// is missing, naming it with its runs (see
    /// `fail_runs_of_missing_workflows`).
    pub workflows_dir: PathBuf,
    /// Have `serve`, as it starts and before it consumes anything, fail
    /// every running run whose workflow version `workflows_dir` no longer
    /// defines, instead of refusing to start. Each such run goes to
    /// `failed` with the error `workflow_missing: workflow "<name>" version
    /// <n> is no longer defined`, by a `run.failed` transition (input
    /// `maintenance:missing_workflow`) and its `run.event`, like any other
    /// failure; its outstanding attempt is cancelled, a pending retry
    /// dropped and a wait ended. Off by default: retiring a version with
    /// its runs is decided by an operator, once; a value that is not a
    /// boolean is refused.
    pub fail_runs_of_missing_workflows: bool,
    /// Most inputs applied in one Postgres transaction. Only a backlog fills
    /// a batch (under open-loop load at 90% of capacity batches averaged 89
    /// inputs), so the bound trades the cost a batch statement has whatever
    /// its size against how long one batch holds its lane. Measured with
    /// `ductor-bench --runs 8000` on two cores: 512 took a backlog at 6226 and
    /// 7023 inputs/s where 256 took it at 4186 and 5694; p99 at 50% load was
    /// 117 and 84 ms against 98 and 100 (at the higher rates that 50% of the
    /// higher capacities makes).
    pub batch_max_inputs: usize,
    /// How long an idle apply lane waits for more inputs after its first
    /// one. Inputs that queued while the lane was applying form the next
    /// batch at once, without this wait. (With `apply_lanes = 1` the single
    /// ingress loop always waits this long to fill a batch.)
    pub batch_linger_ms: u64,
    /// Batches applied at once, each on its own connection: input partition
    /// `p` goes to lane `p % apply_lanes`, so one partition stays in order
    /// while one lane's commit overlaps another's work.
    pub apply_lanes: usize,
    /// With several lanes, a batch smaller than this waits for its turn:
    /// the lanes apply one at a time, and what arrives meanwhile joins the
    /// waiting batch, so the traffic is not split into many small
    /// transactions that each pay a statement, a WAL flush and their round
    /// trips. A batch this large (a backlog) applies at once, alongside the
    /// others. The default, 1, lets every batch apply at once: taking turns
    /// saves CPU per input, but once the one turn is busy most of the time
    /// every input waits a whole batch for it. On two cores at half of the
    /// capacity, turns (64) used about 15 % less CPU per input and raised
    /// the p99 latency by about half.
    pub concurrent_batch_min_inputs: usize,
    /// Inputs larger than this go to the dead-letter topic (class
    /// `too_large`); so do HTTP bodies over `routing.max_body_bytes`. With
    /// [`EFFECT_ENVELOPE_BYTES`] for the effect that carries it, it must fit
    /// `kafka.message_max_bytes`, or the configuration is refused.
    pub max_input_bytes: usize,
    /// Largest a run's state may get, in bytes of its JSON encoding. Every
    /// input of a run loads its state and writes it back whole, so this
    /// bounds what each costs in memory and in the row. The state keeps the
    /// newest step's output only, and signals without their payloads (the
    /// history keeps those); what still grows is the attempt and signal
    /// records. A transition that would leave a state larger than this
    /// fails the run instead, for good, with class `state_too_large`. It
    /// must hold the largest input and one output (each
    /// `kafka.message_max_bytes` less [`EFFECT_ENVELOPE_BYTES`] once
    /// written back) plus [`STATE_ENVELOPE_BYTES`], or the configuration
    /// is refused.
    pub max_state_bytes: usize,
    /// Deepest nesting of arrays and objects in an input or an HTTP body
    /// (the top level is 1); deeper ones are refused as `too_deep`. At
    /// most 128, the JSON parser's own bound.
    pub max_json_depth: usize,
    /// Longest string (or object key) in an input, in bytes once escapes
    /// are decoded; longer ones are refused as `string_too_long`.
    pub max_string_bytes: usize,
    /// Most elements of one array in an input; more are refused as
    /// `array_too_long`.
    pub max_array_items: usize,
    /// Most members of one object in an input; more are refused as
    /// `object_too_wide`.
    pub max_object_keys: usize,
    /// First pause before a batch that failed transiently (the database
    /// unreachable, a timeout, a serialization failure) is applied again;
    /// each further failure doubles it, up to `apply_retry_max_ms`. A batch
    /// that fails permanently is not retried but bisected: the inputs that
    /// fail alone go to the dead-letter topic (stage `apply`).
    pub apply_retry_min_ms: u64,
    /// Longest pause between two tries of a transiently failing batch.
    pub apply_retry_max_ms: u64,
    /// Transient failures that a batch's own inputs may cause (a statement
    /// cut off by `database.statement_timeout_ms` or a lock wait, a
    /// serialization failure or deadlock, races lost past
    /// `conflict_retries`, an idempotency key another caller holds) after
    /// which the batch is bisected like one that fails permanently, so
    /// that one such input cannot hold its lane. Each half gets one try
    /// before it is split again; an input that fails this many times
    /// alone, while the database answers a trivial query, goes to the
    /// dead-letter topic with class `transient_exhausted`, unless it waits
    /// on another caller's idempotency key (that caller or the sweep
    /// releases it). A database that does not answer is retried, whole,
    /// for as long as it takes.
    pub apply_bisect_after_failures: u32,
    /// Kafka starts that each apply lane may park beside it because an
    /// HTTP request holds their idempotency key, still deciding: the lane
    /// applies its other inputs meanwhile, and applies the parked starts
    /// again after `apply_retry_min_ms`, doubling up to
    /// `apply_retry_max_ms`, until that request decides or the sweep frees
    /// the key (`routing.pending_ttl_ms`). A later start with the same key
    /// is parked behind them. The partition's stored offset stays at the
    /// oldest parked start, so nothing parked is lost to a crash. Past this
    /// many a start waits in its lane, and the lane behind it; 0 never
    /// parks. Each parked start holds up to `max_input_bytes` of memory.
    pub max_parked_starts: usize,
    /// An apply lane that has held a batch this long without committing it
    /// (the database away, a lock held, a dead letter the broker will not
    /// take) is stalled, with the partitions behind it: `/readyz` answers
    /// 503 (naming it on the admin listener), and
    /// `ductor_ingress_stalled_lanes` counts it.
    pub stall_after_ms: u64,
    /// Times a batch is recomputed after losing an optimistic-lock race
    /// before the batch fails (and is retried from Kafka).
    pub conflict_retries: u32,
    /// Run states kept in memory after a commit, so the next batch of a run
    /// skips loading it (the conditional UPDATE still checks its
    /// `record_version`; a stale entry costs one recomputation). With the
    /// cache on, a run that a batch names only in `run.start` inputs, and
    /// that the cache does not hold, is taken to be new without a read; a
    /// redelivered start costs one recomputation. 0 turns the cache, and
    /// that guess, off.
    pub run_cache_size: usize,
    /// Bound on the run cache in bytes of the states' encoding (what a
    /// state holds in memory is about that); when full the cache starts
    /// over, and a state over a tenth of it is not cached. 0 turns the
    /// cache off.
    pub run_cache_max_bytes: usize,
    /// Most bytes of input values in one batch, besides
    /// `batch_max_inputs`: a lane stops gathering a batch once it holds
    /// this much (a single larger input is a batch of its own).
    pub batch_max_bytes: usize,
    /// Bound on error messages written to dead-letter headers.
    pub max_error_message_bytes: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainerConfig {
    /// Run the outbox drainer inside `serve`.
    pub enabled: bool,
    /// Most intents claimed and published in one round.
    pub batch_max_intents: usize,
    /// Safety-net poll when no wake-up arrives (in-process after a commit,
    /// or `LISTEN/NOTIFY` from other processes).
    pub poll_interval_ms: u64,
    /// How long a claim is held before the reconciler hands the intent to
    /// another drainer. Must exceed `kafka.delivery_timeout_ms`, or a slow
    /// publish could be redriven while still in flight.
    pub lease_ms: u64,
    /// How often expired claims, and claims of drainers that stopped, are
    /// looked for.
    pub reconcile_interval_ms: u64,
    /// How often a drainer records that it is alive.
    pub heartbeat_interval_ms: u64,
    /// A drainer whose heartbeat is this old is taken to be dead: its claims
    /// are given back without waiting out their lease, so the effects of a
    /// killed process are published within seconds. A drainer judges others
    /// only after reaching the database for this long itself.
    pub member_timeout_ms: u64,
    /// Completed intents are deleted this long after completion.
    pub retention_ms: u64,
    /// How often retention runs.
    pub purge_interval_ms: u64,
    /// Rows deleted per retention statement.
    pub purge_batch: usize,
    /// Retention statements per retention run, so one run stays bounded.
    pub purge_max_rounds: u32,
    /// Upper bound on the pause after failed rounds (broker or database
    /// down), and on how far one intent's next try is pushed back.
    pub max_backoff_ms: u64,
    /// How far an intent whose publish failed is pushed back before it is
    /// claimed again; doubled for every try it had, up to `max_backoff_ms`.
    /// Its run's later effects on the same topic wait behind it.
    pub publish_retry_min_ms: u64,
    /// Permanent publish failures (the record too large for the broker, an
    /// unknown or invalid topic, no authorisation) after which an intent is
    /// parked: out of the claim rounds, with its error, until `ductor
    /// outbox redrive`.
    pub park_after_failures: u32,
    /// How often the backlog gauges are refreshed.
    pub metrics_interval_ms: u64,
    /// How often the results frontier is probed: the instant before which
    /// the coordinator has applied every attempt result (see
    /// `ductor::outbox::frontier`). A step's timeout is published only once the
    /// frontier has passed its deadline, so a result sent in time is never
    /// beaten by the timeout while its partition waits for a crashed
    /// `serve`.
    pub results_frontier_interval_ms: u64,
    /// Besides "caught up now", the frontier is probed this long ago and
    /// four times that: under load, when the coordinator is never quite
    /// caught up, timeouts are published up to this much late.
    pub results_frontier_lag_ms: u64,
}

/// What a duplicate request does while the first caller with its key is
/// still deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DuplicatePolicy {
    /// Wait, up to the pool's `wait_timeout_ms`, for the first caller's
    /// decision and return it.
    Wait,
    /// Answer "in progress" at once (HTTP 409).
    Reject,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// How long a reservation may stay `pending` before the sweeper marks it
    /// `failed_before_commit`, so that another caller can reclaim the key.
    pub pending_ttl_ms: u64,
    /// How long a decision stays valid: a request with the same key within
    /// it gets the same run; after it, a new decision.
    pub completed_ttl_ms: u64,
    /// How often the sweeper runs.
    pub sweep_interval_ms: u64,
    /// Rows swept per statement.
    pub sweep_batch: usize,
    /// Failed rows, and completed rows past their TTL, are deleted this long
    /// after they died. Pending rows are never deleted.
    pub retention_ms: u64,
    /// How often retention runs.
    pub purge_interval_ms: u64,
    /// Rows deleted per retention statement.
    pub purge_batch: usize,
    /// Retention statements per retention run.
    pub purge_max_rounds: u32,
    /// Largest accepted `POST /v1/runs` body.
    pub max_body_bytes: usize,
    /// Default duplicate-waiter policy: `wait` or `reject`.
    pub duplicate_policy: DuplicatePolicy,
    /// Default bound on a duplicate's wait under the `wait` policy.
    pub wait_timeout_ms: u64,
    /// Per-pool overrides, e.g. `[routing.pools.payments]
    /// duplicate_policy = "reject"`.
    pub pools: BTreeMap<String, PoolRouting>,
}

/// Retention of finished runs: a run that ended longer than `retention_ms`
/// ago is deleted with its transitions and attempts, and leaves a tombstone
/// for `tombstone_retention_ms`, so that a late input for it (a start
/// replayed from Kafka) does not start it again.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunsConfig {
    /// How long a finished run is kept; 0 keeps every run for ever.
    pub retention_ms: u64,
    /// How long a deleted run's tombstone is kept. Make it outlast the
    /// retention of the input topics.
    pub tombstone_retention_ms: u64,
    /// How often retention runs.
    pub purge_interval_ms: u64,
    /// Runs (and tombstones) deleted per statement.
    pub purge_batch: usize,
    /// Statements per retention run.
    pub purge_max_rounds: u32,
}

fn yes() -> bool {
    true
}

impl Default for RunsConfig {
    fn default() -> Self {
        RunsConfig {
            retention_ms: 7 * 86_400_000,
            tombstone_retention_ms: 30 * 86_400_000,
            purge_interval_ms: 60_000,
            purge_batch: 500,
            purge_max_rounds: 10,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRouting {
    /// This pool's duplicate-waiter policy.
    pub duplicate_policy: Option<DuplicatePolicy>,
    /// This pool's bound on a duplicate's wait.
    pub wait_timeout_ms: Option<u64>,
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

    /// Rejects values that deserialize but cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_server()?;
        self.validate_database()?;
        self.validate_limits()?;
        self.validate_signatures()?;
        self.validate_kafka()?;
        self.validate_batches()?;
        self.validate_state_bound()?;
        self.validate_inputs()?;
        self.validate_drainer()?;
        self.validate_routing()?;
        self.validate_runs()
    }

    /// The two listeners are apart: on one address the admin endpoints
    /// would answer beside the public API (or the second bind fail). Each
    /// has a certificate and its key, or neither.
    fn validate_server(&self) -> Result<(), ConfigError> {
        let (public, admin) = (self.server.listen, self.server.admin_listen);
        let same_ip = public.ip() == admin.ip()
            || public.ip().is_unspecified()
            || admin.ip().is_unspecified();
        if admin.port() != 0 && admin.port() == public.port() && same_ip {
            return Err(invalid(
                "server.admin_listen",
                format!(
                    "{admin} overlaps server.listen ({public}): the admin endpoints must listen apart from the public API"
                ),
            ));
        }
        let server = &self.server;
        both_or_neither(
            ("server.tls_cert_file", &server.tls_cert_file),
            ("server.tls_key_file", &server.tls_key_file),
        )?;
        both_or_neither(
            ("server.admin_tls_cert_file", &server.admin_tls_cert_file),
            ("server.admin_tls_key_file", &server.admin_tls_key_file),
        )?;
        self.validate_admin_auth()
    }

    /// The admin listener trusts whoever reaches it only on loopback;
    /// anywhere else it takes an admin key, over TLS, with the API's keys
    /// to check it against.
    fn validate_admin_auth(&self) -> Result<(), ConfigError> {
        let server = &self.server;
        match server.admin_auth {
            AdminAuth::Loopback if !server.admin_listen.ip().is_loopback() => Err(invalid(
                "server.admin_listen",
                format!(
                    "{} is not a loopback address, and server.admin_auth = \"loopback\" lets \
                     whoever reaches the admin listener read its metrics and readiness and use \
                     the operator's endpoints: set server.admin_auth = \"key\" (an API key with \
                     the admin scope on every admin request, with server.admin_tls_cert_file), or \
                     listen on loopback",
                    server.admin_listen
                ),
            )),
            AdminAuth::Key if server.auth == AuthMode::Disabled => Err(invalid(
                "server.admin_auth",
                "\"key\" checks API keys, which server.auth = \"disabled\" turns off",
            )),
            AdminAuth::Key
                if server.admin_tls_cert_file.is_none()
                    && !server.admin_listen.ip().is_loopback() =>
            {
                Err(invalid(
                    "server.admin_tls_cert_file",
                    format!(
                        "must be set when the admin listener ({}) is not on loopback: an admin \
                         key would cross the network in clear",
                        server.admin_listen
                    ),
                ))
            }
            _ => Ok(()),
        }
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

    /// The signatures' window, and the timer key that `all_inputs` needs.
    fn validate_signatures(&self) -> Result<(), ConfigError> {
        let signatures = &self.signatures;
        if signatures
            .timer_key
            .as_ref()
            .is_some_and(|key| key.0.len() < MIN_SIGNING_KEY_BYTES)
        {
            return Err(invalid(
                "signatures.timer_key",
                format!("is shorter than {MIN_SIGNING_KEY_BYTES} bytes"),
            ));
        }
        if signatures.all_inputs && signatures.timer_key.is_none() {
            return Err(invalid(
                "signatures.timer_key",
                "must be set with signatures.all_inputs: timers share the wakeups topic with \
                 signals and cancels, so unsigned ones could be forged by any writer of signals",
            ));
        }
        if signatures.max_age_ms < 1_000 || signatures.max_age_ms >= self.routing.completed_ttl_ms {
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

    /// The bounds of the public API and the signing keys.
    fn validate_limits(&self) -> Result<(), ConfigError> {
        if let Some((tenant, _)) = self
            .signatures
            .tenant_keys
            .iter()
            .find(|(_, key)| key.0.len() < MIN_SIGNING_KEY_BYTES)
        {
            return Err(invalid(
                "signatures.tenant_keys",
                format!(
                    "the key of tenant {tenant:?} is shorter than {MIN_SIGNING_KEY_BYTES} bytes"
                ),
            ));
        }
        if self.database.api_max_connections == 0 {
            return Err(invalid(
                "database.api_max_connections",
                "must be at least 1",
            ));
        }
        for (key, value) in [
            (
                "server.max_concurrent_requests",
                self.server.max_concurrent_requests as u64,
            ),
            (
                "server.requests_per_second",
                u64::from(self.server.requests_per_second),
            ),
            ("server.request_burst", u64::from(self.server.request_burst)),
            (
                "server.auth_failures_per_second",
                u64::from(self.server.auth_failures_per_second),
            ),
            (
                "server.auth_failure_burst",
                u64::from(self.server.auth_failure_burst),
            ),
            ("server.request_timeout_ms", self.server.request_timeout_ms),
            (
                "server.body_read_timeout_ms",
                self.server.body_read_timeout_ms,
            ),
            (
                "server.header_read_timeout_ms",
                self.server.header_read_timeout_ms,
            ),
            (
                "server.tls_check_interval_ms",
                self.server.tls_check_interval_ms,
            ),
            (
                "server.readiness_interval_ms",
                self.server.readiness_interval_ms,
            ),
            (
                "server.readiness_timeout_ms",
                self.server.readiness_timeout_ms,
            ),
            ("server.max_connections", self.server.max_connections as u64),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The database URL and pool.
    fn validate_database(&self) -> Result<(), ConfigError> {
        let postgres = |url: &DatabaseUrl| {
            url::Url::parse(url.expose())
                .is_ok_and(|u| matches!(u.scheme(), "postgres" | "postgresql"))
        };
        if !postgres(&self.database.url) {
            return Err(invalid("database.url", "must be a postgres:// URL"));
        }
        if !self.database.migrate_url.as_ref().is_none_or(postgres) {
            return Err(invalid("database.migrate_url", "must be a postgres:// URL"));
        }
        if !self.database.keys_url.as_ref().is_none_or(postgres) {
            return Err(invalid("database.keys_url", "must be a postgres:// URL"));
        }
        for (key, role) in [
            ("database.app_role", &self.database.app_role),
            ("database.keys_role", &self.database.keys_role),
        ] {
            if let Some(role) = role
                && (role.is_empty() || role.len() > 63)
            {
                return Err(invalid(key, "must be 1 to 63 bytes"));
            }
        }
        if self.database.max_connections == 0 {
            return Err(invalid("database.max_connections", "must be at least 1"));
        }
        if self.database.min_connections > self.database.max_connections {
            return Err(invalid(
                "database.min_connections",
                "must not exceed database.max_connections",
            ));
        }
        Ok(())
    }

    /// Topics, the consumer group, and the producer guarantees no pass-through property may weaken.
    fn validate_kafka(&self) -> Result<(), ConfigError> {
        if self.kafka.bootstrap_servers.trim().is_empty() {
            return Err(invalid("kafka.bootstrap_servers", "must not be empty"));
        }
        if !valid_topic_chars(&self.kafka.topic_prefix) {
            return Err(invalid(
                "kafka.topic_prefix",
                "may contain only ASCII letters, digits, '.', '_' and '-'",
            ));
        }
        if self.kafka.group_id.trim().is_empty() {
            return Err(invalid("kafka.group_id", "must not be empty"));
        }
        if let Some(id) = &self.kafka.group_instance_id
            && (id.is_empty() || id.len() > 249 || !valid_topic_chars(id))
        {
            return Err(invalid(
                "kafka.group_instance_id",
                "must be 1 to 249 ASCII letters, digits, '.', '_' and '-'",
            ));
        }
        if self.kafka.partitions < 1 {
            return Err(invalid("kafka.partitions", "must be at least 1"));
        }
        if self.kafka.replication_factor < 1 {
            return Err(invalid("kafka.replication_factor", "must be at least 1"));
        }
        if let Some(pool) = self
            .kafka
            .step_pools
            .iter()
            .find(|p| p.is_empty() || !valid_topic_chars(p))
        {
            return Err(invalid(
                "kafka.step_pools",
                format!("pool name {pool:?} is not a valid topic suffix"),
            ));
        }
        if let Some(topic) = self
            .kafka
            .extra_topics
            .iter()
            .find(|t| t.is_empty() || !valid_topic_chars(t))
        {
            return Err(invalid(
                "kafka.extra_topics",
                format!("{topic:?} is not a valid topic name"),
            ));
        }
        for (key, props) in [
            ("kafka.properties", &self.kafka.properties),
            ("kafka.producer_properties", &self.kafka.producer_properties),
        ] {
            if let Some(message) = props.weakened_producer_guarantee() {
                return Err(invalid(key, message));
            }
        }
        for (key, props) in [
            ("kafka.properties", &self.kafka.properties),
            ("kafka.consumer_properties", &self.kafka.consumer_properties),
        ] {
            if let Some(message) = props.weakened_consumer_guarantee() {
                return Err(invalid(key, message));
            }
        }
        Ok(())
    }

    /// The apply lanes and the bounds of a batch and of one input.
    fn validate_batches(&self) -> Result<(), ConfigError> {
        if self.coordinator.apply_lanes == 0 || self.coordinator.apply_lanes > 64 {
            return Err(invalid(
                "coordinator.apply_lanes",
                "must be between 1 and 64",
            ));
        }
        if self.coordinator.apply_lanes >= self.database.max_connections as usize {
            return Err(invalid(
                "coordinator.apply_lanes",
                "must be below database.max_connections (each lane holds a connection while it applies)",
            ));
        }
        if self.coordinator.concurrent_batch_min_inputs == 0 {
            return Err(invalid(
                "coordinator.concurrent_batch_min_inputs",
                "must be at least 1",
            ));
        }
        if self.coordinator.batch_max_inputs == 0 || self.coordinator.batch_max_inputs > 10_000 {
            return Err(invalid(
                "coordinator.batch_max_inputs",
                "must be between 1 and 10000",
            ));
        }
        if self.coordinator.batch_max_bytes == 0 {
            return Err(invalid("coordinator.batch_max_bytes", "must be at least 1"));
        }
        if self.coordinator.max_input_bytes == 0 {
            return Err(invalid("coordinator.max_input_bytes", "must be at least 1"));
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

    /// The stall detector, the apply retries and the shape limits of inputs.
    fn validate_inputs(&self) -> Result<(), ConfigError> {
        let c = &self.coordinator;
        if c.stall_after_ms == 0 {
            return Err(invalid("coordinator.stall_after_ms", "must be at least 1"));
        }
        if c.apply_bisect_after_failures == 0 {
            return Err(invalid(
                "coordinator.apply_bisect_after_failures",
                "must be at least 1",
            ));
        }
        if c.apply_retry_min_ms == 0 || c.apply_retry_max_ms < c.apply_retry_min_ms {
            return Err(invalid(
                "coordinator.apply_retry_max_ms",
                "apply_retry_min_ms must be at least 1 and apply_retry_max_ms at least apply_retry_min_ms",
            ));
        }
        if c.max_json_depth == 0 || c.max_json_depth > 128 {
            return Err(invalid(
                "coordinator.max_json_depth",
                "must be between 1 and 128 (the JSON parser's own bound)",
            ));
        }
        for (key, value) in [
            ("coordinator.max_string_bytes", c.max_string_bytes),
            ("coordinator.max_array_items", c.max_array_items),
            ("coordinator.max_object_keys", c.max_object_keys),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.coordinator.max_error_message_bytes < 32 {
            return Err(invalid(
                "coordinator.max_error_message_bytes",
                "must be at least 32",
            ));
        }
        Ok(())
    }

    /// The outbox drainer: its batches, lease, intervals and retention.
    fn validate_drainer(&self) -> Result<(), ConfigError> {
        let d = &self.drainer;
        if d.batch_max_intents == 0 || d.batch_max_intents > 10_000 {
            return Err(invalid(
                "drainer.batch_max_intents",
                "must be between 1 and 10000",
            ));
        }
        if d.lease_ms <= self.kafka.delivery_timeout_ms {
            return Err(invalid(
                "drainer.lease_ms",
                "must exceed kafka.delivery_timeout_ms, or an in-flight publish could be redriven",
            ));
        }
        for (key, value) in [
            ("drainer.poll_interval_ms", d.poll_interval_ms),
            ("drainer.reconcile_interval_ms", d.reconcile_interval_ms),
            ("drainer.heartbeat_interval_ms", d.heartbeat_interval_ms),
            ("drainer.purge_interval_ms", d.purge_interval_ms),
            ("drainer.metrics_interval_ms", d.metrics_interval_ms),
            ("drainer.max_backoff_ms", d.max_backoff_ms),
            ("drainer.publish_retry_min_ms", d.publish_retry_min_ms),
            (
                "drainer.results_frontier_interval_ms",
                d.results_frontier_interval_ms,
            ),
            ("drainer.results_frontier_lag_ms", d.results_frontier_lag_ms),
            (
                "drainer.park_after_failures",
                u64::from(d.park_after_failures),
            ),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if d.member_timeout_ms < 2 * d.heartbeat_interval_ms {
            return Err(invalid(
                "drainer.member_timeout_ms",
                "must be at least twice drainer.heartbeat_interval_ms, or a live drainer could be taken for dead",
            ));
        }
        if d.purge_batch == 0 {
            return Err(invalid("drainer.purge_batch", "must be at least 1"));
        }
        Ok(())
    }

    /// The routing plane: its TTLs, intervals, batches and body bound.
    fn validate_runs(&self) -> Result<(), ConfigError> {
        let r = &self.runs;
        for (key, value) in [
            ("runs.tombstone_retention_ms", r.tombstone_retention_ms),
            ("runs.purge_interval_ms", r.purge_interval_ms),
            ("runs.purge_max_rounds", u64::from(r.purge_max_rounds)),
            ("runs.purge_batch", r.purge_batch as u64),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if r.retention_ms > 0 && r.tombstone_retention_ms < r.retention_ms {
            return Err(invalid(
                "runs.tombstone_retention_ms",
                "must be at least runs.retention_ms: a tombstone outlives its run",
            ));
        }
        Ok(())
    }

    fn validate_routing(&self) -> Result<(), ConfigError> {
        let r = &self.routing;
        for (key, value) in [
            ("routing.pending_ttl_ms", r.pending_ttl_ms),
            ("routing.completed_ttl_ms", r.completed_ttl_ms),
            ("routing.sweep_interval_ms", r.sweep_interval_ms),
            ("routing.purge_interval_ms", r.purge_interval_ms),
            ("routing.wait_timeout_ms", r.wait_timeout_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if r.sweep_batch == 0 || r.purge_batch == 0 {
            return Err(invalid(
                "routing.sweep_batch",
                "sweep_batch and purge_batch must be at least 1",
            ));
        }
        if r.max_body_bytes < 1024 {
            return Err(invalid("routing.max_body_bytes", "must be at least 1024"));
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

    /// Full name of one of Ductor's own topics.
    pub fn topic(&self, suffix: &str) -> String {
        format!("{}{}", self.kafka.topic_prefix, suffix)
    }

    /// The deployment's topic names, under `kafka.topic_prefix`.
    pub fn topic_names(&self) -> TopicNames {
        TopicNames {
            prefix: self.kafka.topic_prefix.clone(),
        }
    }

    pub fn requests_topic(&self) -> String {
        self.topic_names().requests()
    }

    pub fn wakeups_topic(&self) -> String {
        self.topic_names().wakeups()
    }

    pub fn attempt_results_topic(&self) -> String {
        self.topic_names().attempt_results()
    }

    pub fn events_topic(&self) -> String {
        self.topic_names().events()
    }

    pub fn dlq_topic(&self) -> String {
        self.topic_names().dead_letters()
    }

    pub fn steps_topic(&self, pool: &str) -> String {
        self.topic_names().steps(pool)
    }

    /// Every topic `ductor topics create` makes.
    /// The topics the coordinator consumes, which must be co-partitioned.
    pub fn input_topics(&self) -> Vec<String> {
        vec![
            self.requests_topic(),
            self.wakeups_topic(),
            self.attempt_results_topic(),
        ]
    }

    pub fn all_topics(&self) -> Vec<String> {
        let mut topics = vec![
            self.requests_topic(),
            self.wakeups_topic(),
            self.attempt_results_topic(),
            self.events_topic(),
            self.dlq_topic(),
        ];
        topics.extend(self.kafka.step_pools.iter().map(|p| self.steps_topic(p)));
        topics.extend(self.kafka.extra_topics.iter().cloned());
        topics.sort();
        topics.dedup();
        topics
    }
}

/// A certificate without its key, or a key without its certificate, is
/// refused, naming the one that is missing.
fn both_or_neither(
    cert: (&'static str, &Option<PathBuf>),
    key: (&'static str, &Option<PathBuf>),
) -> Result<(), ConfigError> {
    match (cert.1, key.1) {
        (Some(_), None) => Err(invalid(
            key.0,
            format!("must be set with {} (both or neither)", cert.0),
        )),
        (None, Some(_)) => Err(invalid(
            cert.0,
            format!("must be set with {} (both or neither)", key.0),
        )),
        _ => Ok(()),
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

fn valid_topic_chars(s: &str) -> bool {
    s.len() <= 200
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

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

/// A Postgres URL whose password never reaches `Debug` or `Display`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL with its password, for connecting. Never log this.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The role this URL logs in as, decoded (libpq's default when the URL
    /// names none); `None` for a URL that does not parse.
    pub fn user(&self) -> Option<String> {
        let options: sqlx::postgres::PgConnectOptions = self.0.parse().ok()?;
        Some(options.get_username().to_owned())
    }

    /// The URL with the password replaced, safe to log: the one after
    /// the user name, and a `password` query parameter (which sqlx
    /// accepts too).
    pub fn redacted(&self) -> String {
        let Ok(mut u) = url::Url::parse(&self.0) else {
            return "[unparseable url redacted]".to_string();
        };
        if u.password().is_some() {
            let _ = u.set_password(Some("[redacted]"));
        }
        if u.query_pairs().any(|(key, _)| key == "password") {
            let pairs: Vec<(String, String)> = u
                .query_pairs()
                .map(|(key, value)| {
                    let value = if key == "password" {
                        "[redacted]".into()
                    } else {
                        value.into_owned()
                    };
                    (key.into_owned(), value)
                })
                .collect();
            u.query_pairs_mut().clear().extend_pairs(pairs);
        }
        u.to_string()
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// librdkafka properties passed through verbatim. `Debug` redacts values of
/// keys that carry credentials.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KafkaProperties(pub BTreeMap<String, String>);

impl KafkaProperties {
    pub fn is_secret_key(key: &str) -> bool {
        let key = key.to_ascii_lowercase();
        [
            "password",
            "secret",
            "jaas",
            "token",
            "ssl.key.pem",
            "private",
        ]
        .iter()
        .any(|needle| key.contains(needle))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter()
    }

    /// Why these properties would change a producer setting that the outbox
    /// relies on ([`PRODUCER_GUARANTEES`]), if they do. A
    /// delivery report is what marks an effect completed, so a producer that
    /// may report a message delivered that is not in the log (without
    /// idempotence, with `acks` below `all`, or with more than one request in
    /// flight) would lose effects. librdkafka's aliases count as the keys
    /// they stand for; stating Ductor's own value is allowed.
    pub fn weakened_producer_guarantee(&self) -> Option<String> {
        self.0.iter().find_map(|(key, value)| {
            let name = match key.trim() {
                "request.required.acks" => "acks",
                "max.in.flight" => "max.in.flight.requests.per.connection",
                other => other,
            };
            let (name, required) = PRODUCER_GUARANTEES
                .into_iter()
                .find(|(guarded, _)| *guarded == name)?;
            let same = value.trim() == required || (name == "acks" && value.trim() == "-1");
            (!same).then(|| {
                format!(
                    "sets {key:?} = {value:?}, but Ductor's producers need {name} = {required}: \
                     an effect is marked completed on its delivery report, and with this \
                     setting a report may claim a message the log does not hold"
                )
            })
        })
    }
}

impl KafkaProperties {
    /// Why these properties would change a consumer setting that the
    /// single writer or exactly-once rests on ([`CONSUMER_GUARANTEES`]), if
    /// they do. Stating Ductor's own value is allowed; `group.remote.assignor`
    /// is refused whatever its value, since it only means something under
    /// the consumer protocol.
    pub fn weakened_consumer_guarantee(&self) -> Option<String> {
        self.0.iter().find_map(|(key, value)| {
            let name = key.trim();
            if name == "group.remote.assignor" {
                return Some(format!(
                    "sets {key:?}: the ingress's group uses the classic protocol with the range \
                     assignor, which gives partition p of every input topic to one process, so \
                     that each run has one writer; a broker-side assignor would not"
                ));
            }
            let (name, required) = CONSUMER_GUARANTEES
                .into_iter()
                .find(|(guarded, _)| *guarded == name)?;
            let same = value.trim().eq_ignore_ascii_case(required);
            (!same).then(|| {
                format!(
                    "sets {key:?} = {value:?}, but the ingress needs {name} = {required}: {}",
                    consumer_guarantee_reason(name)
                )
            })
        })
    }
}

/// What breaks when the consumer setting `name` changes.
fn consumer_guarantee_reason(name: &str) -> &'static str {
    match name {
        "enable.auto.offset.store" => {
            "an offset is stored only after the transaction that applied its input has \
             committed; stored automatically, a crash would skip inputs never applied"
        }
        "isolation.level" => {
            "inputs written in a producer transaction that was aborted must never be applied"
        }
        _ => {
            "partition p of every input topic goes to one process (the range assignor over \
             the classic group protocol), so that each run has one writer; another assignor \
             may give a run's inputs to two processes"
        }
    }
}

impl fmt::Debug for KafkaProperties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (k, v) in &self.0 {
            if Self::is_secret_key(k) {
                map.entry(k, &"[redacted]");
            } else {
                map.entry(k, v);
            }
        }
        map.finish()
    }
}
