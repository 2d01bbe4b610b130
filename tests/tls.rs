//! Ductor over TLS to Postgres and over SASL/SCRAM to Kafka, against the real
//! servers of `scripts/stack`: a role that Postgres admits over TLS only
//! (`ductor_tls`, with the application role's rights), verified against the
//! stack's CA with `sslmode=verify-full`, and the broker's SASL_PLAINTEXT
//! and SASL_SSL listeners with a SCRAM-SHA-512 user, configured through
//! `kafka.properties`.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use ductor::auth::Scope;
use ductor::config::{Config, DatabaseUrl, KafkaConfig, KafkaProperties};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// A setting `scripts/stack env` prints for these tests.
fn stack_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: start the stack with `scripts/stack up` and \
             eval \"$(scripts/stack env)\" (scripts/test does both)"
        )
    })
}

/// The TLS role's URL on database `name`, with `sslmode` and, if given,
/// `sslrootcert` in place of the stack's.
fn tls_url(name: &str, sslmode: &str, ca: Option<&str>) -> String {
    let mut url = url::Url::parse(&stack_env("DUCTOR_TEST_TLS_DATABASE_URL"))
        .expect("DUCTOR_TEST_TLS_DATABASE_URL is a URL");
    url.set_path(&format!("/{name}"));
    let ca = ca.map_or_else(|| stack_env("DUCTOR_TEST_PG_CA"), str::to_owned);
    url.query_pairs_mut()
        .clear()
        .append_pair("sslmode", sslmode)
        .append_pair("sslrootcert", &ca);
    url.to_string()
}

/// The broker's two SCRAM listeners.
#[derive(Debug, Clone, Copy)]
enum Listener {
    SaslPlaintext,
    /// SCRAM over TLS, the broker verified against the stack's CA.
    SaslSsl,
}

/// The librdkafka properties of `listener`, with `password`.
fn sasl_properties(listener: Listener, password: &str) -> KafkaProperties {
    let mut properties = BTreeMap::from([
        ("security.protocol".into(), "SASL_PLAINTEXT".into()),
        (
            "sasl.mechanism".into(),
            stack_env("DUCTOR_TEST_KAFKA_SASL_MECHANISM"),
        ),
        (
            "sasl.username".into(),
            stack_env("DUCTOR_TEST_KAFKA_SASL_USERNAME"),
        ),
        ("sasl.password".into(), password.into()),
    ]);
    if let Listener::SaslSsl = listener {
        properties.insert("security.protocol".into(), "SASL_SSL".into());
        properties.insert("ssl.ca.location".into(), stack_env("DUCTOR_TEST_KAFKA_CA"));
    }
    KafkaProperties(properties)
}

/// `kafka` pointed at `listener`, authenticating with `password`.
fn over_sasl(kafka: &mut KafkaConfig, listener: Listener, password: &str) {
    kafka.bootstrap_servers = stack_env(match listener {
        Listener::SaslPlaintext => "DUCTOR_TEST_KAFKA_SASL_SERVERS",
        Listener::SaslSsl => "DUCTOR_TEST_KAFKA_SASL_SSL_SERVERS",
    });
    kafka.properties = sasl_properties(listener, password);
}

/// What librdkafka reports while a client with `kafka`'s settings asks
/// for metadata, which must fail, until it reports a SASL
/// authentication error (or has been given 5 s to).
async fn refusal(kafka: &KafkaConfig) -> Vec<String> {
    let consumer: BaseConsumer<ErrorLog> =
        ductor::infra::kafka::offsets_reader_config(kafka, &unique("tls-wrong-"), "tls-test")
            .create_with_context(ErrorLog::default())
            .unwrap();
    tokio::task::spawn_blocking(move || {
        let refused = consumer.fetch_metadata(None, Duration::from_secs(10));
        assert!(refused.is_err(), "metadata with a wrong password");
        let said = |c: &BaseConsumer<ErrorLog>| {
            let log = c.context().0.lock().unwrap();
            log.iter().any(|e| e.contains("SASL authentication error"))
        };
        // Errors reach the context as the client is polled.
        for _ in 0..50 {
            if said(&consumer) {
                break;
            }
            let _ = consumer.poll(Duration::from_millis(100));
        }
        consumer.context().0.lock().unwrap().clone()
    })
    .await
    .unwrap()
}

/// A reader of `topic` from its start, through the SCRAM listener `kafka` names.
fn sasl_reader(kafka: &KafkaConfig, topic: &str) -> StreamConsumer {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &kafka.bootstrap_servers)
        .set("group.id", unique("tls-reader-"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false");
    for (key, value) in kafka.properties.iter() {
        cfg.set(key, value);
    }
    let consumer: StreamConsumer = cfg.create().expect("creating the SASL reader");
    consumer.subscribe(&[topic]).expect("subscribing");
    consumer
}

/// The errors librdkafka reports to a client's context.
#[derive(Default)]
struct ErrorLog(std::sync::Mutex<Vec<String>>);

impl rdkafka::ClientContext for ErrorLog {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.0.lock().unwrap().push(format!("{error}: {reason}"));
    }

    fn log(&self, _level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        self.0
            .lock()
            .unwrap()
            .push(format!("{facility}: {message}"));
    }
}

impl rdkafka::consumer::ConsumerContext for ErrorLog {}

/// The error of connecting to `url` with Ductor's pool.
async fn connect_error(url: String) -> String {
    let mut config = Config::load_from(None, vec![("DATABASE_URL".to_string(), url.clone())])
        .expect("a valid configuration")
        .database;
    config.acquire_timeout_ms = 10_000;
    match ductor::infra::db::connect(&config).await {
        Ok(_) => panic!("connected with {url}"),
        Err(e) => format!("{e:#}"),
    }
}

/// An API key of `tenant`, as `ductor keys create` makes it.
async fn api_key(db: &TestDb, tenant: &str) -> String {
    let new = ductor::auth::key::generate().expect("reading the random source");
    let request = ductor::auth::store::KeyRequest {
        tenant: tenant.into(),
        scopes: vec![Scope::RunsWrite, Scope::RunsRead],
        label: None,
        requests_per_second: None,
        expires_at: None,
    };
    ductor::auth::store::insert(&db.keys, &new, &request)
        .await
        .expect("storing an API key");
    new.token
}

/// The done-when of TLS and authentication: `serve` with its database over
/// verified TLS and every Kafka client on the SCRAM listener over TLS (SASL_SSL) starts, is
/// ready, takes a run over the API, applies it and publishes its first
/// step's dispatch.
#[tokio::test]
async fn serve_runs_a_workflow_over_verified_tls_postgres_and_scram_kafka() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    config.database.url = DatabaseUrl::new(tls_url(&db.name, "verify-full", None));
    // Nothing of serve's may fall back to the plain-text roles.
    config.database.migrate_url = None;
    over_sasl(
        &mut config.kafka,
        Listener::SaslSsl,
        &stack_env("DUCTOR_TEST_KAFKA_SASL_PASSWORD"),
    );
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating the topics through the SCRAM listener");
    // Returns once serve's verdict is ready: over TLS and SCRAM alone.
    let serve = Running::start(&config).await;
    let (public, admin) = (serve.addr, serve.admin);
    let (status, ready) = http(admin, "GET", "/readyz", &[], b"").await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&ready));
    let ready: serde_json::Value = serde_json::from_slice(&ready).unwrap();
    for check in ["postgres", "kafka", "ingress"] {
        assert_eq!(ready[check]["ok"], true, "{check}: {ready}");
    }

    let token = api_key(&db, "acme").await;
    let auth = format!("Bearer {token}");
    let body = json!({"workflow": "example"}).to_string();
    let (status, answer) = http(
        public,
        "POST",
        "/v1/runs",
        &[("Authorization", &auth)],
        body.as_bytes(),
    )
    .await;
    let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(status, 201, "{answer}");
    let run_id = answer["run_id"].as_str().unwrap().to_string();
    eventually("the run is applied", WAIT, || async {
        let status: Option<String> =
            sqlx::query_scalar("SELECT status FROM runs WHERE run_id = $1")
                .bind(&run_id)
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        (status.as_deref() == Some("running")).then_some(())
    })
    .await;
    let dispatch = read_n(
        &sasl_reader(&config.kafka, &config.topic_names().steps("default")),
        1,
        WAIT,
    )
    .await;
    let payload = String::from_utf8_lossy(rdkafka::Message::payload(&dispatch[0]).unwrap());
    assert!(payload.contains(&run_id), "{payload}");

    // Every session serve holds is the TLS role's, encrypted. (Asked as the
    // migrator, who may see the TLS role's sessions.)
    let sessions: Vec<(String, bool)> = sqlx::query_as(
        "SELECT a.usename::text, s.ssl FROM pg_stat_activity a \
         JOIN pg_stat_ssl s USING (pid) WHERE a.datname = $1 AND a.application_name LIKE 'ductor%'",
    )
    .bind(&db.name)
    .fetch_all(&db.owner)
    .await
    .unwrap();
    assert!(!sessions.is_empty());
    for (role, ssl) in &sessions {
        assert_eq!((role.as_str(), *ssl), ("ductor_tls", true), "{sessions:?}");
    }

    serve.stop().await;
    db.drop_db().await;
}

/// The TLS role gets in over TLS only, and `verify-full` refuses a server
/// whose certificate does not chain to the CA it was given.
#[tokio::test]
async fn postgres_takes_the_tls_role_over_verified_tls_only() {
    let name = "ductor";
    let refused = connect_error(tls_url(name, "disable", None)).await;
    assert!(
        refused.contains("pg_hba.conf rejects") && refused.contains("no encryption"),
        "{refused}"
    );

    let dir = tempfile::tempdir().unwrap();
    let other_ca = dir.path().join("other-ca.pem");
    let made = std::process::Command::new("openssl")
        .args(["req", "-x509", "-new", "-noenc", "-newkey", "ec"])
        .args(["-pkeyopt", "ec_paramgen_curve:prime256v1", "-days", "1"])
        .args(["-subj", "/CN=not the stack's CA", "-keyout"])
        .arg(dir.path().join("other-ca.key"))
        .arg("-out")
        .arg(&other_ca)
        .output()
        .expect("running openssl (scripts/stack installs it)");
    assert!(made.status.success(), "{made:?}");
    let untrusted = connect_error(tls_url(
        name,
        "verify-full",
        Some(other_ca.to_str().unwrap()),
    ))
    .await;
    assert!(
        untrusted.to_ascii_lowercase().contains("certificate"),
        "{untrusted}"
    );

    let config = Config::load_from(
        None,
        vec![(
            "DATABASE_URL".to_string(),
            tls_url(name, "verify-full", None),
        )],
    )
    .unwrap();
    let pool = ductor::infra::db::connect(&config.database)
        .await
        .expect("connecting over verified TLS");
    let (role, ssl): (String, bool) = sqlx::query_as(
        "SELECT current_user::text, ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((role.as_str(), ssl), ("ductor_tls", true));
    pool.close().await;
}

/// Through `kafka.properties` alone, Ductor's clients authenticate on both
/// SCRAM listeners, in plain text and over verified TLS: topics are made,
/// a record goes in and comes out. With a wrong password the broker
/// refuses the client, which says so.
#[tokio::test]
async fn kafka_clients_authenticate_with_scram_through_the_properties() {
    for listener in [Listener::SaslPlaintext, Listener::SaslSsl] {
        let mut kafka = kafka_config();
        over_sasl(
            &mut kafka,
            listener,
            &stack_env("DUCTOR_TEST_KAFKA_SASL_PASSWORD"),
        );
        let topic = unique("tls-sasl-");
        ductor::infra::kafka::ensure_topics(&kafka, std::slice::from_ref(&topic), 1)
            .await
            .unwrap_or_else(|e| panic!("creating a topic through {listener:?}: {e:#}"));
        let producer = ductor::infra::kafka::producer(&kafka, "tls-test").unwrap();
        produce(&producer, &topic, "k", b"over scram", &[]).await;
        let got = read_n(&sasl_reader(&kafka, &topic), 1, WAIT).await;
        assert_eq!(rdkafka::Message::payload(&got[0]), Some(&b"over scram"[..]));

        let mut wrong = kafka.clone();
        over_sasl(&mut wrong, listener, "not-the-password");
        let errors = refusal(&wrong).await;
        assert!(
            errors
                .iter()
                .any(|e| e.contains("SASL authentication error")),
            "{listener:?}: the client says why: {errors:?}"
        );
        delete_test_topics(&[topic]).await;
    }
}
