//! The operator commands' client of the HTTP API (`ductor runs`, `ductor
//! outbox`): one request per call, over HTTP or HTTPS, with the key of
//! `DUCTOR_API_KEY`.
//!
//! In: the API's base URL (`--url`, `DUCTOR_URL`, else the configured
//! `server.listen`), a CA file for HTTPS, a key, and a request. Out: the
//! answer's JSON, or a [`CliError`] whose exit status a script can branch
//! on. Guarantees: the key travels only in the `Authorization` header,
//! never in an argument (which `ps` would show) or a URL; an answer is read
//! up to [`MAX_ANSWER_BYTES`] within the timeout; HTTPS verifies the
//! server against the CA file (or the system's bundle).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;

/// Largest answer read.
pub const MAX_ANSWER_BYTES: usize = 64 << 20;
/// Where Debian and most distributions keep the system's CA bundle.
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Why a command failed, and the exit status that says so.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The API refused the request (a 4xx): running it again as it is
    /// will not help. Exit status 1.
    #[error("{code} ({status}): {message}")]
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    /// The server could not be reached, or failed (a 5xx): a retry may
    /// help. Exit status 3.
    #[error("{0}")]
    Unavailable(String),
}

impl CliError {
    /// The exit status: 1 refused, 3 unavailable (2 is a usage or
    /// configuration error, before any request).
    pub fn exit_status(&self) -> u8 {
        match self {
            CliError::Refused { .. } => 1,
            CliError::Unavailable(_) => 3,
        }
    }
}

/// Where the API is and how to reach it.
#[derive(Debug, Clone)]
pub struct ApiClient {
    base: url::Url,
    key: Option<String>,
    ca_file: Option<PathBuf>,
    timeout: Duration,
}

impl ApiClient {
    /// A client of the API at `base` (`http://` or `https://`).
    pub fn new(
        base: &str,
        key: Option<String>,
        ca_file: Option<PathBuf>,
        timeout: Duration,
    ) -> anyhow::Result<ApiClient> {
        let base = url::Url::parse(base).map_err(|e| anyhow::anyhow!("--url {base:?}: {e}"))?;
        if !matches!(base.scheme(), "http" | "https") || base.host_str().is_none() {
            anyhow::bail!("--url {base}: an http:// or https:// URL with a host is needed");
        }
        Ok(ApiClient {
            base,
            key: key.filter(|k| !k.is_empty()),
            ca_file,
            timeout,
        })
    }

    /// `GET path_and_query`.
    pub async fn get(&self, path_and_query: &str) -> Result<Value, CliError> {
        self.call("GET", path_and_query, None).await
    }

    /// `POST path` with a JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> Result<Value, CliError> {
        self.call("POST", path, Some(body)).await
    }

    async fn call(
        &self,
        method: &str,
        path_and_query: &str,
        body: Option<&Value>,
    ) -> Result<Value, CliError> {
        let exchange = self.exchange(method, path_and_query, body);
        let (status, bytes) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| {
                CliError::Unavailable(format!(
                    "{} did not answer within {} s",
                    self.base,
                    self.timeout.as_secs()
                ))
            })??;
        answer(status, &bytes)
    }

    async fn exchange(
        &self,
        method: &str,
        path_and_query: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Bytes), CliError> {
        let unreachable = |e: &dyn std::fmt::Display| {
            CliError::Unavailable(format!("cannot reach {}: {e}", self.base))
        };
        let host = self.base.host_str().unwrap_or_default().to_owned();
        let port = self.base.port_or_known_default().unwrap_or(80);
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| unreachable(&e))?;
        let request = self.request(method, path_and_query, body)?;
        let answer = if self.base.scheme() == "https" {
            let tls = tls_connector(self.ca_file.as_deref()).map_err(|e| unreachable(&e))?;
            let name = ServerName::try_from(host.clone()).map_err(|e| unreachable(&e))?;
            let stream = tls.connect(name, tcp).await.map_err(|e| unreachable(&e))?;
            send(stream, request).await
        } else {
            send(tcp, request).await
        };
        answer.map_err(|e| unreachable(&e))
    }

    fn request(
        &self,
        method: &str,
        path_and_query: &str,
        body: Option<&Value>,
    ) -> Result<hyper::Request<Full<Bytes>>, CliError> {
        let authority = match self.base.port() {
            Some(port) => format!("{}:{port}", self.base.host_str().unwrap_or_default()),
            None => self.base.host_str().unwrap_or_default().to_owned(),
        };
        let prefix = self.base.path().trim_end_matches('/');
        let mut builder = hyper::Request::builder()
            .method(method)
            .uri(format!("{prefix}{path_and_query}"))
            .header(hyper::header::HOST, authority)
            .header(hyper::header::ACCEPT, "application/json");
        if let Some(key) = &self.key {
            builder = builder.header(hyper::header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let bytes = match body {
            Some(body) => {
                builder = builder.header(hyper::header::CONTENT_TYPE, "application/json");
                Bytes::from(body.to_string())
            }
            None => Bytes::new(),
        };
        builder
            .body(Full::new(bytes))
            .map_err(|e| CliError::Unavailable(format!("building the request: {e}")))
    }
}

/// Sends `request` on `stream` and reads the answer.
async fn send<S>(stream: S, request: hyper::Request<Full<Bytes>>) -> anyhow::Result<(u16, Bytes)>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    let driver = tokio::spawn(connection);
    let answer = sender.send_request(request).await?;
    let status = answer.status().as_u16();
    let body = http_body_util::Limited::new(answer.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the answer: {e}"))?
        .to_bytes();
    driver.abort();
    Ok((status, body))
}

/// HTTPS that trusts the certificates of `ca_file`, or the system's
/// bundle.
fn tls_connector(ca_file: Option<&Path>) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let file = ca_file.unwrap_or(Path::new(SYSTEM_CA_BUNDLE));
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(file)
        .map_err(|e| anyhow::anyhow!("reading the CA file {}: {e}", file.display()))?
    {
        let cert = cert.map_err(|e| anyhow::anyhow!("a certificate of {}: {e}", file.display()))?;
        roots.add(cert)?;
    }
    let provider = Arc::new(crate::infra::http_server::provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// The answer's JSON, or the error it says.
pub fn answer(status: u16, bytes: &[u8]) -> Result<Value, CliError> {
    let json: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
    if (200..300).contains(&status) {
        return Ok(json);
    }
    let code = json["error"]["code"]
        .as_str()
        .unwrap_or("http_error")
        .to_owned();
    let message = json["error"]["message"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned());
    if (400..500).contains(&status) && status != 429 {
        Err(CliError::Refused {
            status,
            code,
            message,
        })
    } else {
        Err(CliError::Unavailable(format!(
            "{code} ({status}): {message}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_status_one_and_a_failure_or_a_rate_limit_is_status_three() {
        let refused = answer(
            404,
            br#"{"error":{"code":"not_found","message":"no such run"}}"#,
        );
        let e = refused.unwrap_err();
        assert_eq!(e.exit_status(), 1);
        assert_eq!(e.to_string(), "not_found (404): no such run");
        for status in [429, 500, 503] {
            let e = answer(status, b"{}").unwrap_err();
            assert_eq!(e.exit_status(), 3, "{status}");
        }
        assert_eq!(answer(200, b"{\"a\":1}").unwrap()["a"], 1);
    }

    #[test]
    fn a_url_must_be_http_or_https_with_a_host() {
        for bad in ["ftp://x", "http://", "localhost:8080"] {
            assert!(
                ApiClient::new(bad, None, None, Duration::from_secs(1)).is_err(),
                "{bad}"
            );
        }
        assert!(
            ApiClient::new(
                "https://ops.example:8443",
                None,
                None,
                Duration::from_secs(1)
            )
            .is_ok()
        );
    }
}
