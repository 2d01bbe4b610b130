//! Configuration layering, errors that name the key, and redaction.

use std::io::Write;

use ductor::config::Config;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn defaults_load_and_validate() {
    let config = Config::load_from(None, env(&[])).expect("defaults are valid");
    let names = config.topic_names();
    assert_eq!(names.requests(), "ductor.requests");
    assert_eq!(names.dead_letters(), "ductor.dlq");
    assert_eq!(
        names.inputs(),
        [
            "ductor.requests",
            "ductor.wakeups",
            "ductor.attempt-results"
        ]
    );
    assert!(
        config
            .all_topics()
            .contains(&"ductor.steps.default".to_string())
    );
}

#[test]
fn layers_apply_in_order_file_then_plain_env_then_prefixed_env() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(
        file,
        "[database]\nmax_connections = 7\n[kafka]\nbootstrap_servers = \"file:9092\"\n"
    )
    .unwrap();
    let config = Config::load_from(Some(file.path()), env(&[])).unwrap();
    assert_eq!(config.database.max_connections, 7);
    assert_eq!(config.kafka.bootstrap_servers, "file:9092");

    let config = Config::load_from(
        Some(file.path()),
        env(&[("KAFKA_BOOTSTRAP_SERVERS", "plain:9092")]),
    )
    .unwrap();
    assert_eq!(config.kafka.bootstrap_servers, "plain:9092");

    let config = Config::load_from(
        Some(file.path()),
        env(&[
            ("KAFKA_BOOTSTRAP_SERVERS", "plain:9092"),
            ("DUCTOR__KAFKA__BOOTSTRAP_SERVERS", "prefixed:9092"),
            ("DUCTOR__DATABASE__MAX_CONNECTIONS", "9"),
            ("DUCTOR__LOG__FILTER", "debug"),
        ]),
    )
    .unwrap();
    assert_eq!(config.kafka.bootstrap_servers, "prefixed:9092");
    assert_eq!(config.database.max_connections, 9);
    assert_eq!(config.log.filter, "debug");
}

#[test]
fn an_unknown_key_is_an_error_that_names_it() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(file, "[database]\nmax_conections = 7\n").unwrap();
    let err = Config::load_from(Some(file.path()), env(&[]))
        .expect_err("a misspelt key is rejected")
        .to_string();
    assert!(err.contains("max_conections"), "{err}");

    let err = Config::load_from(None, env(&[("DUCTOR__KAFKA__BOOTSTRAP", "x:1")]))
        .expect_err("an unknown environment key is rejected")
        .to_string();
    assert!(err.contains("bootstrap"), "{err}");
}

#[test]
fn a_bad_value_is_an_error_that_names_the_key() {
    let err = Config::load_from(None, env(&[("DUCTOR__DATABASE__MAX_CONNECTIONS", "many")]))
        .expect_err("a non-number is rejected")
        .to_string();
    assert!(err.contains("max_connections"), "{err}");

    let err = Config::load_from(None, env(&[("DUCTOR__COORDINATOR__BATCH_MAX_INPUTS", "0")]))
        .expect_err("a zero batch is rejected")
        .to_string();
    assert!(err.contains("coordinator.batch_max_inputs"), "{err}");

    let err = Config::load_from(None, env(&[("DUCTOR__COORDINATOR__APPLY_LANES", "0")]))
        .expect_err("zero apply lanes are rejected")
        .to_string();
    assert!(err.contains("coordinator.apply_lanes"), "{err}");
    let err = Config::load_from(
        None,
        env(&[("DUCTOR__COORDINATOR__CONCURRENT_BATCH_MIN_INPUTS", "0")]),
    )
    .expect_err("a zero threshold for concurrent batches is rejected")
    .to_string();
    assert!(
        err.contains("coordinator.concurrent_batch_min_inputs"),
        "{err}"
    );
    let err = Config::load_from(
        None,
        env(&[
            ("DUCTOR__COORDINATOR__APPLY_LANES", "4"),
            ("DUCTOR__DATABASE__MAX_CONNECTIONS", "4"),
        ]),
    )
    .expect_err("a lane per connection leaves none for the rest")
    .to_string();
    assert!(err.contains("database.max_connections"), "{err}");

    let err = Config::load_from(None, env(&[("DATABASE_URL", "mysql://x@y/z")]))
        .expect_err("a non-postgres url is rejected")
        .to_string();
    assert!(err.contains("database.url"), "{err}");

    let err = Config::load_from(None, env(&[("DATABASE_MIGRATE_URL", "mysql://x@y/z")]))
        .expect_err("a non-postgres migrator url is rejected")
        .to_string();
    assert!(err.contains("database.migrate_url"), "{err}");
}

/// Finished runs are kept 7 days and their tombstones 30 by default; a
/// tombstone may not expire before its run would, and 0 keeps every run.
#[test]
fn run_retention_has_defaults_and_a_tombstone_outlives_its_run() {
    let config = Config::load_from(None, env(&[])).unwrap();
    assert_eq!(config.runs.retention_ms, 7 * 86_400_000);
    assert_eq!(config.runs.tombstone_retention_ms, 30 * 86_400_000);
    let err = Config::load_from(
        None,
        env(&[("DUCTOR__RUNS__TOMBSTONE_RETENTION_MS", "86400000")]),
    )
    .expect_err("a tombstone shorter than the run's retention is refused")
    .to_string();
    assert!(err.contains("runs.tombstone_retention_ms"), "{err}");
    let err = Config::load_from(None, env(&[("DUCTOR__RUNS__PURGE_BATCH", "0")]))
        .expect_err("a zero purge batch is refused")
        .to_string();
    assert!(err.contains("runs.purge_batch"), "{err}");
    let keep_all = Config::load_from(
        None,
        env(&[
            ("DUCTOR__RUNS__RETENTION_MS", "0"),
            ("DUCTOR__RUNS__TOMBSTONE_RETENTION_MS", "1000"),
        ]),
    )
    .expect("0 keeps every run");
    assert_eq!(keep_all.runs.retention_ms, 0);
}

/// `ductor migrate` connects as the migrator when one is configured, and
/// grants serve's rights to the user of `database.url` unless told another
/// role; serve does not migrate unless told.
#[test]
fn the_migrator_and_the_application_role_come_from_their_urls() {
    let config = Config::load_from(
        None,
        env(&[("DATABASE_URL", "postgres://app%2Dx:pw@db:5432/d")]),
    )
    .unwrap();
    assert!(!config.database.migrate_on_start);
    assert!(config.database.migrate_url.is_none());
    assert_eq!(
        config.database.migrate_url().expose(),
        "postgres://app%2Dx:pw@db:5432/d",
        "without a migrator, one role does both"
    );
    assert_eq!(config.database.app_role().as_deref(), Some("app-x"));

    let config = Config::load_from(
        None,
        env(&[
            ("DATABASE_URL", "postgres://app:pw@db:5432/d"),
            ("DATABASE_MIGRATE_URL", "postgres://owner:pw@db:5432/d"),
            ("DUCTOR__DATABASE__APP_ROLE", "serve_role"),
        ]),
    )
    .unwrap();
    assert_eq!(
        config.database.migrate_url().expose(),
        "postgres://owner:pw@db:5432/d"
    );
    assert_eq!(config.database.app_role().as_deref(), Some("serve_role"));
    let config = Config::load_from(
        None,
        env(&[
            ("DATABASE_MIGRATE_URL", "postgres://owner:pw@db:5432/d"),
            (
                "DUCTOR__DATABASE__MIGRATE_URL",
                "postgres://wins:pw@db:5432/d",
            ),
        ]),
    )
    .unwrap();
    assert_eq!(
        config.database.migrate_url().expose(),
        "postgres://wins:pw@db:5432/d",
        "DUCTOR__ wins over the plain variable"
    );
}

/// `ductor keys` connects as the keys role when one is configured, and
/// `ductor migrate` grants its rights to that URL's user (or the role
/// named); without a keys URL there is no keys role and `ductor keys` uses
/// `database.url`. The URL is redacted like the others.
#[test]
fn the_keys_role_comes_from_its_url() {
    let config = Config::load_from(
        None,
        env(&[("DATABASE_URL", "postgres://app:pw@db:5432/d")]),
    )
    .unwrap();
    assert!(config.database.keys_role().is_none());
    assert_eq!(
        config.database.keys_url().expose(),
        "postgres://app:pw@db:5432/d"
    );

    let config = Config::load_from(
        None,
        env(&[
            ("DATABASE_URL", "postgres://app:pw@db:5432/d"),
            (
                "DATABASE_KEYS_URL",
                "postgres://key%2Dmaker:s3cret@db:5432/d",
            ),
        ]),
    )
    .unwrap();
    assert_eq!(config.database.keys_role().as_deref(), Some("key-maker"));
    assert_eq!(
        config.database.keys_url().expose(),
        "postgres://key%2Dmaker:s3cret@db:5432/d"
    );
    assert!(!format!("{config:?}").contains("s3cret"));
    let config = Config::load_from(
        None,
        env(&[
            ("DATABASE_KEYS_URL", "postgres://k:pw@db:5432/d"),
            ("DUCTOR__DATABASE__KEYS_ROLE", "keys_group"),
        ]),
    )
    .unwrap();
    assert_eq!(config.database.keys_role().as_deref(), Some("keys_group"));

    let err = Config::load_from(None, env(&[("DATABASE_KEYS_URL", "mysql://x@y/z")]))
        .expect_err("a non-postgres keys url is rejected")
        .to_string();
    assert!(err.contains("database.keys_url"), "{err}");
}

/// A state cap that could not hold a run's largest input and one output is
/// refused, whether it is set too low or the message limit raised past it.
#[test]
fn a_state_cap_below_an_input_and_an_output_is_refused() {
    let least = 2 * (1_048_576 - ductor::config::EFFECT_ENVELOPE_BYTES)
        + ductor::config::STATE_ENVELOPE_BYTES;
    let at_least = least.to_string();
    let config = Config::load_from(
        None,
        env(&[("DUCTOR__COORDINATOR__MAX_STATE_BYTES", at_least.as_str())]),
    )
    .expect("the smallest cap that holds them");
    assert_eq!(config.coordinator.max_state_bytes as u64, least);
    let below = (least - 1).to_string();
    for pairs in [
        vec![("DUCTOR__COORDINATOR__MAX_STATE_BYTES", below.as_str())],
        vec![("DUCTOR__KAFKA__MESSAGE_MAX_BYTES", "4194304")],
    ] {
        let err = Config::load_from(None, env(&pairs))
            .expect_err("no room for an input and an output")
            .to_string();
        assert!(err.contains("coordinator.max_state_bytes"), "{err}");
    }
}

/// Failing the runs of a workflow version no longer defined is off unless
/// asked for, in a file or from the environment; a value that is not a
/// boolean is refused, naming the key, rather than read as either.
#[test]
fn failing_runs_of_missing_workflows_is_off_unless_set() {
    const KEY: &str = "DUCTOR__COORDINATOR__FAIL_RUNS_OF_MISSING_WORKFLOWS";
    let config = Config::load_from(None, env(&[])).unwrap();
    assert!(!config.coordinator.fail_runs_of_missing_workflows);
    let config = Config::load_from(None, env(&[(KEY, "true")])).unwrap();
    assert!(config.coordinator.fail_runs_of_missing_workflows);
    let config = load_toml("[coordinator]\nfail_runs_of_missing_workflows = true\n")
        .expect("a file sets it");
    assert!(config.coordinator.fail_runs_of_missing_workflows);

    for bad in ["yes", "1", "on", "\"true\""] {
        let err = Config::load_from(None, env(&[(KEY, bad)]))
            .expect_err("only a boolean is taken")
            .to_string();
        assert!(
            err.contains("coordinator.fail_runs_of_missing_workflows"),
            "{bad}: {err}"
        );
    }
    let err = load_toml("[coordinator]\nfail_runs_of_missing_workflows = \"yes\"\n")
        .expect_err("a string in a file is refused")
        .to_string();
    assert!(
        err.contains("coordinator.fail_runs_of_missing_workflows"),
        "{err}"
    );
}

#[test]
fn a_missing_config_file_is_an_error_that_names_it() {
    let err = Config::load_from(
        Some(std::path::Path::new("/nonexistent/ductor.toml")),
        env(&[]),
    )
    .expect_err("missing file")
    .to_string();
    assert!(err.contains("/nonexistent/ductor.toml"), "{err}");
}

#[test]
fn secrets_never_appear_in_debug_output() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(
        file,
        "[kafka.properties]\n\"sasl.password\" = \"kafka-hunter2\"\n\"sasl.username\" = \"alice\"\n\"ssl.key.password\" = \"key-hunter2\"\n"
    )
    .unwrap();
    let config = Config::load_from(
        Some(file.path()),
        env(&[
            (
                "DATABASE_URL",
                "postgres://ductor:pg-hunter2@db:5432/ductor",
            ),
            (
                "DATABASE_MIGRATE_URL",
                "postgres://ductor_migrator:mig-hunter2@db:5432/ductor",
            ),
        ]),
    )
    .unwrap();
    let debug = format!(
        "{config:?} {config:#?} {} {}",
        config.database.url,
        config.database.migrate_url()
    );
    for secret in ["pg-hunter2", "mig-hunter2", "kafka-hunter2", "key-hunter2"] {
        assert!(!debug.contains(secret), "{secret} leaked into {debug}");
    }
    assert!(
        debug.contains("alice"),
        "non-secret properties stay visible"
    );
    assert!(debug.contains("[redacted]"));
    // The real value is still there for connecting.
    assert!(config.database.url.expose().contains("pg-hunter2"));
}

fn load_toml(text: &str) -> Result<Config, ductor::config::ConfigError> {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(text.as_bytes()).unwrap();
    Config::load_from(Some(file.path()), env(&[]))
}

#[test]
fn properties_may_not_weaken_what_a_delivery_report_promises() {
    for (section, key, value) in [
        (
            "producer_properties",
            "max.in.flight.requests.per.connection",
            "5",
        ),
        ("producer_properties", "max.in.flight", "2"),
        ("producer_properties", "acks", "1"),
        ("properties", "request.required.acks", "0"),
        ("properties", "enable.idempotence", "false"),
        ("producer_properties", "partitioner", "consistent_random"),
        ("properties", "partitioner", "murmur2"),
    ] {
        let err = load_toml(&format!("[kafka.{section}]\n{key:?} = {value:?}\n"))
            .expect_err("a weaker producer setting is rejected")
            .to_string();
        assert!(err.contains(&format!("kafka.{section}")), "{err}");
        assert!(err.contains(key), "{err}");
    }

    let config = load_toml(
        "[kafka.producer_properties]\n\
         \"acks\" = \"-1\"\n\
         \"max.in.flight\" = \"1\"\n\
         \"partitioner\" = \"murmur2_random\"\n\
         \"linger.ms\" = \"7\"\n",
    )
    .expect("Ductor's own values and unrelated keys are accepted");
    let producer = ductor::infra::kafka::producer_config(&config.kafka, "test");
    assert_eq!(
        producer.get("max.in.flight.requests.per.connection"),
        Some("1")
    );
    assert_eq!(producer.get("enable.idempotence"), Some("true"));
    assert_eq!(producer.get("partitioner"), Some("murmur2_random"));
    assert_eq!(producer.get("linger.ms"), Some("7"));
}

/// The ingress's assignor, group protocol, offset store and isolation are
/// what give a run one writer and apply each input once: a pass-through
/// property that changes one is refused, naming the section and the key.
#[test]
fn properties_may_not_undo_the_single_writer_or_the_offset_store() {
    for (section, key, value) in [
        (
            "consumer_properties",
            "partition.assignment.strategy",
            "cooperative-sticky",
        ),
        ("properties", "partition.assignment.strategy", "roundrobin"),
        ("consumer_properties", "group.protocol", "consumer"),
        ("consumer_properties", "group.remote.assignor", "range"),
        ("consumer_properties", "enable.auto.offset.store", "true"),
        ("properties", "isolation.level", "read_uncommitted"),
    ] {
        let err = load_toml(&format!("[kafka.{section}]\n{key:?} = {value:?}\n"))
            .expect_err("a consumer setting that undoes a guarantee is rejected")
            .to_string();
        assert!(err.contains(&format!("kafka.{section}")), "{err}");
        assert!(err.contains(key), "{err}");
    }

    let config = load_toml(
        "[kafka.consumer_properties]\n\
         \"partition.assignment.strategy\" = \"range\"\n\
         \"fetch.max.bytes\" = \"1048576\"\n",
    )
    .expect("Ductor's own values and unrelated keys are accepted");
    let consumer = ductor::infra::kafka::consumer_config(&config.kafka, "g", "test");
    for (key, value) in ductor::config::CONSUMER_GUARANTEES {
        assert_eq!(consumer.get(key), Some(value), "{key}");
    }
    assert_eq!(consumer.get("fetch.max.bytes"), Some("1048576"));
}

/// `ductor submit` applies the input budget and screen of every other
/// entry point before it touches the database.
#[test]
fn submit_refuses_an_input_past_the_limits_with_its_class() {
    let submit = |input: &str, max_input_bytes: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_ductor"))
            .args(["submit", "--workflow", "example", "--input", input])
            .env("DUCTOR__COORDINATOR__MAX_INPUT_BYTES", max_input_bytes)
            .env(
                "DUCTOR__DATABASE__URL",
                "postgres://nobody@127.0.0.1:1/none",
            )
            .output()
            .expect("ductor runs")
    };
    let out = submit(r#"{"a":"\u0000"}"#, "1032192");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("nul_character"), "{stderr}");
    let big = format!(r#"{{"a":"{}"}}"#, "x".repeat(5_000));
    let out = submit(&big, "4096");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("too_large"), "{stderr}");
    assert!(
        !stderr.contains("connect"),
        "refused before connecting: {stderr}"
    );
}

#[test]
fn the_admin_listener_is_loopback_by_default_and_apart_from_the_public_one() {
    let config = Config::load_from(None, env(&[])).expect("defaults are valid");
    assert!(config.server.admin_listen.ip().is_loopback());
    assert_ne!(config.server.admin_listen, config.server.listen);
    for (public, admin) in [
        ("127.0.0.1:9000", "127.0.0.1:9000"),
        ("0.0.0.0:9000", "127.0.0.1:9000"),
        ("127.0.0.1:9000", "[::]:9000"),
    ] {
        let refused = Config::load_from(
            None,
            env(&[
                ("DUCTOR__SERVER__LISTEN", public),
                ("DUCTOR__SERVER__ADMIN_LISTEN", admin),
            ]),
        )
        .expect_err("one address for both listeners");
        let message = refused.to_string();
        assert!(
            message.contains("server.admin_listen") && message.contains("server.listen"),
            "{message}"
        );
    }
    // Port 0 twice is two ports the kernel picks; one port on two distinct
    // addresses is two sockets.
    for (public, admin) in [
        ("127.0.0.1:0", "127.0.0.1:0"),
        ("127.0.0.1:9000", "127.0.0.2:9000"),
    ] {
        Config::load_from(
            None,
            env(&[
                ("DUCTOR__SERVER__LISTEN", public),
                ("DUCTOR__SERVER__ADMIN_LISTEN", admin),
            ]),
        )
        .expect("listeners apart");
    }
}

/// The admin listener trusts whoever reaches it only on loopback:
/// elsewhere it takes admin keys, over TLS.
#[test]
fn a_non_loopback_admin_listener_needs_admin_keys_over_tls() {
    let load = |pairs: &[(&str, &str)]| Config::load_from(None, env(pairs));
    let refused = load(&[("DUCTOR__SERVER__ADMIN_LISTEN", "0.0.0.0:9464")])
        .expect_err("an open admin listener without authentication")
        .to_string();
    assert!(
        refused.contains("server.admin_listen") && refused.contains("server.admin_auth"),
        "{refused}"
    );
    let refused = load(&[
        ("DUCTOR__SERVER__ADMIN_LISTEN", "0.0.0.0:9464"),
        ("DUCTOR__SERVER__ADMIN_AUTH", "key"),
    ])
    .expect_err("an admin key in clear over the network")
    .to_string();
    assert!(refused.contains("server.admin_tls_cert_file"), "{refused}");
    let refused = load(&[
        ("DUCTOR__SERVER__ADMIN_AUTH", "key"),
        ("DUCTOR__SERVER__AUTH", "disabled"),
    ])
    .expect_err("admin keys with keys turned off")
    .to_string();
    assert!(refused.contains("server.admin_auth"), "{refused}");
    let config = load(&[
        ("DUCTOR__SERVER__ADMIN_LISTEN", "0.0.0.0:9464"),
        ("DUCTOR__SERVER__ADMIN_AUTH", "key"),
        (
            "DUCTOR__SERVER__ADMIN_TLS_CERT_FILE",
            "/etc/ductor/admin.crt",
        ),
        (
            "DUCTOR__SERVER__ADMIN_TLS_KEY_FILE",
            "/etc/ductor/admin.key",
        ),
    ])
    .expect("admin keys over TLS");
    assert_eq!(config.server.admin_auth, ductor::config::AdminAuth::Key);
    load(&[("DUCTOR__SERVER__ADMIN_AUTH", "key")]).expect("admin keys on loopback");
}

/// The timer key that every-input signatures need, its length, and a
/// window that a replayed start's decision outlives.
#[test]
fn signatures_need_a_timer_key_and_a_window_below_the_decision_ttl() {
    let load = |pairs: &[(&str, &str)]| Config::load_from(None, env(pairs));
    let message = |pairs: &[(&str, &str)]| load(pairs).expect_err("refused").to_string();
    let refused = message(&[("DUCTOR__SIGNATURES__ALL_INPUTS", "true")]);
    assert!(refused.contains("signatures.timer_key"), "{refused}");
    let refused = message(&[
        ("DUCTOR__SIGNATURES__ALL_INPUTS", "true"),
        ("DUCTOR__SIGNATURES__TIMER_KEY", "short"),
    ]);
    assert!(
        refused.contains("signatures.timer_key") && refused.contains("16"),
        "{refused}"
    );
    for age in ["0", "999", "86400000", "99999999999"] {
        let refused = message(&[("DUCTOR__SIGNATURES__MAX_AGE_MS", age)]);
        assert!(
            refused.contains("signatures.max_age_ms"),
            "{age}: {refused}"
        );
    }
    let refused = message(&[("DUCTOR__SIGNATURES__MAX_AGE_MS", "five minutes")]);
    assert!(refused.contains("max_age_ms"), "{refused}");
    let config = load(&[
        ("DUCTOR__SIGNATURES__ALL_INPUTS", "true"),
        (
            "DUCTOR__SIGNATURES__TIMER_KEY",
            "serve-timer-key-0123456789",
        ),
    ])
    .expect("every input signed, timers with serve's key");
    assert_eq!(config.signatures.max_age_ms, 300_000);
    let debug = format!("{config:?}");
    assert!(
        !debug.contains("serve-timer-key"),
        "the timer key is redacted"
    );
}

#[test]
fn signing_keys_come_from_the_environment_are_redacted_and_must_be_long() {
    let key = "acme-signing-key-0123456789";
    let config = Config::load_from(
        None,
        env(&[
            ("DUCTOR__SIGNATURES__TENANT_KEYS__ACME", key),
            ("DUCTOR__SIGNATURES__POOLS", "[\"payments\"]"),
        ]),
    )
    .unwrap();
    assert_eq!(config.signatures.key("acme"), Some(key.as_bytes()));
    assert!(config.signatures.required(Some("payments")));
    assert!(!config.signatures.required(Some("default")) && !config.signatures.required(None));
    let printed = format!("{config:?}");
    assert!(
        !printed.contains(key) && printed.contains("[redacted]"),
        "{printed}"
    );
    let short = Config::load_from(
        None,
        env(&[("DUCTOR__SIGNATURES__TENANT_KEYS__ACME", "short")]),
    );
    assert!(
        short
            .unwrap_err()
            .to_string()
            .contains("signatures.tenant_keys")
    );
}

#[test]
fn a_listener_has_a_certificate_and_its_key_or_neither() {
    let config = Config::load_from(None, env(&[])).expect("defaults are valid");
    assert!(config.server.tls_cert_file.is_none() && config.server.admin_tls_key_file.is_none());
    assert_eq!(config.server.header_read_timeout_ms, 10_000);
    for (set, missing) in [
        ("DUCTOR__SERVER__TLS_CERT_FILE", "server.tls_key_file"),
        ("DUCTOR__SERVER__TLS_KEY_FILE", "server.tls_cert_file"),
        (
            "DUCTOR__SERVER__ADMIN_TLS_CERT_FILE",
            "server.admin_tls_key_file",
        ),
        (
            "DUCTOR__SERVER__ADMIN_TLS_KEY_FILE",
            "server.admin_tls_cert_file",
        ),
    ] {
        let refused = Config::load_from(None, env(&[(set, "/etc/ductor/tls/x.pem")]))
            .expect_err("half a pair");
        let message = refused.to_string();
        assert!(
            message.contains(missing) && message.contains("both or neither"),
            "{message}"
        );
    }
    let config = Config::load_from(
        None,
        env(&[
            (
                "DUCTOR__SERVER__TLS_CERT_FILE",
                "/etc/ductor/tls/server.crt",
            ),
            ("DUCTOR__SERVER__TLS_KEY_FILE", "/etc/ductor/tls/server.key"),
        ]),
    )
    .expect("a whole pair");
    assert_eq!(
        config.server.tls_cert_file.as_deref(),
        Some(std::path::Path::new("/etc/ductor/tls/server.crt"))
    );
    let refused = Config::load_from(
        None,
        env(&[("DUCTOR__SERVER__HEADER_READ_TIMEOUT_MS", "0")]),
    )
    .expect_err("no time for a head");
    assert!(
        refused
            .to_string()
            .contains("server.header_read_timeout_ms")
    );
}

#[test]
fn a_password_in_the_database_url_query_is_redacted_and_tls_settings_stay_visible() {
    let config = Config::load_from(
        None,
        env(&[(
            "DATABASE_URL",
            "postgres://ductor@db:5432/ductor?password=pg-hunter2&sslmode=verify-full&sslrootcert=/etc/ductor/ca.pem",
        )]),
    )
    .unwrap();
    let shown = format!("{config:#?} {}", config.database.url);
    assert!(!shown.contains("pg-hunter2"), "{shown}");
    assert!(shown.contains("sslmode=verify-full"), "{shown}");
    assert!(
        shown.contains("sslrootcert=%2Fetc%2Fductor%2Fca.pem"),
        "{shown}"
    );
    assert!(config.database.url.expose().contains("pg-hunter2"));
}

/// The instance name goes to the broker (`group.instance.id`) and into
/// Postgres (`eec_drainer_member.instance`, at most 256 characters): only
/// up to 200 of the characters a topic name may have are accepted (the
/// message says so); anything else is refused, naming the key.
#[test]
fn an_instance_name_either_side_would_refuse_is_refused() {
    let load = |id: &str| Config::load_from(None, env(&[("DUCTOR__KAFKA__GROUP_INSTANCE_ID", id)]));
    let ok = load("serve-1.a_b").expect("a plain name is accepted");
    assert_eq!(ok.kafka.group_instance_id.as_deref(), Some("serve-1.a_b"));
    let long = load(&"x".repeat(200));
    assert!(long.is_ok(), "200 characters are accepted: {long:?}");
    for bad in [
        "",
        &"x".repeat(201),
        "a\0b",
        "serve\u{FFFD}",
        "sérve",
        "serve 1",
        "pod/1",
    ] {
        let err = load(bad).expect_err("refused").to_string();
        assert!(err.contains("kafka.group_instance_id"), "{bad:?}: {err}");
    }
    let err = load_toml("[kafka]\ngroup_instance_id = 7\n")
        .expect_err("a number is not a name")
        .to_string();
    assert!(err.contains("group_instance_id"), "{err}");
}

/// The prompt sends' two settings: defaults that turn them on, either one
/// set by environment, and a value of the wrong kind refused naming its key.
#[test]
fn the_prompt_settings_take_counts_and_refuse_anything_else() {
    let defaults = Config::load_from(None, env(&[])).expect("defaults");
    assert_eq!(defaults.kafka.prompt_max_in_flight, 4);
    assert_eq!(defaults.kafka.prompt_after_ms, 10);
    let set = Config::load_from(
        None,
        env(&[
            ("DUCTOR__KAFKA__PROMPT_MAX_IN_FLIGHT", "0"),
            ("DUCTOR__KAFKA__PROMPT_AFTER_MS", "25"),
        ]),
    )
    .expect("counts are accepted");
    assert_eq!(set.kafka.prompt_max_in_flight, 0, "0 turns them off");
    assert_eq!(set.kafka.prompt_after_ms, 25);
    for (key, bad) in [
        ("DUCTOR__KAFKA__PROMPT_MAX_IN_FLIGHT", "-1"),
        ("DUCTOR__KAFKA__PROMPT_MAX_IN_FLIGHT", "four"),
        ("DUCTOR__KAFKA__PROMPT_AFTER_MS", "1\0"),
        ("DUCTOR__KAFKA__PROMPT_AFTER_MS", "2.5"),
    ] {
        let err = Config::load_from(None, env(&[(key, bad)]))
            .expect_err("refused")
            .to_string();
        assert!(
            err.to_lowercase().contains("prompt_"),
            "{key}={bad:?}: {err}"
        );
    }
}
