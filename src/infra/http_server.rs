//! The HTTP listeners' accept loop: an axum `Router` served over HTTP/1.1
//! on a bound `TcpListener`, optionally behind TLS.
//!
//! It is ours rather than `axum::serve` for two bounds axum's server does
//! not set: a request's head must arrive within
//! `server.header_read_timeout_ms` (the TLS handshake too), and may not
//! exceed [`MAX_HEADER_BYTES`]. With TLS, the certificate comes from a
//! [`CertStore`] that [`watch_tls`] reloads on SIGHUP and when the files
//! change: new connections get the new pair, open ones keep theirs.
//!
//! On shutdown the loop stops accepting, idle connections close, and
//! requests in flight finish (`serve` bounds the wait by its grace).
//!
//! In: a bound `TcpListener`, an axum `Router` and its [`ServeOptions`];
//! with TLS, a [`TlsFiles`] pair. Out: served connections, each request
//! carrying its peer as `ConnectInfo`; 429s from [`limit_auth_failures`].
//! Guarantees: at most `server.max_connections` connections at once (one
//! more is closed on accept); a TLS pair that does not load never replaces
//! the one in use.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use axum::extract::ConnectInfo;
use axum::extract::State;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::rate::{FailureGate, RateLimiter};
use crate::config::ServerConfig;

/// Most bytes of a request's head (request line and headers); past it,
/// 431. Generous for any client of the API (a key is under 100 bytes).
pub const MAX_HEADER_BYTES: usize = 65_536;

/// Pause after a failed `accept` (out of file descriptors, say), so that
/// the loop does not spin while the cause lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// How one listener serves its connections.
#[derive(Clone)]
pub struct ServeOptions {
    /// `server.header_read_timeout_ms`: for the head of each request, and
    /// for the TLS handshake.
    pub header_read_timeout: Duration,
    /// The listener's TLS, or none for plain HTTP.
    pub tls: Option<TlsAcceptor>,
    /// `server.max_connections`: connections open at once; one more is
    /// closed as soon as it is accepted.
    pub max_connections: usize,
    /// `public` or `admin`, for the connection metrics.
    pub listener: &'static str,
}

/// Serves `app` on `listener` until `shutdown`, then waits for the
/// connections it accepted to finish their requests in flight.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let connections = TaskTracker::new();
    let open = Arc::new(tokio::sync::Semaphore::new(options.max_connections));
    let gauge = metrics::gauge!("ductor_http_open_connections", "listener" => options.listener);
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                // Closed at once past the bound: the client sees its
                // connection end instead of waiting in the backlog.
                let Ok(permit) = open.clone().try_acquire_owned() else {
                    metrics::counter!(
                        "ductor_http_connections_refused_total",
                        "listener" => options.listener
                    )
                    .increment(1);
                    drop(stream);
                    continue;
                };
                let (app, options, shutdown) = (app.clone(), options.clone(), shutdown.clone());
                let gauge = gauge.clone();
                gauge.increment(1.0);
                connections.spawn(async move {
                    serve_connection(stream, peer, app, options, shutdown).await;
                    gauge.decrement(1.0);
                    drop(permit);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting an http connection failed");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => {}
                }
            }
        }
    }
    connections.close();
    connections.wait().await;
    Ok(())
}

/// One connection: its TLS handshake when the listener has TLS, then its
/// requests.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    app: axum::Router,
    options: ServeOptions,
    shutdown: CancellationToken,
) {
    let Some(acceptor) = &options.tls else {
        return drive(TokioIo::new(stream), peer, app, &options, shutdown).await;
    };
    let handshake = tokio::time::timeout(options.header_read_timeout, acceptor.accept(stream));
    let stream = tokio::select! {
        _ = shutdown.cancelled() => return,
        done = handshake => match done {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "tls handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!("tls handshake timed out");
                return;
            }
        },
    };
    drive(TokioIo::new(stream), peer, app, &options, shutdown).await;
}

/// Serves the requests of one connection until the client closes it, a
/// bound closes it, or shutdown lets its request in flight finish.
/// Each request carries its connection's peer as
/// `ConnectInfo<SocketAddr>`, for what is counted per client address.
async fn drive<I>(
    io: I,
    peer: SocketAddr,
    app: axum::Router,
    options: &ServeOptions,
    shutdown: CancellationToken,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout)
        .max_header_size(MAX_HEADER_BYTES);
    let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        tower_service::Service::call(&mut app.clone(), request)
    });
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    let ended = tokio::select! {
        ended = connection.as_mut() => ended,
        _ = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = ended {
        tracing::debug!(error = %e, "http connection ended with an error");
    }
}

/// What [`limit_auth_failures`] counts with: each client address's
/// failures, and the keys that authenticated lately (the request limiter's
/// buckets).
#[derive(Clone)]
pub struct AuthFailures {
    pub gate: Arc<FailureGate>,
    pub rates: Arc<RateLimiter>,
}

/// Middleware of both listeners: counts each 401 against its client
/// address, and refuses (429 `rate_limited`, before any key is looked up)
/// a request of an address whose failures are used up, unless its key is
/// one that authenticated lately. Behind a proxy that is every client's
/// address, so a guesser there holds back only those without a key that
/// works.
pub async fn limit_auth_failures(
    State(failures): State<AuthFailures>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let Some(ConnectInfo(peer)) = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .copied()
    else {
        return next.run(request).await;
    };
    let now = Instant::now();
    if let Err(wait) = failures.gate.check(peer.ip(), now) {
        let known_key = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| crate::auth::key::bearer(v.as_bytes()))
            .and_then(crate::auth::key::parse)
            .is_some_and(|presented| failures.rates.knows(presented.key_id));
        if !known_key {
            metrics::counter!("ductor_api_refused_total", "reason" => "auth_failures").increment(1);
            let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            let code = crate::api::error::Code::RateLimited;
            let error = crate::api::error::ErrorDetail {
                code: code.as_str(),
                message: "too many failed authentications from this address; retry after the Retry-After seconds",
            };
            let mut response = crate::api::error::ErrorBody { error }.response(code.status());
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds.max(1)),
            );
            return response;
        }
    }
    let response = next.run(request).await;
    if response.status() == axum::http::StatusCode::UNAUTHORIZED {
        failures.gate.failed(peer.ip(), Instant::now());
    }
    response
}

/// A listener's certificate and key files, with the configuration keys
/// that named them (for the errors).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub cert_key: &'static str,
    pub key_key: &'static str,
}

impl TlsFiles {
    /// The public listener's files, when TLS is on there.
    pub fn public(server: &ServerConfig) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert: server.tls_cert_file.clone()?,
            key: server.tls_key_file.clone()?,
            cert_key: "server.tls_cert_file",
            key_key: "server.tls_key_file",
        })
    }

    /// The admin listener's files, when TLS is on there.
    pub fn admin(server: &ServerConfig) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert: server.admin_tls_cert_file.clone()?,
            key: server.admin_tls_key_file.clone()?,
            cert_key: "server.admin_tls_cert_file",
            key_key: "server.admin_tls_key_file",
        })
    }

    /// Reads and checks the pair: a chain with at least one certificate,
    /// a key the provider can sign with, and the key the certificate's.
    pub fn load(&self) -> anyhow::Result<CertifiedKey> {
        let chain = CertificateDer::pem_file_iter(&self.cert)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .with_context(|| read_error(self.cert_key, &self.cert))?;
        if chain.is_empty() {
            anyhow::bail!(
                "{} ({}) holds no PEM certificate",
                self.cert_key,
                self.cert.display()
            );
        }
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .with_context(|| read_error(self.key_key, &self.key))?;
        CertifiedKey::from_der(chain, key, &provider()).with_context(|| {
            format!(
                "loading {} ({}) with {} ({})",
                self.key_key,
                self.key.display(),
                self.cert_key,
                self.cert.display()
            )
        })
    }

    /// When the files last changed, as far as their metadata tells: a
    /// change of either (a rewrite, a rename over it) changes this.
    fn stamp(&self) -> Option<[(SystemTime, u64); 2]> {
        let one = |path: &Path| {
            let meta = std::fs::metadata(path).ok()?;
            Some((meta.modified().ok()?, meta.len()))
        };
        Some([one(&self.cert)?, one(&self.key)?])
    }
}

fn read_error(key: &str, path: &Path) -> String {
    format!("reading {key} ({})", path.display())
}

/// The crypto of every TLS config Ductor builds: ring, named here rather
/// than left to whichever provider another crate in the build enables.
pub fn provider() -> CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// A listener's current certificate: what each new handshake is given.
pub struct CertStore {
    current: RwLock<Arc<CertifiedKey>>,
    files: TlsFiles,
    /// `public` or `admin`, for logs and the reload metric.
    listener: &'static str,
}

impl std::fmt::Debug for CertStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertStore")
            .field("files", &self.files)
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|current| current.clone())
    }
}

impl CertStore {
    /// Loads `files` for `listener`; a pair that does not load is the
    /// error, naming the key and the path.
    pub fn load(files: TlsFiles, listener: &'static str) -> anyhow::Result<Arc<CertStore>> {
        let current = files.load()?;
        Ok(Arc::new(CertStore {
            current: RwLock::new(Arc::new(current)),
            files,
            listener,
        }))
    }

    /// The acceptor of handshakes with the store's certificate, for
    /// HTTP/1.1.
    pub fn acceptor(self: &Arc<Self>) -> anyhow::Result<TlsAcceptor> {
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider()))
            .with_safe_default_protocol_versions()
            .context("choosing the tls protocol versions")?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// Loads the files again. A pair that loads replaces the current one;
    /// one that does not is logged, and the current one stays.
    pub fn reload(&self, why: &'static str) {
        let result = match self.files.load() {
            Ok(loaded) => match self.current.write() {
                Ok(mut current) => {
                    *current = Arc::new(loaded);
                    tracing::info!(listener = self.listener, why, "tls certificate reloaded");
                    "ok"
                }
                Err(_) => {
                    tracing::error!(listener = self.listener, "tls certificate store poisoned");
                    "failed"
                }
            },
            Err(e) => {
                tracing::error!(
                    listener = self.listener,
                    why,
                    error = format!("{e:#}"),
                    "tls certificate not reloaded, keeping the current one"
                );
                "failed"
            }
        };
        metrics::counter!(
            "ductor_http_tls_reloads_total",
            "listener" => self.listener,
            "result" => result
        )
        .increment(1);
    }
}

/// Reloads `store` on SIGHUP, and when its files' modification times
/// change (looked at every `interval`), until `shutdown`. The SIGHUP
/// handler is installed before this returns, so a signal sent once the
/// listener is up reaches the task.
pub fn watch_tls(
    store: Arc<CertStore>,
    interval: Duration,
    shutdown: CancellationToken,
) -> anyhow::Result<impl Future<Output = anyhow::Result<()>>> {
    use tokio::signal::unix::{SignalKind, signal};
    let hangup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    Ok(reload_loop(store, hangup, interval, shutdown))
}

async fn reload_loop(
    store: Arc<CertStore>,
    mut hangup: tokio::signal::unix::Signal,
    interval: Duration,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Taken before each load, so that a file written during one is seen
    // as changed at the next look.
    let mut seen = store.files.stamp();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = hangup.recv() => {
                seen = store.files.stamp();
                store.reload("sighup");
            }
            _ = tick.tick() => {
                let now = store.files.stamp();
                if now != seen {
                    seen = now;
                    store.reload("files changed");
                }
            }
        }
    }
}
