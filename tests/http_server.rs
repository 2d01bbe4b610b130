//! The HTTP listeners against the real Postgres and Kafka: TLS with its
//! certificate reloaded from changed files, the refusals at start-up of a
//! pair that does not load, and the bound on reading a request's head.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ductor::config::Config;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

struct Env {
    db: TestDb,
    public: SocketAddr,
    admin: SocketAddr,
    serve: Running,
}

impl Env {
    /// A migrated database, its topics, and `serve` over them, up once it
    /// says it is ready (whichever of its listeners speak TLS).
    async fn start(tweak: impl FnOnce(&mut Config)) -> Env {
        let db = TestDb::migrated().await;
        let mut config = test_config(&db);
        config.drainer.enabled = false;
        tweak(&mut config);
        ductor::infra::kafka::create_configured_topics(&config)
            .await
            .expect("creating topics");
        let serve = Running::start(&config).await;
        Env {
            db,
            public: serve.addr,
            admin: serve.admin,
            serve,
        }
    }

    async fn stop(self) {
        self.serve.stop().await;
        self.db.drop_db().await;
    }
}

/// A certificate authority of the tests' own.
struct TestCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        TestCa { cert, key }
    }

    /// A server certificate for 127.0.0.1 and localhost, and its key.
    fn server_cert(&self) -> (rcgen::Certificate, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params =
            rcgen::CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert, key)
    }

    fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }
}

/// Writes the pair where `serve` reads it, each file replaced whole (a
/// new file renamed over the old), as a certificate manager does.
fn install(dir: &Path, cert: &rcgen::Certificate, key: &rcgen::KeyPair) {
    for (name, pem) in [
        ("server.key", key.serialize_pem()),
        ("server.crt", cert.pem()),
    ] {
        let staged = dir.join(format!("{name}.new"));
        std::fs::write(&staged, pem).unwrap();
        std::fs::rename(&staged, dir.join(name)).unwrap();
    }
}

/// `GET path` over TLS, trusting only `roots`: the status and the
/// certificate the server presented, or the handshake's error.
async fn tls_get(
    addr: SocketAddr,
    roots: &[CertificateDer<'static>],
    path: &str,
) -> Result<(u16, CertificateDer<'static>), std::io::Error> {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store.add(root.clone()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        ductor::infra::http_server::provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(store)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await?;
    let presented = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    // The answer is in once the server closes; a close without TLS's
    // close_notify is still the end of it.
    let _ = tls.read_to_end(&mut response).await;
    let head = String::from_utf8_lossy(&response);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, presented))
}

/// The value of one series of the process's metrics, 0 while it has none.
fn counter(series: &str) -> u64 {
    let metrics = ductor::infra::telemetry::metrics_handle().render();
    ductor_testkit::metrics::value(&metrics, series).unwrap_or(0.0) as u64
}

/// Writes `bytes` on a fresh connection and reads until the server closes
/// it: what it answered, and how long that took.
async fn until_closed(addr: SocketAddr, bytes: &[u8]) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(WAIT, stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the server kept the connection open");
    (answer, started.elapsed())
}

#[tokio::test]
async fn the_public_listener_over_tls_takes_a_new_certificate_when_its_files_change() {
    let dir = tempfile::tempdir().unwrap();
    let first_ca = TestCa::new("ductor test ca 1");
    let (first, first_key) = first_ca.server_cert();
    install(dir.path(), &first, &first_key);
    let env = Env::start(|c| {
        c.server.tls_cert_file = Some(dir.path().join("server.crt"));
        c.server.tls_key_file = Some(dir.path().join("server.key"));
        c.server.tls_check_interval_ms = 100;
        c.server.header_read_timeout_ms = 1000;
    })
    .await;

    // A client that trusts the test CA gets its answer, from the
    // certificate installed.
    let (status, presented) = tls_get(env.public, &[first_ca.der()], "/healthz")
        .await
        .expect("a tls handshake with the first certificate");
    assert_eq!(status, 200);
    assert_eq!(&presented, first.der());

    // Plain HTTP gets no HTTP answer, and a connection that never starts
    // its handshake is closed within the head's bound.
    let plain = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let (answer, _) = until_closed(env.public, plain).await;
    assert!(
        !answer.starts_with(b"HTTP/"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    let (answer, took) = until_closed(env.public, b"").await;
    assert!(answer.is_empty());
    assert!(took >= Duration::from_millis(900), "{took:?}");

    // A pair from another CA replaces it: new connections get it.
    let second_ca = TestCa::new("ductor test ca 2");
    let (second, second_key) = second_ca.server_cert();
    install(dir.path(), &second, &second_key);
    let both = [first_ca.der(), second_ca.der()];
    eventually("the new certificate is presented", WAIT, || async {
        let (_, presented) = tls_get(env.public, &both, "/healthz").await.ok()?;
        (&presented == second.der()).then_some(())
    })
    .await;
    let (status, presented) = tls_get(env.public, &[second_ca.der()], "/healthz")
        .await
        .expect("a tls handshake with the second certificate");
    assert_eq!((status, &presented), (200, second.der()));
    assert!(
        tls_get(env.public, &[first_ca.der()], "/healthz")
            .await
            .is_err(),
        "the first CA's clients no longer trust the listener"
    );
    let metrics = ductor::infra::telemetry::metrics_handle().render();
    let reloaded = "ductor_http_tls_reloads_total{listener=\"public\",result=\"ok\"}";
    assert!(metrics.contains(reloaded), "{metrics}");

    // A key that is not the certificate's is refused, and the listener
    // keeps the pair it has.
    let failed = "ductor_http_tls_reloads_total{listener=\"public\",result=\"failed\"}";
    let failed_before = counter(failed);
    let (third, _) = second_ca.server_cert();
    install(dir.path(), &third, &first_key);
    eventually("the mismatched pair is refused", WAIT, || async {
        (counter(failed) > failed_before).then_some(())
    })
    .await;
    let (status, presented) = tls_get(env.public, &[second_ca.der()], "/healthz")
        .await
        .expect("the second certificate is still presented");
    assert_eq!((status, &presented), (200, second.der()));
    env.stop().await;
}

#[tokio::test]
async fn the_admin_listener_over_tls_takes_a_new_certificate_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let first_ca = TestCa::new("ductor test ca 1");
    let (first, first_key) = first_ca.server_cert();
    install(dir.path(), &first, &first_key);
    let admin_tls = |c: &mut Config| {
        c.server.admin_tls_cert_file = Some(dir.path().join("server.crt"));
        c.server.admin_tls_key_file = Some(dir.path().join("server.key"));
        // Only the signal reloads here.
        c.server.tls_check_interval_ms = 3_600_000;
    };
    let env = Env::start(admin_tls).await;
    let (status, presented) = tls_get(env.admin, &[first_ca.der()], "/healthz")
        .await
        .expect("a tls handshake with the first certificate");
    assert_eq!((status, &presented), (200, first.der()));

    let second_ca = TestCa::new("ductor test ca 2");
    let (second, second_key) = second_ca.server_cert();
    install(dir.path(), &second, &second_key);
    let (_, presented) = tls_get(env.admin, &[first_ca.der()], "/healthz")
        .await
        .expect("no reload before the signal");
    assert_eq!(&presented, first.der());
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let both = [first_ca.der(), second_ca.der()];
    eventually("the new certificate is presented", WAIT, || async {
        let (status, presented) = tls_get(env.admin, &both, "/healthz").await.ok()?;
        (status == 200 && &presented == second.der()).then_some(())
    })
    .await;
    env.stop().await;
}

#[tokio::test]
async fn a_tls_pair_that_does_not_load_keeps_serve_from_starting_and_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ductor test ca");
    let (cert, _) = ca.server_cert();
    let (_, other_key) = ca.server_cert();
    install(dir.path(), &cert, &other_key);
    let missing = dir.path().join("missing.crt");
    let cases = [
        (
            missing.clone(),
            dir.path().join("server.key"),
            format!("server.admin_tls_cert_file ({})", missing.display()),
        ),
        (
            dir.path().join("server.crt"),
            dir.path().join("server.key"),
            "server.admin_tls_key_file".to_string(),
        ),
    ];
    for (cert_file, key_file, named) in cases {
        let env = vec![
            ("DATABASE_URL".to_string(), database_url()),
            (
                "DUCTOR__COORDINATOR__WORKFLOWS_DIR".to_string(),
                workspace_dir()
                    .join("config/workflows")
                    .display()
                    .to_string(),
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
                "DUCTOR__SERVER__ADMIN_TLS_CERT_FILE".to_string(),
                cert_file.display().to_string(),
            ),
            (
                "DUCTOR__SERVER__ADMIN_TLS_KEY_FILE".to_string(),
                key_file.display().to_string(),
            ),
        ];
        let config = Config::load_from(None, env).expect("a valid configuration");
        let listeners = ductor::cli::serve::Listeners::bind(&config.server)
            .await
            .unwrap();
        let error = ductor::cli::serve::run_on(config, listeners, CancellationToken::new())
            .await
            .expect_err("serve refuses to start");
        let message = format!("{error:#}");
        assert!(message.contains(&named), "{message}");
    }
}

#[tokio::test]
async fn a_request_whose_head_does_not_arrive_in_time_loses_its_connection() {
    let env = Env::start(|c| c.server.header_read_timeout_ms = 300).await;
    // Half a head, then nothing.
    let partial = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow:";
    let (answer, took) = until_closed(env.public, partial).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    assert!(took >= Duration::from_millis(300), "{took:?}");
    // A whole head in time is answered as before.
    assert_eq!(http(env.public, "GET", "/healthz", &[], b"").await.0, 200);
    env.stop().await;
}
