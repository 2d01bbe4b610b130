//! Shared fixtures for integration tests against the real Postgres and Kafka
//! started by `scripts/stack`. Each test gets its own database and randomly
//! named topics, so tests run in parallel without seeing each other.

#![allow(dead_code)]

use std::time::Duration;

use ductor::config::{Config, KafkaConfig};
use ductor_testkit::scratch::{ScratchDatabase, ScratchTopics};
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// The application role's URL (`serve`'s), on the stack's database.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .expect("DATABASE_URL is not set: run the tests through scripts/test (or eval \"$(scripts/stack env)\")")
}

/// The migrator's URL, on the stack's database: the role that creates the
/// tests' databases, owns them and migrates them.
pub fn migrate_url() -> String {
    std::env::var("DATABASE_MIGRATE_URL").expect(
        "DATABASE_MIGRATE_URL is not set: run the tests through scripts/test (or eval \"$(scripts/stack env)\")",
    )
}

/// The keys role's URL (`ductor keys`'), on the stack's database.
pub fn keys_url() -> String {
    std::env::var("DATABASE_KEYS_URL").expect(
        "DATABASE_KEYS_URL is not set: run the tests through scripts/test (or eval \"$(scripts/stack env)\")",
    )
}

pub fn bootstrap_servers() -> String {
    std::env::var("KAFKA_BOOTSTRAP_SERVERS").expect(
        "KAFKA_BOOTSTRAP_SERVERS is not set: run the tests through scripts/test (or eval \"$(scripts/stack env)\")",
    )
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

/// A fresh database on the test server, dropped by [`TestDb::drop_db`]
/// together with the topics of every [`test_config`] made for it. It
/// belongs to the migrator; `url` and `pool` are the application role's,
/// and `keys_url` and `keys` the keys role's, each with only the rights
/// `ductor migrate` grants, so every test runs Ductor under least
/// privilege. What needs the owner's rights (DDL, ANALYZE, a migration,
/// setting rows up the way no role of Ductor may) goes through `owner`.
pub struct TestDb {
    pub name: String,
    /// The application role's URL on this database.
    pub url: String,
    /// A pool of the application role.
    pub pool: PgPool,
    /// The keys role's URL on this database.
    pub keys_url: String,
    /// A pool of the keys role, which connects on first use.
    pub keys: PgPool,
    /// The migrator's URL on this database.
    pub owner_url: String,
    /// A pool of the migrator, the owner of the database and its schema.
    pub owner: PgPool,
    scratch: ScratchDatabase,
    topics: ScratchTopics,
}

impl TestDb {
    /// An empty database, without migrations.
    pub async fn empty() -> TestDb {
        let scratch = ScratchDatabase::create(&migrate_url(), "ductor_test_")
            .await
            .expect("creating the test database");
        let on_scratch = |url: String| scratch.url_for(&url).expect("the stack's URLs parse");
        let url = on_scratch(database_url());
        let owner_url = on_scratch(migrate_url());
        let keys_url = on_scratch(keys_url());
        let connect = |url: String, connections: u32| async move {
            PgPoolOptions::new()
                .max_connections(connections)
                .connect(&url)
                .await
                .expect("connecting to the test database")
        };
        TestDb {
            pool: connect(url.clone(), 8).await,
            // The owner's statements are few: set-up and the odd DDL.
            owner: connect(owner_url.clone(), 2).await,
            // Few tests make keys: no connection until one does.
            keys: PgPoolOptions::new()
                .max_connections(2)
                .connect_lazy(&keys_url)
                .expect("the keys role's URL parses"),
            keys_url,
            name: scratch.name.clone(),
            url,
            owner_url,
            scratch,
            topics: ScratchTopics::default(),
        }
    }

    /// A fresh database with Ductor's migrations applied by the migrator,
    /// and the application role granted its rights, as `ductor migrate`
    /// leaves it.
    pub async fn migrated() -> TestDb {
        let db = TestDb::empty().await;
        db.migrate().await;
        db
    }

    /// Applies the migrations as the owner and grants the application role
    /// and the keys role their rights.
    pub async fn migrate(&self) {
        ductor::infra::db::migrate(&self.owner)
            .await
            .expect("migrating");
        let role = ductor::config::DatabaseUrl::new(database_url())
            .user()
            .expect("DATABASE_URL names a role");
        ductor::infra::db::grant_app_role(&self.owner, &role)
            .await
            .expect("granting the application role its rights");
        let keys_role = ductor::config::DatabaseUrl::new(keys_url())
            .user()
            .expect("DATABASE_KEYS_URL names a role");
        ductor::infra::db::grant_keys_role(&self.owner, &keys_role)
            .await
            .expect("granting the keys role its rights");
    }

    /// Grants the application role the rows of `table`, one the owner
    /// made for a test: the way a consumer that shares the database and
    /// its roles grants its own tables (Ductor's grants cover only
    /// Ductor's tables, and no table gets anything by default).
    pub async fn grant_rows(&self, table: &str) {
        let role = ductor::config::DatabaseUrl::new(database_url())
            .user()
            .expect("DATABASE_URL names a role");
        sqlx::raw_sql(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO \"{role}\""
        ))
        .execute(&self.owner)
        .await
        .expect("granting a test table's rows");
    }

    /// Adds `topics` to those [`TestDb::drop_db`] deletes, for a test that
    /// builds its configuration itself.
    pub fn owns_topics(&self, topics: impl IntoIterator<Item = String>) {
        self.topics.own(topics);
    }

    /// Drops the database and deletes the topics of the test's
    /// configurations, so that a test run leaves the broker as it found it.
    pub async fn drop_db(self) {
        if let Err(e) = self.topics.delete(&kafka_config()).await {
            eprintln!("test topics were not deleted: {e:#}");
        }
        self.pool.close().await;
        self.keys.close().await;
        self.owner.close().await;
        self.scratch.drop().await.expect("dropping test database");
    }

    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&self.pool)
            .await
            .expect("counting rows")
    }
}

/// A configuration pointing at the test stack, with a private topic prefix,
/// consumer group and database.
pub fn test_config(db: &TestDb) -> Config {
    let prefix = unique("t").chars().take(13).collect::<String>();
    let env = vec![
        ("DATABASE_URL".to_string(), db.url.clone()),
        ("DATABASE_MIGRATE_URL".to_string(), db.owner_url.clone()),
        ("DATABASE_KEYS_URL".to_string(), db.keys_url.clone()),
        ("KAFKA_BOOTSTRAP_SERVERS".to_string(), bootstrap_servers()),
        (
            "DUCTOR__KAFKA__TOPIC_PREFIX".to_string(),
            format!("{prefix}."),
        ),
        (
            "DUCTOR__KAFKA__GROUP_ID".to_string(),
            format!("{prefix}-coordinator"),
        ),
        ("DUCTOR__KAFKA__PARTITIONS".to_string(), "3".to_string()),
        (
            "DUCTOR__KAFKA__EXTRA_TOPICS".to_string(),
            format!("[\"{prefix}.outputs\"]"),
        ),
        (
            "DUCTOR__SERVER__LISTEN".to_string(),
            "127.0.0.1:0".to_string(),
        ),
        (
            "DUCTOR__SERVER__ADMIN_LISTEN".to_string(),
            "127.0.0.1:0".to_string(),
        ),
        (
            "DUCTOR__COORDINATOR__WORKFLOWS_DIR".to_string(),
            workspace_dir()
                .join("config/workflows")
                .display()
                .to_string(),
        ),
    ];
    let config = Config::load_from(None, env).expect("test configuration is valid");
    db.owns_topics(config.all_topics());
    config
}

/// Deletes a passing test's topics. A topic that cannot be deleted is
/// reported, not failed on: the test itself has passed by now.
pub async fn delete_test_topics(topics: &[String]) {
    if !topics.is_empty()
        && let Err(e) = ductor::infra::kafka::delete_topics(&kafka_config(), topics).await
    {
        eprintln!("test topics {topics:?} were not deleted: {e:#}");
    }
}

/// A new id with `prefix` that murmur2 puts on the same partition as
/// `key` among `partitions`: a run whose inputs share a partition with
/// messages keyed `key` (the ingress forwards an input that is not on its
/// run's partition; see `ductor::contract::partition`).
#[allow(dead_code)] // each test binary uses some of them
pub fn id_beside(key: &str, prefix: &str, partitions: i32) -> String {
    use ductor::contract::partition::partition_for;
    let home = partition_for(key.as_bytes(), partitions);
    loop {
        let id = unique(prefix);
        if partition_for(id.as_bytes(), partitions) == home {
            return id;
        }
    }
}

pub fn kafka_config() -> KafkaConfig {
    let db_less = Config::load_from(
        None,
        vec![("KAFKA_BOOTSTRAP_SERVERS".to_string(), bootstrap_servers())],
    )
    .expect("default configuration is valid");
    db_less.kafka
}

pub fn producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "0")
        .set("partitioner", ductor::contract::partition::PARTITIONER)
        .create()
        .expect("creating test producer")
}

pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    payload: &[u8],
    headers: &[(&str, &str)],
) -> (i32, i64) {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    let delivery = producer
        .send(
            FutureRecord::to(topic).key(key).payload(payload).headers(h),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("producing test message");
    (delivery.partition, delivery.offset)
}

/// A consumer reading `topics` from the beginning, in its own group.
pub fn reader(topics: &[&str]) -> StreamConsumer {
    let consumer: StreamConsumer =
        ductor_testkit::kafka::reader_config(&kafka_config(), &unique("reader-"), "test-reader")
            .create()
            .expect("creating test reader");
    consumer.subscribe(topics).expect("subscribing test reader");
    consumer
}

/// A record Ductor published, checked against the contract's schemas
/// (`ductor_testkit::schemas::check_published`): every message a test
/// reads is.
pub fn on_contract(m: OwnedMessage) -> OwnedMessage {
    use rdkafka::message::{Headers, Message};
    let headers: Vec<(String, Vec<u8>)> = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default();
    if let Err(e) =
        ductor_testkit::schemas::check_published(&headers, m.payload().unwrap_or_default())
    {
        panic!(
            "{} [{}] @{} is off the contract: {e}",
            m.topic(),
            m.partition(),
            m.offset()
        );
    }
    m
}

/// Reads until `n` messages have arrived, each checked by [`on_contract`],
/// or panics after `timeout`.
pub async fn read_n(consumer: &StreamConsumer, n: usize, timeout: Duration) -> Vec<OwnedMessage> {
    let mut out = Vec::with_capacity(n);
    let deadline = tokio::time::Instant::now() + timeout;
    while out.len() < n {
        match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Ok(Ok(m)) => out.push(on_contract(m.detach())),
            Ok(Err(e)) => panic!("consumer error: {e}"),
            Err(_) => panic!(
                "timed out after {timeout:?} with {} of {n} messages",
                out.len()
            ),
        }
    }
    out
}

/// Polls `check` until it returns `Some`, or panics after `timeout`. For
/// waiting on durable state that another task is producing.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One HTTP/1.1 request over a fresh connection (see
/// [`ductor_testkit::http`]); returns status and body, and panics when
/// there is no answer within a minute.
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Vec<u8>) {
    let timeout = Duration::from_secs(60);
    ductor_testkit::http::request(addr, method, path, headers, body, timeout)
        .await
        .unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e:#}"))
}

/// The text of the `/metrics` of the listener `addr`, asked with `headers`.
pub async fn scrape(addr: std::net::SocketAddr, headers: &[(&str, &str)]) -> String {
    let (status, body) = http(addr, "GET", "/metrics", headers, b"").await;
    assert_eq!(status, 200, "GET /metrics on {addr}");
    String::from_utf8(body).expect("the metrics are text")
}

/// The sum of the series of the metric `name` that contain `label` (`""`:
/// all), on the listener `addr`; 0 while it has none.
pub async fn metric(
    addr: std::net::SocketAddr,
    headers: &[(&str, &str)],
    name: &str,
    label: &str,
) -> f64 {
    ductor_testkit::metrics::sum(&scrape(addr, headers).await, name, label)
}

/// The offset the consumer group `group` has committed on one partition
/// (-1 when none). Blocking: call it from `spawn_blocking`.
pub fn committed_offset(group: &str, topic: &str, partition: i32) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("creating offset probe");
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("fetching committed offsets");
    match committed
        .find_partition(topic, partition)
        .map(|p| p.offset())
    {
        Some(rdkafka::Offset::Offset(o)) => o,
        _ => -1,
    }
}

/// [`committed_offset`], off the runtime's threads.
pub async fn committed(group: &str, topic: &str, partition: i32) -> i64 {
    let (group, topic) = (group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || committed_offset(&group, &topic, partition))
        .await
        .expect("the offset probe panicked")
}

/// Waits until `group` has committed an offset past `offset` of
/// `topic`/`partition`: every message up to it is handled.
pub async fn committed_past(what: &str, group: &str, topic: &str, partition: i32, offset: i64) {
    eventually(what, Duration::from_secs(60), || async {
        (committed(group, topic, partition).await > offset).then_some(())
    })
    .await;
}

/// Sets a topic's `max.message.bytes` and waits until the broker answers
/// with the new value (it applies an alteration a moment after accepting it).
pub async fn set_topic_limit(kafka: &KafkaConfig, topic: &str, bytes: u64) {
    use rdkafka::admin::{AdminOptions, AlterConfig, ResourceSpecifier};
    let admin = ductor::infra::kafka::admin(kafka).unwrap();
    let value = bytes.to_string();
    let alter = AlterConfig::new(ResourceSpecifier::Topic(topic)).set("max.message.bytes", &value);
    let altered = admin
        .alter_configs([&alter], &AdminOptions::new())
        .await
        .expect("altering a topic's configuration");
    assert!(altered.iter().all(Result::is_ok), "{altered:?}");
    eventually(
        &format!("{topic} takes {bytes}"),
        Duration::from_secs(60),
        || async {
            let described = admin
                .describe_configs([&ResourceSpecifier::Topic(topic)], &AdminOptions::new())
                .await
                .ok()?;
            let current = described
                .first()?
                .as_ref()
                .ok()?
                .get("max.message.bytes")?
                .value
                .clone()?;
            (current == value).then_some(())
        },
    )
    .await;
}

#[allow(unused_imports)] // each test binary uses some of them
pub use ductor_testkit::programs::{ductor_bin, example_bin, workspace_dir};

/// The example worker as a process on `config`'s database, broker, topics
/// and group, killed when dropped; the caller adds its arguments and
/// spawns it.
pub fn example_worker(config: &Config) -> tokio::process::Command {
    let mut worker = tokio::process::Command::new(example_bin("worker"));
    worker
        .current_dir(workspace_dir())
        .env("DATABASE_URL", config.database.url.expose())
        .env("KAFKA_BOOTSTRAP_SERVERS", &config.kafka.bootstrap_servers)
        .env("DUCTOR__KAFKA__TOPIC_PREFIX", &config.kafka.topic_prefix)
        .env("DUCTOR__KAFKA__GROUP_ID", &config.kafka.group_id)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    worker
}

/// A fresh API key of `tenant` with `scopes`, stored in `db` as `ductor
/// keys create` stores it (as the keys role); its token.
pub async fn api_key(db: &TestDb, tenant: &str, scopes: &[ductor::auth::Scope]) -> String {
    let new = ductor::auth::key::generate().expect("reading the random source");
    let request = ductor::auth::store::KeyRequest {
        tenant: tenant.into(),
        scopes: scopes.to_vec(),
        label: None,
        requests_per_second: None,
        expires_at: None,
    };
    ductor::auth::store::insert(&db.keys, &new, &request)
        .await
        .expect("storing an API key");
    new.token
}

/// The `Authorization` header of a request made with `token`.
pub fn bearer(token: &str) -> (&'static str, String) {
    ("Authorization", format!("Bearer {token}"))
}

#[allow(unused_imports)] // each test binary uses some of them
pub use ductor_testkit::serve::Running;

/// How long [`Serve::answer`] and [`Serve::settle`] wait for a run.
const ANSWER_WAIT: Duration = Duration::from_secs(60);

/// `serve` in this process over a migrated database of its own and its
/// topics, for the tests that talk to its listeners. Without a drainer
/// unless `tweak` turns it on: most of them look at runs, not at effects.
pub struct Serve {
    pub db: TestDb,
    pub config: Config,
    /// The public listener.
    pub addr: std::net::SocketAddr,
    /// The admin listener.
    pub admin: std::net::SocketAddr,
    running: Running,
}

impl Serve {
    /// Starts it with the test configuration changed by `tweak`; returns
    /// once it is ready.
    pub async fn start(tweak: impl FnOnce(&mut Config)) -> Serve {
        let db = TestDb::migrated().await;
        let mut config = test_config(&db);
        config.drainer.enabled = false;
        tweak(&mut config);
        ductor::infra::kafka::create_configured_topics(&config)
            .await
            .expect("creating topics");
        let running = Running::start(&config).await;
        Serve {
            db,
            config,
            addr: running.addr,
            admin: running.admin,
            running,
        }
    }

    /// Starts a run as a tenant's client does, `POST /v1/runs` with
    /// `token` and `body`, expecting it started: its id.
    pub async fn start_run_with(&self, token: &str, body: &serde_json::Value) -> String {
        let auth = bearer(token);
        let headers = [
            (auth.0, auth.1.as_str()),
            ("Content-Type", "application/json"),
        ];
        let bytes = body.to_string().into_bytes();
        let (status, raw) = http(self.addr, "POST", "/v1/runs", &headers, &bytes).await;
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&raw));
        let decision: serde_json::Value = serde_json::from_slice(&raw).expect("a decision");
        decision["run_id"].as_str().expect("its run id").to_owned()
    }

    /// Answers `run_id`'s step `step` as a worker does, once the attempt
    /// is dispatched (attempt `attempt`, or whichever is outstanding when
    /// `None`), with `outcome`: the fields of an `attempt.result` after
    /// its stamp.
    pub async fn answer(
        &self,
        producer: &FutureProducer,
        (run_id, tenant): (&str, &str),
        (step, attempt): (i32, Option<i32>),
        outcome: serde_json::Value,
    ) {
        let stamp: uuid::Uuid = eventually("the attempt is dispatched", ANSWER_WAIT, || async {
            sqlx::query_scalar(
                "SELECT stamp FROM run_attempts WHERE run_id = $1 AND step_index = $2 \
                 AND ($3::int IS NULL OR attempt = $3) AND status = 'dispatched'",
            )
            .bind(run_id)
            .bind(step)
            .bind(attempt)
            .fetch_optional(&self.db.pool)
            .await
            .expect("querying attempts")
        })
        .await;
        let mut value = serde_json::json!({"type": "attempt.result", "schema_version": 1,
            "run_id": run_id, "tenant": tenant, "stamp": stamp});
        for (k, v) in outcome.as_object().expect("an outcome's fields") {
            value[k] = v.clone();
        }
        let topic = self.config.topic_names().attempt_results();
        produce(producer, &topic, run_id, value.to_string().as_bytes(), &[]).await;
    }

    /// The run's status as stored.
    pub async fn status_of(&self, run_id: &str) -> String {
        sqlx::query_scalar("SELECT status FROM runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(&self.db.pool)
            .await
            .expect("reading a run's status")
    }

    /// Waits until the run's status is `status`.
    pub async fn settle(&self, run_id: &str, status: &str) {
        eventually(&format!("{run_id} is {status}"), ANSWER_WAIT, || async {
            (self.status_of(run_id).await == status).then_some(())
        })
        .await;
    }

    /// Stops it, expecting a clean stop, and drops its database and topics.
    pub async fn stop(self) {
        self.running.stop().await;
        self.db.drop_db().await;
    }
}

/// How long one turn of a stepped ingress waits for a first message.
pub const INGRESS_STEP_WAIT: Duration = Duration::from_millis(500);

/// Steps `ingress` (subscribed by [`ductor::ingress::subscribe`]) one batch
/// at a time until its batches have held every message of `sent` (partition
/// and offset on `topic`), and returns what those batches did, added up.
/// The first turns find nothing while the consumer joins its group; panics
/// with the reports so far after `timeout`, or when a turn fails.
pub async fn step_through(
    ingress: &ductor::ingress::IngressContext,
    topic: &str,
    sent: &[(i32, i64)],
    timeout: Duration,
) -> ductor::ingress::StepReport {
    let deadline = tokio::time::Instant::now() + timeout;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut total = ductor::ingress::StepReport::default();
    let mut reports = Vec::new();
    while !sent
        .iter()
        .all(|(partition, offset)| total.covers(topic, *partition, *offset))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the batches did not hold {topic} {sent:?} within {timeout:?}: {reports:?}"
        );
        let stepped = ductor::ingress::step(ingress, INGRESS_STEP_WAIT, &shutdown)
            .await
            .expect("stepping the ingress");
        let Some(report) = stepped else { continue };
        add_report(&mut total, &report);
        reports.push(report);
    }
    total
}

/// Adds `report` to `sum`: counts added, the last offsets the greater.
pub fn add_report(sum: &mut ductor::ingress::StepReport, report: &ductor::ingress::StepReport) {
    sum.messages += report.messages;
    sum.applied += report.applied;
    sum.no_ops += report.no_ops;
    sum.rejected += report.rejected;
    sum.failed += report.failed;
    sum.undecodable += report.undecodable;
    sum.conflicts += report.conflicts;
    sum.intents_written += report.intents_written;
    sum.parked += report.parked;
    sum.forwarded += report.forwarded;
    for (at, last) in &report.last_offsets {
        let entry = sum.last_offsets.entry(at.clone()).or_insert(*last);
        *entry = (*entry).max(*last);
    }
}

/// The stamp of `run_id`'s dispatched attempt of step `step_index`, if a
/// committed batch has dispatched it.
pub async fn dispatched_attempt(
    pool: &PgPool,
    run_id: &str,
    step_index: i32,
) -> Option<uuid::Uuid> {
    sqlx::query_scalar(
        "SELECT stamp FROM run_attempts \
         WHERE run_id = $1 AND step_index = $2 AND status = 'dispatched'",
    )
    .bind(run_id)
    .bind(step_index)
    .fetch_optional(pool)
    .await
    .expect("querying attempts")
}
