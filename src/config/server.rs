//! The `[server]` section: the public and the admin HTTP listeners, who
//! may use them, and the bounds that keep a caller from taking more than
//! its share.
//!
//! In: the listeners' addresses, their TLS files, the authentication of
//! each, and the limits on connections, requests and their timing. Out: a
//! [`ServerConfig`] the listeners are built from. Guarantees: the admin
//! endpoints never answer on the public listener's address; the admin
//! listener trusts whoever reaches it only on loopback, and elsewhere takes
//! an admin key over TLS; a certificate never comes without its key; no
//! bound or interval is 0.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

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
    /// Most runs one page of `GET /v1/runs` (and `ductor runs list`)
    /// holds; a request's `limit` may ask for fewer (50 when it names
    /// none).
    pub max_page_runs: usize,
    /// Most runs `GET /v1/runs/counts` counts one by one, for a filter the
    /// kept counts do not answer (a step, a correlation id, a time range):
    /// past it the counts say `"exact": false`.
    pub count_scan_limit: u64,
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

impl ServerConfig {
    /// The listeners, their TLS files, who may use the admin one, and the
    /// bounds of the public API.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.validate_listeners()?;
        self.validate_admin_auth()?;
        self.validate_bounds()
    }

    /// The two listeners are apart: on one address the admin endpoints
    /// would answer beside the public API (or the second bind fail). Each
    /// has a certificate and its key, or neither.
    fn validate_listeners(&self) -> Result<(), ConfigError> {
        let (public, admin) = (self.listen, self.admin_listen);
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
        both_or_neither(
            ("server.tls_cert_file", &self.tls_cert_file),
            ("server.tls_key_file", &self.tls_key_file),
        )?;
        both_or_neither(
            ("server.admin_tls_cert_file", &self.admin_tls_cert_file),
            ("server.admin_tls_key_file", &self.admin_tls_key_file),
        )
    }

    /// The admin listener trusts whoever reaches it only on loopback;
    /// anywhere else it takes an admin key, over TLS, with the API's keys
    /// to check it against.
    fn validate_admin_auth(&self) -> Result<(), ConfigError> {
        match self.admin_auth {
            AdminAuth::Loopback if !self.admin_listen.ip().is_loopback() => Err(invalid(
                "server.admin_listen",
                format!(
                    "{} is not a loopback address, and server.admin_auth = \"loopback\" lets \
                     whoever reaches the admin listener read its metrics and readiness and use \
                     the operator's endpoints: set server.admin_auth = \"key\" (an API key with \
                     the admin scope on every admin request, with server.admin_tls_cert_file), or \
                     listen on loopback",
                    self.admin_listen
                ),
            )),
            AdminAuth::Key if self.auth == AuthMode::Disabled => Err(invalid(
                "server.admin_auth",
                "\"key\" checks API keys, which server.auth = \"disabled\" turns off",
            )),
            AdminAuth::Key
                if self.admin_tls_cert_file.is_none() && !self.admin_listen.ip().is_loopback() =>
            {
                Err(invalid(
                    "server.admin_tls_cert_file",
                    format!(
                        "must be set when the admin listener ({}) is not on loopback: an admin \
                         key would cross the network in clear",
                        self.admin_listen
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// No bound of the public API, and no interval, is 0.
    fn validate_bounds(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            (
                "server.max_concurrent_requests",
                self.max_concurrent_requests as u64,
            ),
            (
                "server.requests_per_second",
                u64::from(self.requests_per_second),
            ),
            ("server.request_burst", u64::from(self.request_burst)),
            (
                "server.auth_failures_per_second",
                u64::from(self.auth_failures_per_second),
            ),
            (
                "server.auth_failure_burst",
                u64::from(self.auth_failure_burst),
            ),
            ("server.request_timeout_ms", self.request_timeout_ms),
            ("server.body_read_timeout_ms", self.body_read_timeout_ms),
            ("server.header_read_timeout_ms", self.header_read_timeout_ms),
            ("server.tls_check_interval_ms", self.tls_check_interval_ms),
            ("server.readiness_interval_ms", self.readiness_interval_ms),
            ("server.readiness_timeout_ms", self.readiness_timeout_ms),
            ("server.max_connections", self.max_connections as u64),
            ("server.max_page_runs", self.max_page_runs as u64),
            ("server.count_scan_limit", self.count_scan_limit),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        Ok(())
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
