//! One HTTP/1.1 request over a fresh connection (`Connection: close`):
//! enough for a test or a load driver, and it keeps an HTTP client library
//! out of the harnesses.
//!
//! In: an address, a method, a path, headers and a body. Out: the status
//! and the (de-chunked) body. Guarantees: an answer within the caller's
//! timeout or an error that says so; a response larger than
//! [`MAX_RESPONSE_BYTES`] is an error, not a growing buffer. A body without
//! a `Content-Type` header is sent as `application/json`.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest response read.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// Sends one request and returns the status and body.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> anyhow::Result<(u16, Vec<u8>)> {
    tokio::time::timeout(timeout, exchange(addr, method, path, headers, body))
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {} ms", timeout.as_millis()))?
}

async fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream
        .write_all(head(addr, method, path, headers, body.len()).as_bytes())
        .await
        .context("sending")?;
    stream.write_all(body).await.context("sending")?;
    let mut response = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = stream.read(&mut buf).await.context("reading")?;
        if n == 0 {
            break;
        }
        response.extend_from_slice(&buf[..n]);
        if response.len() > MAX_RESPONSE_BYTES {
            bail!("response larger than {MAX_RESPONSE_BYTES} bytes");
        }
    }
    parse(&response)
}

/// The request line and headers, up to the blank line.
fn head(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    length: usize,
) -> String {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {length}\r\n"
    );
    let typed = headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"));
    if length > 0 && !typed {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head
}

/// Splits a complete HTTP/1.1 response into status and (de-chunked) body.
pub fn parse(response: &[u8]) -> anyhow::Result<(u16, Vec<u8>)> {
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("connection closed before the end of the response head")?;
    let head = String::from_utf8_lossy(&response[..split]);
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status line")?;
    let body = &response[split + 4..];
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok((status, body))
}

fn dechunk(mut data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("truncated chunk")?;
        let size_text = String::from_utf8_lossy(&data[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .context("bad chunk size")?;
        if size == 0 {
            return Ok(out);
        }
        let start = line_end + 2;
        let end = start + size;
        if data.len() < end {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&data[start..end]);
        data = data.get(end + 2..).unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_bodies() {
        let plain = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse(plain).unwrap(), (201, b"{}".to_vec()));
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse(chunked).unwrap(), (200, b"abcde".to_vec()));
        assert!(parse(b"HTTP/1.1 200 OK\r\n").is_err());
        let truncated = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nabc";
        assert!(parse(truncated).is_err());
    }

    #[test]
    fn a_body_is_json_unless_it_says_otherwise() {
        let addr: SocketAddr = "127.0.0.1:80".parse().unwrap();
        let json = head(addr, "POST", "/v1/runs", &[], 2);
        assert!(
            json.contains("Content-Type: application/json\r\n"),
            "{json}"
        );
        let typed = head(addr, "POST", "/", &[("content-type", "text/plain")], 2);
        assert!(!typed.contains("application/json"), "{typed}");
        let empty = head(addr, "GET", "/metrics", &[], 0);
        assert!(!empty.contains("Content-Type"), "{empty}");
        assert!(empty.ends_with("Content-Length: 0\r\n\r\n"), "{empty}");
    }
}
