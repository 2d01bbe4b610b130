//! A browser for the tests that look at a page as a person does: Debian's
//! headless Chromium, driven by its `chromedriver` through the W3C
//! WebDriver protocol, spoken here over one HTTP/1.1 exchange per command
//! ([`exchange`]): the few commands a test needs, no client library.
//!
//! In: `chromedriver` and `chromium` on the `PATH` (`scripts/test`
//! installs Debian's `chromium-driver` and `chromium`), or the programs
//! `DUCTOR_TEST_CHROMEDRIVER` and `DUCTOR_TEST_CHROMIUM` name. Out: a
//! [`Browser`] session. Guarantees: every wait has a deadline and polls the
//! page, never sleeps for a guessed time; the driver and its browser are
//! killed when the [`Driver`] is dropped; the browser's profile is a fresh
//! temporary directory.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};

/// The key under which WebDriver names an element.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Bound on one WebDriver command (a page load among them).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a wait looks at the page again.
const POLL: Duration = Duration::from_millis(50);

/// A running `chromedriver`.
pub struct Driver {
    addr: SocketAddr,
    _process: tokio::process::Child,
    profile: tempfile::TempDir,
}

fn program(variable: &str, name: &str) -> PathBuf {
    if let Ok(path) = std::env::var(variable) {
        return PathBuf::from(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not on the PATH: install Debian's chromium and chromium-driver \
                 (scripts/test does), or set {variable}"
            )
        })
}

impl Driver {
    /// Starts `chromedriver` on a free port of the loopback and returns
    /// once it says it is ready.
    pub async fn start() -> Driver {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
            probe.local_addr().expect("its address").port()
        };
        let process =
            tokio::process::Command::new(program("DUCTOR_TEST_CHROMEDRIVER", "chromedriver"))
                .arg(format!("--port={port}"))
                .arg("--allowed-ips=127.0.0.1")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .expect("starting chromedriver");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let driver = Driver {
            addr,
            _process: process,
            profile: tempfile::tempdir().expect("a profile directory"),
        };
        let deadline = tokio::time::Instant::now() + COMMAND_TIMEOUT;
        loop {
            let status = tokio::time::timeout(
                Duration::from_secs(5),
                exchange(addr, "GET", "/status", b""),
            )
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer")));
            if let Ok((200, body)) = status {
                let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if body["value"]["ready"] == true {
                    return driver;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "chromedriver on {addr} did not get ready within {COMMAND_TIMEOUT:?}"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// A new headless Chromium session with a window of `width` × `height`.
    pub async fn browser(&self, width: u32, height: u32) -> Browser {
        let chromium = program("DUCTOR_TEST_CHROMIUM", "chromium");
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless=new",
                    // A container's root has no user namespaces for the sandbox.
                    "--no-sandbox",
                    "--disable-dev-shm-usage",
                    "--disable-gpu",
                    "--no-first-run",
                    "--disable-extensions",
                    "--hide-scrollbars",
                    "--force-device-scale-factor=1",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", self.profile.path().display()),
                ],
            },
        }}});
        let session = call(self.addr, "POST", "/session", &capabilities).await;
        let id = session["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {session}"))
            .to_owned();
        Browser {
            addr: self.addr,
            session: id,
        }
    }
}

/// One WebDriver command; its `value`. Panics on a WebDriver error.
async fn call(addr: SocketAddr, method: &str, path: &str, body: &Value) -> Value {
    match try_call(addr, method, path, body).await {
        Ok(value) => value,
        Err((error, message)) => panic!("WebDriver {method} {path}: {error}: {message}"),
    }
}

/// One WebDriver command; its `value`, or its error and message.
async fn try_call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &Value,
) -> Result<Value, (String, String)> {
    let bytes = if method == "POST" {
        body.to_string().into_bytes()
    } else {
        Vec::new()
    };
    let (status, raw) = tokio::time::timeout(COMMAND_TIMEOUT, exchange(addr, method, path, &bytes))
        .await
        .unwrap_or_else(|_| {
            panic!("WebDriver {method} {path}: no answer within {COMMAND_TIMEOUT:?}")
        })
        .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e:#}"));
    let mut answer: Value = serde_json::from_slice(&raw).unwrap_or_else(|e| {
        panic!(
            "WebDriver {method} {path} answered {status}, not JSON ({e}): {}",
            String::from_utf8_lossy(&raw)
        )
    });
    let value = answer["value"].take();
    if status == 200 {
        return Ok(value);
    }
    let text = |key: &str| value[key].as_str().unwrap_or_default().to_owned();
    Err((text("error"), text("message")))
}

/// Largest answer read: a screenshot of a large window, in base64.
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// One request and its answer, read as far as its `Content-Length`:
/// `chromedriver` says `Connection: close` but keeps the connection open,
/// so reading to the end of the stream would wait for ever.
async fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> anyhow::Result<(u16, Vec<u8>)> {
    use anyhow::Context;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json; charset=utf-8\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    let mut answer = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stream.read(&mut buf).await.context("reading the answer")?;
        answer.extend_from_slice(&buf[..n]);
        anyhow::ensure!(
            answer.len() <= MAX_ANSWER_BYTES,
            "an answer over {MAX_ANSWER_BYTES} bytes"
        );
        if let Some(split) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&answer[..split]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            let done = match length {
                Some(length) => answer.len() >= split + 4 + length,
                None => n == 0,
            };
            if done {
                let status = head
                    .split_whitespace()
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .context("no status line")?;
                let end = length.map_or(answer.len(), |l| split + 4 + l);
                return Ok((status, answer[split + 4..end].to_vec()));
            }
        }
        anyhow::ensure!(n > 0, "the connection closed before the answer ended");
    }
}

/// A browser session.
pub struct Browser {
    addr: SocketAddr,
    session: String,
}

/// An element of the page, as WebDriver names it.
#[derive(Debug, Clone)]
pub struct Element(String);

impl Browser {
    async fn command(&self, method: &str, path: &str, body: Value) -> Value {
        let path = format!("/session/{}{path}", self.session);
        call(self.addr, method, &path, &body).await
    }

    /// Loads `url` and returns once the document has loaded.
    pub async fn goto(&self, url: &str) {
        self.command("POST", "/url", json!({ "url": url })).await;
    }

    /// The first element `css` selects, if any.
    pub async fn find(&self, css: &str) -> Option<Element> {
        let path = format!("/session/{}/element", self.session);
        let body = json!({"using": "css selector", "value": css});
        match try_call(self.addr, "POST", &path, &body).await {
            Ok(value) => Some(Element(
                value[ELEMENT]
                    .as_str()
                    .expect("an element reference")
                    .to_owned(),
            )),
            Err((error, _)) if error == "no such element" => None,
            Err((error, message)) => panic!("finding {css}: {error}: {message}"),
        }
    }

    /// The first element `css` selects, once one is there and shown.
    pub async fn wait_for(&self, css: &str, timeout: Duration) -> Element {
        let selector = serde_json::to_string(css).expect("a string");
        let shown = format!(
            "const e = document.querySelector({selector}); \
             return !!e && e.getClientRects().length > 0 && !e.closest('[hidden]');"
        );
        self.until(&format!("{css} is shown"), &shown, timeout)
            .await;
        self.find(css).await.expect("the element just seen")
    }

    /// Clicks the element `css` selects, once it is shown.
    pub async fn click(&self, css: &str, timeout: Duration) {
        let element = self.wait_for(css, timeout).await;
        let path = format!("/element/{}/click", element.0);
        self.command("POST", &path, json!({})).await;
    }

    /// Types `text` into the element `css` selects, once it is shown.
    pub async fn type_into(&self, css: &str, text: &str, timeout: Duration) {
        let element = self.wait_for(css, timeout).await;
        let path = format!("/element/{}/value", element.0);
        self.command("POST", &path, json!({ "text": text })).await;
    }

    /// Picks the option of value `value` of the `<select>` that `css`
    /// selects, once the select is shown, by clicking the option.
    pub async fn choose(&self, select: &str, value: &str, timeout: Duration) {
        self.wait_for(select, timeout).await;
        let option = format!("{select} option[value={}]", json!(value));
        let element = self
            .find(&option)
            .await
            .unwrap_or_else(|| panic!("{select} has no option {value}"));
        let path = format!("/element/{}/click", element.0);
        self.command("POST", &path, json!({})).await;
    }

    /// Runs `body` (a function body, `return` for its value) in the page.
    pub async fn script(&self, body: &str) -> Value {
        self.command("POST", "/execute/sync", json!({"script": body, "args": []}))
            .await
    }

    /// Runs `body` in the page until it returns something other than
    /// `null`, `false`, `0` or `""`, and returns that; panics with `what`
    /// after `timeout`.
    pub async fn until(&self, what: &str, body: &str, timeout: Duration) -> Value {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let value = self.script(body).await;
            let truthy = match &value {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return value;
            }
            if tokio::time::Instant::now() >= deadline {
                let page = self
                    .script("return document.body ? document.body.innerText.slice(0, 2000) : ''")
                    .await;
                panic!("timed out after {timeout:?} waiting for {what}; the page says: {page}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Saves a PNG of the window at `path`.
    pub async fn screenshot(&self, path: &Path) {
        let png = self.command("GET", "/screenshot", Value::Null).await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("a base64 PNG"))
            .expect("the screenshot decodes");
        assert!(bytes.starts_with(b"\x89PNG"), "the screenshot is a PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("making the screenshots' directory");
        }
        std::fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }

    /// Ends the session, closing the browser.
    pub async fn quit(self) {
        let path = format!("/session/{}", self.session);
        let _ = try_call(self.addr, "DELETE", &path, &Value::Null).await;
    }
}
