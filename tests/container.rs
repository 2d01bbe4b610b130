//! Ductor's container image and docker-compose.yml, run for real with
//! podman. `scripts/container-test` builds the images (Ductor's on a Debian
//! base made locally, with the host's release binaries; stand-ins for the
//! upstream Kafka and Postgres images) and runs these tests, which are
//! ignored otherwise:
//!
//! - [`image_against_the_native_stack`]: the image alone, on the host's
//!   network against scripts/stack's Kafka and Postgres (a database and
//!   topics of its own): its `ductor migrate`, `topics create`, `keys
//!   create`, its default command (`serve`) and the example worker, its
//!   healthchecks, `/readyz`, and runs completed through it;
//! - [`compose_run`]: `podman-compose` on docker-compose.yml (with
//!   scripts/container/compose.local.yml's images for Kafka and Postgres),
//!   every service on one network reaching the others by name, brought up
//!   in the order of its `depends_on` conditions, each waited on through
//!   its own healthcheck or exit status; the first API key from the `keys`
//!   one-shot's log starts runs that the worker completes, and the admin
//!   listener answers `/metrics` as Prometheus would ask it.
//!
//! Settings (all set by scripts/container-test): `DUCTOR_CONTAINER_IMAGE`,
//! `DUCTOR_TEST_KAFKA_IMAGE`, `DUCTOR_TEST_POSTGRES_IMAGE`,
//! `DUCTOR_PODMAN_COMPOSE` (its path), `CONTAINERS_CONF` (the runtime and
//! limits), and the stack's of every integration test.

mod common;

use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use common::*;
use ductor::config::Config;
use serde_json::{Value, json};

/// Runs started through the container, in each test.
const RUNS: usize = 20;
/// A container's start, a healthcheck's passing, all runs' completion.
const WAIT: Duration = Duration::from_secs(120);

fn setting(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the container tests through scripts/container-test")
    })
}

/// A command's output, its failure a panic that shows what it printed.
fn ok(what: &str, output: Output) -> String {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("the output is text")
}

async fn podman(args: &[&str]) -> Output {
    tokio::process::Command::new("podman")
        .args(args)
        .output()
        .await
        .expect("running podman")
}

async fn podman_ok(args: &[&str]) -> String {
    ok(&format!("podman {}", args.join(" ")), podman(args).await)
}

/// Waits until `container`'s own healthcheck passes. Podman without
/// systemd runs no healthcheck by itself: this runs it every half second,
/// as the healthcheck's `interval` would (each run is a process in the
/// container and two podman calls, which a tighter loop would take from
/// the services starting), and fails at once when the container stops.
async fn healthy(container: &str) {
    let mut cadence = tokio::time::interval(Duration::from_millis(500));
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        cadence.tick().await;
        if podman(&["healthcheck", "run", container])
            .await
            .status
            .success()
        {
            return;
        }
        let state = podman(&["inspect", "--format", "{{.State.Status}}", container]).await;
        let state = String::from_utf8_lossy(&state.stdout).trim().to_owned();
        assert!(
            state == "running" || state == "created",
            "{container} is {state}, not running:\n{}",
            logs_of(container).await
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "{container} is not healthy after {WAIT:?}:\n{}",
            logs_of(container).await
        );
    }
}

async fn logs_of(container: &str) -> String {
    let output = podman(&["logs", container]).await;
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("finding a free port")
        .port()
}

/// Starts `RUNS` runs of the example workflow on `api` with `key`, and
/// waits until every one has succeeded through all three steps.
async fn runs_complete(api: SocketAddr, key: &str) {
    let (name, value) = bearer(key);
    let auth = [(name, value.as_str()), ("Content-Type", "application/json")];
    let mut runs = Vec::new();
    for i in 0..RUNS {
        let body = json!({"workflow": "example", "input": {"amount": i + 1}}).to_string();
        let (status, answer) = http(api, "POST", "/v1/runs", &auth, body.as_bytes()).await;
        let answer: Value = serde_json::from_slice(&answer).expect("the answer is JSON");
        assert_eq!(status, 201, "POST /v1/runs: {answer}");
        runs.push(answer["run_id"].as_str().expect("a run_id").to_owned());
    }
    for run in &runs {
        let path = format!("/v1/runs/{run}");
        let done = eventually(&format!("run {run} to succeed"), WAIT, || async {
            let (status, body) = http(api, "GET", &path, &auth, b"").await;
            assert_eq!(status, 200, "GET {path}");
            let run: Value = serde_json::from_slice(&body).expect("the answer is JSON");
            assert_ne!(run["status"], "failed", "{run}");
            (run["status"] == "succeeded").then_some(run)
        })
        .await;
        for step in ["reserve", "charge", "ship"] {
            assert_eq!(done["output"][step]["done"], true, "{step} of {done}");
        }
    }
}

/// The containers a test started, removed at its end, pass or fail.
struct Containers(Vec<String>);

impl Drop for Containers {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        if std::thread::panicking() {
            for name in &self.0 {
                if let Ok(out) = std::process::Command::new("podman")
                    .args(["logs", "--tail", "40", name])
                    .output()
                {
                    eprintln!(
                        "--- the last lines of {name}:\n{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            }
        }
        let mut rm = std::process::Command::new("podman");
        rm.args(["rm", "--force", "--time", "0"]).args(&self.0);
        if let Err(e) = rm.output() {
            eprintln!("removing {:?}: {e}", self.0);
        }
    }
}

/// `podman run` on the host's network: `options`, `env` as `--env`, the
/// image and `command`; its standard output.
async fn run_on_host(options: &[&str], env: &[(String, String)], command: &[&str]) -> String {
    let mut args: Vec<String> = ["run", "--network", "host"].map(str::to_owned).into();
    args.extend(options.iter().map(|s| (*s).to_owned()));
    args.extend(
        env.iter()
            .flat_map(|(k, v)| ["--env".to_owned(), format!("{k}={v}")]),
    );
    args.push(setting("DUCTOR_CONTAINER_IMAGE"));
    args.extend(command.iter().map(|s| (*s).to_owned()));
    podman_ok(&args.iter().map(String::as_str).collect::<Vec<_>>()).await
}

/// The environment of the image's processes on the native stack: the same
/// private topics and group as every test's (`test_config`), `db`, and
/// listeners on free ports.
struct NativeEnv {
    prefix: String,
    /// The public listener's port.
    public: u16,
    /// The broker and the topics: the worker's.
    kafka: Vec<(String, String)>,
    /// And the application role, the listeners: serve's.
    serve: Vec<(String, String)>,
    /// And the migrator and the keys role: `migrate`'s.
    migrate: Vec<(String, String)>,
}

impl NativeEnv {
    fn new(db: &TestDb) -> NativeEnv {
        let prefix = unique("c").chars().take(13).collect::<String>();
        let public = free_port();
        let pairs = |pairs: &[(&str, String)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect::<Vec<_>>()
        };
        let kafka = pairs(&[
            ("KAFKA_BOOTSTRAP_SERVERS", bootstrap_servers()),
            ("DUCTOR__KAFKA__TOPIC_PREFIX", format!("{prefix}.")),
            ("DUCTOR__KAFKA__GROUP_ID", format!("{prefix}-coordinator")),
            ("DUCTOR__KAFKA__PARTITIONS", "3".to_owned()),
            (
                "DUCTOR__KAFKA__EXTRA_TOPICS",
                format!("[\"{prefix}.outputs\"]"),
            ),
        ]);
        let mut serve = kafka.clone();
        serve.extend(pairs(&[
            ("DATABASE_URL", db.url.clone()),
            ("DUCTOR__SERVER__LISTEN", format!("127.0.0.1:{public}")),
            (
                "DUCTOR__SERVER__ADMIN_LISTEN",
                format!("127.0.0.1:{}", free_port()),
            ),
        ]));
        let mut migrate = serve.clone();
        migrate.extend(pairs(&[
            ("DATABASE_MIGRATE_URL", db.owner_url.clone()),
            ("DATABASE_KEYS_URL", db.keys_url.clone()),
        ]));
        NativeEnv {
            prefix,
            public,
            kafka,
            serve,
            migrate,
        }
    }
}

#[tokio::test]
#[ignore = "needs podman and the images of scripts/container-test"]
async fn image_against_the_native_stack() {
    let db = TestDb::empty().await;
    let env = NativeEnv::new(&db);
    let config = Config::load_from(None, env.migrate.clone()).expect("the configuration is valid");
    db.owns_topics(config.all_topics());

    // The one-shots, each a container of its own.
    run_on_host(&["--rm"], &env.migrate, &["ductor", "migrate"]).await;
    run_on_host(&["--rm"], &env.migrate, &["ductor", "topics", "create"]).await;
    let keys_role = [("DATABASE_KEYS_URL".to_owned(), db.keys_url.clone())];
    let create = [
        "ductor",
        "keys",
        "create",
        "--tenant",
        "acme",
        "--scopes",
        "runs:write,runs:read",
    ];
    let made = run_on_host(&["--rm"], &keys_role, &create).await;
    let made: Value = serde_json::from_str(&made).expect("keys create prints JSON");
    let key = made["key"].as_str().expect("the new key").to_owned();

    // serve (the image's default command) and the worker, with the
    // healthchecks of docker-compose.yml.
    let serve = format!("{}-serve", env.prefix);
    let worker = format!("{}-worker", env.prefix);
    let containers = Containers(vec![serve.clone(), worker.clone()]);
    let health = format!("ductor-healthcheck serve {}", env.public);
    run_on_host(
        &["--detach", "--name", &serve, "--health-cmd", &health],
        &env.serve,
        &[],
    )
    .await;
    let worker_health = "ductor-healthcheck worker";
    let worker_command = ["ductor-example-worker", "--fail-rate", "0.1"];
    run_on_host(
        &["--detach", "--name", &worker, "--health-cmd", worker_health],
        &env.kafka,
        &worker_command,
    )
    .await;

    healthy(&serve).await;
    healthy(&worker).await;
    let api: SocketAddr = ([127, 0, 0, 1], env.public).into();
    let (status, body) = http(api, "GET", "/readyz", &[], b"").await;
    assert_eq!(status, 200, "/readyz: {}", String::from_utf8_lossy(&body));
    runs_complete(api, &key).await;

    drop(containers);
    db.drop_db().await;
}

/// `podman-compose` on docker-compose.yml and the local images' layer,
/// as project `project`, with the settings of `env`.
struct Compose {
    project: String,
    env: Vec<(String, String)>,
}

impl Compose {
    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let repo = workspace_dir();
        let mut command = tokio::process::Command::new(setting("DUCTOR_PODMAN_COMPOSE"));
        command
            .current_dir(&repo)
            .args(["--in-pod", "false", "--project-name", &self.project])
            .args([
                "--file",
                "docker-compose.yml",
                "--file",
                "scripts/container/compose.local.yml",
            ])
            .args(args)
            .envs(self.env.iter().cloned());
        command
    }

    async fn ok(&self, args: &[&str]) -> String {
        let output = self
            .command(args)
            .output()
            .await
            .expect("running podman-compose");
        ok(&format!("podman-compose {}", args.join(" ")), output)
    }

    fn container(&self, service: &str) -> String {
        format!("{}_{service}_1", self.project)
    }

    /// Starts `services` alone (their dependencies are the caller's).
    async fn up(&self, services: &[&str]) {
        let mut args = vec!["up", "--detach", "--no-deps", "--no-build"];
        args.extend(services);
        self.ok(&args).await;
    }

    /// Starts a one-shot and returns its log once it has exited 0.
    async fn one_shot(&self, service: &str) -> String {
        self.up(&[service]).await;
        let container = self.container(service);
        let code = podman_ok(&["wait", &container]).await;
        let logs = logs_of(&container).await;
        assert_eq!(code.trim(), "0", "{service} exited {code}:\n{logs}");
        logs
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        let mut down = std::process::Command::new(setting("DUCTOR_PODMAN_COMPOSE"));
        down.current_dir(workspace_dir())
            .args(["--in-pod", "false", "--project-name", &self.project])
            .args([
                "--file",
                "docker-compose.yml",
                "--file",
                "scripts/container/compose.local.yml",
            ])
            .args(["down", "--volumes", "--timeout", "0"])
            .envs(self.env.iter().cloned());
        match down.output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "podman-compose down failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("podman-compose down: {e}"),
        }
    }
}

#[tokio::test]
#[ignore = "needs podman, podman-compose and the images of scripts/container-test"]
async fn compose_run() {
    let http_port = free_port();
    let env = compose_env(http_port);
    let project = unique("ductor-ct-").chars().take(20).collect::<String>();
    let compose = Compose { project, env };

    // In the order of the depends_on conditions, which podman-compose on
    // podman 4.3 does not wait for: healthy, then completed successfully.
    compose.up(&["postgres", "kafka"]).await;
    healthy(&compose.container("postgres")).await;
    healthy(&compose.container("kafka")).await;
    let tls = compose.one_shot("admin-tls").await;
    assert!(tls.contains("a certificate for ductor"), "{tls}");
    let migrate = compose.one_shot("migrate").await;
    assert!(migrate.contains("migrations applied"), "{migrate}");
    let keys = compose.one_shot("keys").await;
    let first = keys
        .lines()
        .find_map(|line| serde_json::from_str::<Value>(line).ok())
        .unwrap_or_else(|| panic!("no key in the keys one-shot's log:\n{keys}"));
    assert_eq!(first["tenant"], "default", "{first}");
    let key = first["key"].as_str().expect("the first key").to_owned();
    assert!(keys.contains("an admin key for Prometheus"), "{keys}");

    compose.up(&["ductor", "worker"]).await;
    healthy(&compose.container("ductor")).await;
    healthy(&compose.container("worker")).await;
    let api: SocketAddr = ([127, 0, 0, 1], http_port).into();
    let (status, body) = http(api, "GET", "/readyz", &[], b"").await;
    assert_eq!(status, 200, "/readyz: {}", String::from_utf8_lossy(&body));
    runs_complete(api, &key).await;

    // The admin listener, asked as deploy/prometheus/prometheus.yml asks
    // it; and refused without the key.
    let answer = admin_metrics(&compose.project, true).await;
    let status_line = answer.lines().next().unwrap_or_default();
    assert!(
        status_line.contains(" 200 "),
        "/metrics with the admin key: {status_line}"
    );
    assert!(
        answer.contains("ductor_"),
        "no ductor_ metric in /metrics:\n{answer}"
    );
    let answer = admin_metrics(&compose.project, false).await;
    let status_line = answer.lines().next().unwrap_or_default();
    assert!(
        status_line.contains(" 401 "),
        "/metrics without a key: {status_line}"
    );
}

/// The compose run's settings: the images, and host ports of its own
/// (scripts/stack has the defaults).
fn compose_env(http_port: u16) -> Vec<(String, String)> {
    let mut env = vec![
        ("DUCTOR_IMAGE".to_owned(), setting("DUCTOR_CONTAINER_IMAGE")),
        ("DUCTOR_HTTP_PORT".to_owned(), http_port.to_string()),
    ];
    for name in ["DUCTOR_TEST_KAFKA_IMAGE", "DUCTOR_TEST_POSTGRES_IMAGE"] {
        env.push((name.to_owned(), setting(name)));
    }
    for name in [
        "DUCTOR_KAFKA_PORT",
        "DUCTOR_PG_PORT",
        "DUCTOR_PROMETHEUS_PORT",
        "DUCTOR_GRAFANA_PORT",
    ] {
        env.push((name.to_owned(), free_port().to_string()));
    }
    env
}

/// `GET https://ductor:9464/metrics` from a container on the compose
/// network, as Prometheus asks it: the certificate checked against the CA
/// of the credentials volume, with the admin key from it or none; the
/// answer, status line first.
async fn admin_metrics(project: &str, with_key: bool) -> String {
    let request = if with_key {
        r#"key=$(cat /credentials/admin-key); printf 'GET /metrics HTTP/1.1\r\nHost: ductor\r\nAuthorization: Bearer %s\r\nConnection: close\r\n\r\n' "$key""#
    } else {
        r#"printf 'GET /metrics HTTP/1.1\r\nHost: ductor\r\nConnection: close\r\n\r\n'"#
    };
    let script = format!(
        "{request} | openssl s_client -quiet -verify_return_error -CAfile /credentials/admin-ca.pem \
         -servername ductor -connect ductor:9464 2>/dev/null"
    );
    let network = format!("{project}_default");
    let volume = format!("{project}_credentials:/credentials:ro");
    podman_ok(&[
        "run",
        "--rm",
        "--network",
        &network,
        "--volume",
        &volume,
        &setting("DUCTOR_CONTAINER_IMAGE"),
        "sh",
        "-c",
        &script,
    ])
    .await
}
