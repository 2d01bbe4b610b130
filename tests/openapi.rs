//! The HTTP API's OpenAPI document (`schemas/openapi.json`) against the
//! real stack: it lists every route both listeners serve and no other; each
//! status it documents for an operation is one a request here makes that
//! operation answer on each listener that the document says gives it (but
//! the few listed in [`UNPROVOKABLE`], each with its reason); every answer
//! here is one it documents, with a body its schema takes; each operation
//! needs the scope it says; and `serve` serves the committed file.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use common::Serve as Env;
use common::*;
use ductor::api::routes::{Access, Listener, ROUTES};
use ductor::auth::Scope;
use ductor::config::{AdminAuth, AuthMode, DuplicatePolicy, PoolRouting};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// Documented statuses that no request of this test produces, with why.
/// The test fails when a documented status is neither produced nor listed
/// here, and when one listed here is produced after all: the list is
/// exactly what is not provoked.
const UNPROVOKABLE: [(&str, &str, &str, u16, &str); 3] = [
    (
        "public",
        "post",
        "/v1/runs",
        500,
        "`internal`: answered only when the routing plane breaks a promise of its own (a \
         completed key without a decision, a decider that commits without an outcome); no \
         request can make a correct server do that",
    ),
    (
        "public",
        "post",
        "/v1/dead-letters/{letter_id}/replay",
        422,
        "`not_replayable`: only for a letter whose input was over `dead_letters.max_value_bytes`, \
         which the configuration keeps above `kafka.message_max_bytes`; tests/dead_letters.rs \
         records such a letter and sees its replay refused",
    ),
    (
        "admin",
        "post",
        "/v1/dead-letters/{letter_id}/replay",
        422,
        "`not_replayable`: as on the public listener, whose handler it shares",
    ),
];

/// The committed document.
fn committed() -> String {
    let path = workspace_dir()
        .join("schemas")
        .join(ductor::api::openapi::FILE);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[test]
fn the_committed_document_is_what_the_code_generates() {
    assert!(
        committed() == ductor::api::openapi::text(),
        "schemas/openapi.json drifted from the code; regenerate it with \
         `cargo run -- schemas --out schemas` and commit"
    );
}

/// Every route is registered through `api::routes::add`, the one place
/// that reads the table the document is made from: no other file of the
/// crate adds a route, nests a router or sets a fallback.
#[test]
fn no_router_registers_a_route_outside_the_table() {
    let mut found = Vec::new();
    let mut dirs = vec![workspace_dir().join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("listing src/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") || path.ends_with("api/routes.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("reading a source file");
            for needle in [
                ".route(",
                ".route_service(",
                ".nest(",
                ".nest_service(",
                ".fallback(",
                ".fallback_service(",
            ] {
                if text.contains(needle) {
                    found.push(format!("{} calls {needle}", path.display()));
                }
            }
        }
    }
    assert!(found.is_empty(), "{found:?}");
}

/// One answer, read off the wire.
struct Answer {
    status: u16,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// A request's bytes: `Connection: close`, and a body typed JSON unless
/// `headers` says otherwise.
fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: ductor\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty()
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Writes `bytes` (a request, or the start of one) and reads the answer:
/// its head and the body its `Content-Length` announces.
async fn exchange(addr: SocketAddr, bytes: Vec<u8>) -> Answer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    // A head the listener refuses may be answered before it is all written.
    let _ = stream.write_all(&bytes).await;
    let mut response = Vec::new();
    let mut buf = [0u8; 16384];
    let read = async {
        loop {
            let n = stream.read(&mut buf).await.unwrap_or(0);
            response.extend_from_slice(&buf[..n]);
            if let Some(split) = response.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&response[..split]).into_owned();
                let length = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().to_owned())
                    })
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(0);
                if n == 0 || response.len() >= split + 4 + length {
                    return (head, response[split + 4..].to_vec());
                }
            }
            assert!(n > 0, "the connection closed without an answer");
        }
    };
    let (head, body) = tokio::time::timeout(WAIT, read)
        .await
        .expect("an answer in time");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body,
    }
}

/// (listener, method, path template, status).
type Seen = (String, String, String, u16);

/// The document, and the statuses each operation was seen to answer on
/// each listener.
struct Described {
    doc: Value,
    seen: BTreeSet<Seen>,
}

impl Described {
    fn new(doc: Value) -> Self {
        Described {
            doc,
            seen: BTreeSet::new(),
        }
    }

    /// [`Described::check_on`] the public listener.
    fn check(&mut self, method: &str, template: &str, answer: &Answer) {
        self.check_on("public", method, template, answer);
    }

    /// Checks `answer` of `method template` on `listener` against the
    /// document (its status is documented, for that listener, its body is
    /// what the status's schema takes, the headers it promises are there)
    /// and notes its status.
    fn check_on(&mut self, listener: &str, method: &str, template: &str, answer: &Answer) {
        let verb = method.to_ascii_lowercase();
        let op = &self.doc["paths"][template][&verb];
        assert!(op.is_object(), "{method} {template} is not described");
        let status = answer.status.to_string();
        let text = String::from_utf8_lossy(&answer.body).into_owned();
        let response = &op["responses"][&status];
        assert!(
            response.is_object(),
            "{method} {template} answered {status}, which its description does not list: {text}"
        );
        assert!(
            self.givers(&verb, template, &status)
                .contains(&listener.to_owned()),
            "{method} {template} answered {status} on the {listener} listener, which its \
             description says only the {:?} give",
            self.givers(&verb, template, &status)
        );
        match response.get("content") {
            Some(content) => {
                let media = answer
                    .header("content-type")
                    .and_then(|t| t.split(';').next())
                    .unwrap_or_default()
                    .trim();
                let schema = &content[media]["schema"];
                assert!(
                    schema.is_object(),
                    "{method} {template} {status} answered {media}, which is not described"
                );
                let instance = if media == "application/json" {
                    serde_json::from_slice(&answer.body).unwrap_or_else(|e| {
                        panic!("{method} {template} {status}: not JSON ({e}): {text}")
                    })
                } else {
                    Value::String(text.clone())
                };
                self.validate(schema, &instance)
                    .unwrap_or_else(|e| panic!("{method} {template} {status}: {e}: {text}"));
            }
            None => assert!(
                answer.body.is_empty(),
                "{method} {template} {status} has a body it does not describe: {text}"
            ),
        }
        if let Some(Value::Object(headers)) = response.get("headers") {
            for name in headers.keys() {
                // Retry-After on 503 comes only with some of its codes.
                if name == "Retry-After" && answer.status == 503 {
                    continue;
                }
                assert!(
                    answer.header(&name.to_ascii_lowercase()).is_some(),
                    "{method} {template} {status} without {name}"
                );
            }
        }
        self.seen.insert((
            listener.to_owned(),
            verb,
            template.to_owned(),
            answer.status,
        ));
    }

    /// The listeners that give `status` to `verb template`: those its
    /// response names, or else every listener of the operation.
    fn givers(&self, verb: &str, template: &str, status: &str) -> Vec<String> {
        match self.doc["paths"][template][verb]["responses"][status].get("x-ductor-listeners") {
            Some(Value::Array(names)) => names
                .iter()
                .map(|n| n.as_str().unwrap().to_owned())
                .collect(),
            _ => self.listeners(verb, template),
        }
    }

    fn validate(&self, schema: &Value, instance: &Value) -> Result<(), String> {
        // The schema, with the document's definitions its references name.
        let mut root = schema.clone();
        root["components"] = self.doc["components"].clone();
        let validator = jsonschema::draft202012::options()
            .should_validate_formats(true)
            .build(&root)
            .map_err(|e| format!("the described schema does not compile: {e}"))?;
        match validator.iter_errors(instance).next() {
            None => Ok(()),
            Some(e) => Err(format!("{e} at {}", e.instance_path())),
        }
    }

    /// Every documented (listener, method, template, status).
    fn documented(&self) -> BTreeSet<Seen> {
        let mut all = BTreeSet::new();
        for (template, item) in self.doc["paths"].as_object().unwrap() {
            for (verb, op) in item.as_object().unwrap() {
                for status in op["responses"].as_object().unwrap().keys() {
                    for listener in self.givers(verb, template, status) {
                        let code = status.parse().unwrap();
                        all.insert((listener, verb.clone(), template.clone(), code));
                    }
                }
            }
        }
        all
    }

    /// The listeners that serve `verb template`, by their servers.
    fn listeners(&self, verb: &str, template: &str) -> Vec<String> {
        self.doc["paths"][template][verb]["servers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["x-ductor-listener"].as_str().unwrap().to_owned())
            .collect()
    }
}

/// The serve under test, its keys and its runs.
struct Stage {
    env: Env,
    /// Every scope, of tenant `acme`.
    all: String,
    /// `admin` only.
    admin: String,
    /// A run of `acme` that stays running.
    run: String,
    /// A run of `acme` for the cancels.
    victim: String,
    /// Failed runs of `acme`, to retry on the public listener and on the
    /// admin one.
    failed: [String; 2],
    /// Dead letters of `acme`: one to replay, one to discard.
    replayed: i64,
    discarded: i64,
}

impl Stage {
    fn addr(&self, listener: &str) -> SocketAddr {
        match listener {
            "public" => self.env.addr,
            "admin" => self.env.admin,
            other => panic!("no listener {other}"),
        }
    }

    /// `template` with the stage's run in it (the victim, to cancel).
    fn path(&self, template: &str) -> String {
        let run = if template.ends_with("/cancel") {
            &self.victim
        } else {
            &self.run
        };
        let letter = if template.ends_with("/discard") {
            self.discarded
        } else {
            self.replayed
        };
        template
            .replace("{run_id}", run)
            .replace("{letter_id}", &letter.to_string())
    }

    /// A request of `method path` with `all`'s key and `headers`.
    async fn keyed(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Answer {
        self.keyed_on("public", method, path, headers, body).await
    }

    /// A request of `method path` on `listener` with `headers` and the key
    /// that listener's run routes take: `all`'s on the public one, the
    /// operator's on the admin one.
    async fn keyed_on(
        &self,
        listener: &str,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Answer {
        let auth = bearer(self.token(listener));
        let mut headers = headers.to_vec();
        headers.push((auth.0, &auth.1));
        exchange(self.addr(listener), request(method, path, &headers, body)).await
    }

    /// The key the run routes of `listener` take.
    fn token(&self, listener: &str) -> &str {
        if listener == "admin" {
            &self.admin
        } else {
            &self.all
        }
    }
}

/// A body each operation takes.
fn good_body(verb: &str, template: &str) -> Vec<u8> {
    match (verb, template) {
        ("post", "/v1/runs") => json!({"workflow": "example"}).to_string().into_bytes(),
        ("post", "/v1/runs/{run_id}/signals") => json!({"name": "poke"}).to_string().into_bytes(),
        // A set that matches no letter: the stage's letters are replayed
        // and discarded one by one.
        ("post", "/v1/dead-letters/replay") => json!({"filter": {"class": "none-such"}})
            .to_string()
            .into_bytes(),
        ("post", "/v1/dead-letters/{letter_id}/discard") => {
            json!({"reason": "tested"}).to_string().into_bytes()
        }
        _ => Vec::new(),
    }
}

/// A run of `acme` whose first step was declined.
async fn failed_run(env: &Env, token: &str) -> String {
    let auth = bearer(token);
    let (status, body) = http(
        env.addr,
        "POST",
        "/v1/runs",
        &[(auth.0, &auth.1)],
        &good_body("post", "/v1/runs"),
    )
    .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let decision: Value = serde_json::from_slice(&body).unwrap();
    let run_id = decision["run_id"].as_str().unwrap().to_owned();
    let pool = &env.db.pool;
    let stamp: uuid::Uuid = eventually("the first attempt is dispatched", WAIT, || async {
        sqlx::query_scalar("SELECT stamp FROM run_attempts WHERE run_id = $1")
            .bind(&run_id)
            .fetch_optional(pool)
            .await
            .unwrap()
    })
    .await;
    let declined = json!({"type": "attempt.result", "schema_version": 1, "run_id": run_id,
        "tenant": "acme", "stamp": stamp, "outcome": "failed",
        "error": {"message": "declined", "retryable": false}});
    let topic = env.config.topic_names().attempt_results();
    produce(
        &producer(),
        &topic,
        &run_id,
        declined.to_string().as_bytes(),
        &[],
    )
    .await;
    until_status(env, &run_id, "failed").await;
    run_id
}

async fn until_status(env: &Env, run_id: &str, status: &str) {
    eventually(&format!("{run_id} is {status}"), WAIT, || async {
        let now: String = sqlx::query_scalar("SELECT status FROM runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(&env.db.pool)
            .await
            .unwrap();
        (now == status).then_some(())
    })
    .await;
}

/// The id of the dead letter of a signal of `acme` for `run_id`, which no
/// run has: produced to the wakeups topic, refused, recorded.
async fn dead_letter(env: &Env, run_id: &str) -> i64 {
    let signal = json!({"type": "wakeup.signal", "schema_version": 1, "run_id": run_id,
        "tenant": "acme", "signal_id": "s", "name": "poke", "payload": null});
    let topic = env.config.topic_names().wakeups();
    produce(
        &producer(),
        &topic,
        run_id,
        signal.to_string().as_bytes(),
        &[],
    )
    .await;
    eventually("the signal is dead-lettered", WAIT, || async {
        sqlx::query_scalar("SELECT id FROM dead_letters WHERE run_id = $1")
            .bind(run_id)
            .fetch_optional(&env.db.pool)
            .await
            .unwrap()
    })
    .await
}

#[tokio::test]
async fn every_route_is_described_and_each_described_status_is_produced() {
    let doc: Value = serde_json::from_str(&committed()).expect("the document is JSON");
    let mut described = Described::new(doc);
    let env = Env::start(|c| {
        c.server.admin_auth = AdminAuth::Key;
        // Room for a refusal without a key of every keyed route of both
        // listeners before the address counts as guessing (the last phase
        // spends it on purpose).
        c.server.auth_failure_burst = 100;
        c.server.body_read_timeout_ms = 300;
        c.coordinator.stall_after_ms = 500;
        c.routing.max_body_bytes = 4096;
        c.routing.pools.insert(
            "strict".into(),
            PoolRouting {
                duplicate_policy: Some(DuplicatePolicy::Reject),
                wait_timeout_ms: None,
            },
        );
    })
    .await;
    let all = api_key(&env.db, "acme", &Scope::ALL).await;
    let admin = api_key(&env.db, "ops", &[Scope::Admin]).await;
    let auth = bearer(&all);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (status, body) = http(
            env.addr,
            "POST",
            "/v1/runs",
            &[(auth.0, &auth.1)],
            &good_body("post", "/v1/runs"),
        )
        .await;
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
        let decision: Value = serde_json::from_slice(&body).unwrap();
        runs.push(decision["run_id"].as_str().unwrap().to_owned());
    }
    let (replayed, discarded) = (
        dead_letter(&env, "gone-a").await,
        dead_letter(&env, "gone-b").await,
    );
    let failed = [failed_run(&env, &all).await, failed_run(&env, &all).await];
    let stage = Stage {
        env,
        all,
        admin,
        victim: runs.pop().unwrap(),
        run: runs.pop().unwrap(),
        failed,
        replayed,
        discarded,
    };

    served_document(&stage, &mut described).await;
    routes_are_the_table_s(&stage, &described).await;
    scopes_are_as_described(&stage, &mut described).await;
    answers(&stage, &mut described).await;
    refusals(&stage, &mut described).await;
    heads_too_large(&stage, &mut described).await;
    unavailable(&stage, &mut described).await;
    not_ready(&stage, &mut described).await;
    rate_limited(&stage, &mut described).await;
    stage.env.stop().await;
    missing_tenant(&mut described).await;

    let documented = described.documented();
    let unprovoked: BTreeSet<_> = documented.difference(&described.seen).cloned().collect();
    let listed: BTreeSet<_> = UNPROVOKABLE
        .iter()
        .map(|(listener, verb, path, status, _)| {
            let (listener, verb, path) = ((*listener).to_owned(), (*verb).to_owned(), *path);
            (listener, verb, path.to_owned(), *status)
        })
        .collect();
    assert!(
        listed.is_subset(&documented),
        "UNPROVOKABLE names statuses the document does not list: {:?}",
        listed.difference(&documented).collect::<Vec<_>>()
    );
    assert_eq!(
        unprovoked, listed,
        "the documented statuses no request produced are not exactly the ones listed as \
         unprovokable: produce each, or list it with its reason"
    );
}

/// `GET /v1/openapi.json` serves the committed file, as JSON, without a key.
async fn served_document(stage: &Stage, described: &mut Described) {
    let answer = exchange(stage.env.addr, request("GET", "/v1/openapi.json", &[], b"")).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-type"), Some("application/json"));
    assert!(
        answer.body == committed().into_bytes(),
        "the served document is not the committed one"
    );
    described.check("GET", "/v1/openapi.json", &answer);
}

/// The document's operations are the table's routes; each is served on
/// the listeners the document names and on no other, and a described path
/// takes no method the document does not name.
async fn routes_are_the_table_s(stage: &Stage, described: &Described) {
    let mut from_doc = BTreeSet::new();
    for (template, item) in described.doc["paths"].as_object().unwrap() {
        for verb in item.as_object().unwrap().keys() {
            for listener in described.listeners(verb, template) {
                from_doc.insert((listener, verb.clone(), template.clone()));
            }
        }
    }
    let from_table: BTreeSet<_> = ROUTES
        .iter()
        .map(|r| {
            (
                r.listener.as_str().to_owned(),
                r.verb.as_str().to_owned(),
                r.path.to_owned(),
            )
        })
        .collect();
    assert_eq!(
        from_doc, from_table,
        "the document's routes are the table's"
    );

    let paths: BTreeSet<&str> = ROUTES.iter().map(|r| r.path).collect();
    for listener in [Listener::Public, Listener::Admin] {
        let addr = stage.addr(listener.as_str());
        for template in &paths {
            let path = stage.path(template);
            for method in ["GET", "POST", "PUT", "DELETE", "PATCH"] {
                let verb = method.to_ascii_lowercase();
                let routed = from_table.contains(&(
                    listener.as_str().to_owned(),
                    verb,
                    (*template).to_owned(),
                ));
                // With a key of every scope, so that no route refuses
                // before it tells whether it takes the method.
                let auth = bearer(&stage.all);
                let answer =
                    exchange(addr, request(method, &path, &[(auth.0, &auth.1)], b"")).await;
                let served = !matches!(answer.status, 404 | 405);
                assert_eq!(
                    served,
                    routed,
                    "{method} {path} on the {} listener answered {}",
                    listener.as_str(),
                    answer.status
                );
            }
        }
    }
}

/// Each route needs what the table says, and the document says the same:
/// a keyed route refuses a key without its scope (403
/// `insufficient_scope`) and takes one with only its scope; an open one
/// takes a request without a key; an admin one (here under
/// `server.admin_auth = "key"`) refuses a request without a key (401) and
/// one with the runs scopes only (403), and takes one with `admin` only.
async fn scopes_are_as_described(stage: &Stage, described: &mut Described) {
    let env = &stage.env;
    for row in &ROUTES {
        let (verb, template) = (row.verb.as_str(), row.path);
        let method = row.verb.method();
        let security = described.doc["paths"][template][verb]["security"].clone();
        let requirements = security.as_array().unwrap();
        let body = good_body(verb, template);
        let addr = stage.addr(row.listener.as_str());
        let path = stage.path(template);
        let call = |token: Option<String>| {
            let path = path.clone();
            let body = body.clone();
            async move {
                let header = token.map(|t| bearer(&t));
                let headers: Vec<(&str, &str)> =
                    header.iter().map(|(k, v)| (*k, v.as_str())).collect();
                exchange(addr, request(method, &path, &headers, &body)).await
            }
        };
        let (refused, passing) = match row.access {
            Access::Open => {
                let open = requirements.is_empty() || requirements.contains(&json!({}));
                assert!(open, "{row:?}: {security}");
                let answer = call(None).await;
                assert!(
                    !matches!(answer.status, 401 | 403),
                    "{row:?}: {}",
                    answer.status
                );
                described.check_on(row.listener.as_str(), method, template, &answer);
                continue;
            }
            Access::Key(scope) => {
                let needed = json!({ "apiKey": [scope.as_str()] });
                assert!(requirements.contains(&needed), "{row:?}: {security}");
                let others: Vec<Scope> = Scope::ALL.into_iter().filter(|s| *s != scope).collect();
                (others, vec![scope])
            }
            Access::Admin => {
                let needed = json!({ "apiKey": ["admin"] });
                assert!(requirements.contains(&needed), "{row:?}: {security}");
                assert!(!requirements.contains(&json!({})), "{row:?}: {security}");
                let answer = call(None).await;
                assert_eq!(answer.status, 401, "{row:?} without a key");
                described.check_on(row.listener.as_str(), method, template, &answer);
                (vec![Scope::RunsRead, Scope::RunsWrite], vec![Scope::Admin])
            }
            Access::AdminKey => {
                assert!(
                    requirements.contains(&json!({ "apiKey": ["admin"] })),
                    "{row:?}"
                );
                let answer = call(None).await;
                assert_eq!(answer.status, 401, "{row:?} without a key");
                described.check_on(row.listener.as_str(), method, template, &answer);
                (vec![Scope::RunsRead, Scope::RunsWrite], vec![Scope::Admin])
            }
            Access::Writer => {
                let either = json!([{ "apiKey": ["runs:write"] }, { "apiKey": ["admin"] }]);
                assert_eq!(security, either, "{row:?}");
                (vec![Scope::RunsRead], vec![Scope::RunsWrite])
            }
            Access::Reader => {
                let either = json!([{ "apiKey": ["runs:read"] }, { "apiKey": ["admin"] }]);
                assert_eq!(security, either, "{row:?}");
                let answer = call(Some(api_key(&env.db, "ops", &[Scope::Admin]).await)).await;
                assert!(
                    !matches!(answer.status, 401 | 403),
                    "{row:?} with an admin key"
                );
                described.check_on(row.listener.as_str(), method, template, &answer);
                (vec![Scope::RunsWrite], vec![Scope::RunsRead])
            }
        };
        let answer = call(Some(api_key(&env.db, "acme", &refused).await)).await;
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (403, "insufficient_scope"),
            "{row:?} with a key of {refused:?}"
        );
        described.check_on(row.listener.as_str(), method, template, &answer);
        let answer = call(Some(api_key(&env.db, "acme", &passing).await)).await;
        assert!(
            !matches!(answer.status, 401 | 403),
            "{row:?} with a key of {passing:?} only: {}",
            answer.status
        );
        described.check_on(row.listener.as_str(), method, template, &answer);
    }
}

/// The answers that are not refusals and that the phase of the scopes did
/// not give: a duplicate start, and a signal the run has recorded.
async fn answers(stage: &Stage, described: &mut Described) {
    let start = json!({"workflow": "example", "input": {"n": 1}}).to_string();
    let once = [("Idempotency-Key", "once")];
    let first = stage
        .keyed("POST", "/v1/runs", &once, start.as_bytes())
        .await;
    assert_eq!(first.status, 201);
    described.check("POST", "/v1/runs", &first);
    let again = stage
        .keyed("POST", "/v1/runs", &once, start.as_bytes())
        .await;
    assert_eq!(again.status, 200);
    assert_eq!(
        again.body, first.body,
        "a duplicate gets the first decision, byte for byte"
    );
    described.check("POST", "/v1/runs", &again);

    let template = "/v1/runs/{run_id}/signals";
    let path = stage.path(template);
    let signal = json!({"name": "poke", "signal_id": "s-1", "payload": {"n": 1}}).to_string();
    let sent = stage.keyed("POST", &path, &[], signal.as_bytes()).await;
    assert_eq!(sent.status, 202);
    described.check("POST", template, &sent);
    let pool = &stage.env.db.pool;
    eventually("the run records the signal", WAIT, || async {
        let recorded: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM runs, jsonb_array_elements(state->'signals') s \
             WHERE run_id = $1 AND s->>'signal_id' = 's-1')",
        )
        .bind(&stage.run)
        .fetch_one(pool)
        .await
        .unwrap();
        recorded.then_some(())
    })
    .await;
    let again = stage.keyed("POST", &path, &[], signal.as_bytes()).await;
    assert_eq!(
        (again.status, again.json()["status"].as_str()),
        (200, Some("duplicate"))
    );
    described.check("POST", template, &again);
    let other = json!({"name": "poke", "signal_id": "s-1", "payload": {"n": 2}}).to_string();
    let refused = stage.keyed("POST", &path, &[], other.as_bytes()).await;
    assert_eq!(
        (refused.status, refused.code().as_str()),
        (422, "idempotency_mismatch")
    );
    described.check("POST", template, &refused);

    // A failed run retried on each listener, then the same retry again.
    let template = "/v1/runs/{run_id}/retry";
    for (listener, run) in [("public", &stage.failed[0]), ("admin", &stage.failed[1])] {
        let path = template.replace("{run_id}", run);
        let body = json!({"action_id": "again"}).to_string();
        let sent = stage
            .keyed_on(listener, "POST", &path, &[], body.as_bytes())
            .await;
        assert_eq!(sent.status, 202, "{listener}");
        described.check_on(listener, "POST", template, &sent);
        until_status(&stage.env, run, "running").await;
        let again = stage
            .keyed_on(listener, "POST", &path, &[], body.as_bytes())
            .await;
        assert_eq!(
            (again.status, again.json()["status"].as_str()),
            (200, Some("applied")),
            "{listener}"
        );
        described.check_on(listener, "POST", template, &again);
    }
}

/// The start of a request whose body, promised, never comes.
fn slow(path: &str, token: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: ductor\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
    )
    .into_bytes()
}

/// The refusals of the run endpoints, each provoked as a caller would.
async fn refusals(stage: &Stage, described: &mut Described) {
    let env = &stage.env;
    let writes = [
        ("public", "/v1/runs", json!({"workflow": "example"})),
        (
            "public",
            "/v1/runs/{run_id}/signals",
            json!({"name": "poke"}),
        ),
        (
            "public",
            "/v1/runs/{run_id}/cancel",
            json!({"reason": "done"}),
        ),
        (
            "admin",
            "/v1/runs/{run_id}/cancel",
            json!({"reason": "done"}),
        ),
        ("public", "/v1/runs/{run_id}/retry", json!({})),
        ("admin", "/v1/runs/{run_id}/retry", json!({})),
    ];
    for (listener, template, good) in writes {
        let path = stage.path(template);
        let mut refuse = async |headers: &[(&str, &str)], body: &[u8], status: u16, code: &str| {
            let answer = stage.keyed_on(listener, "POST", &path, headers, body).await;
            assert_eq!(
                (answer.status, answer.code().as_str()),
                (status, code),
                "POST {path} on the {listener} listener"
            );
            described.check_on(listener, "POST", template, &answer);
        };
        refuse(&[], b"[1]", 400, "invalid_request").await;
        refuse(&[], b"{\"a\": 1, \"a\": 2}", 422, "duplicate_key").await;
        refuse(&[], &[b' '; 5000], 413, "body_too_large").await;
        let plain = [("Content-Type", "text/plain")];
        refuse(
            &plain,
            good.to_string().as_bytes(),
            415,
            "unsupported_media_type",
        )
        .await;
        let mut theirs = good.clone();
        theirs["tenant"] = "globex".into();
        refuse(&[], theirs.to_string().as_bytes(), 403, "tenant_mismatch").await;

        let answer = exchange(stage.addr(listener), slow(&path, stage.token(listener))).await;
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (408, "body_timeout")
        );
        described.check_on(listener, "POST", template, &answer);
    }
    let refuse_signal = stage
        .keyed(
            "POST",
            &stage.path("/v1/runs/{run_id}/signals"),
            &[],
            b"{\"name\": \"\"}",
        )
        .await;
    assert_eq!(
        (refuse_signal.status, refuse_signal.code().as_str()),
        (400, "invalid")
    );
    described.check("POST", "/v1/runs/{run_id}/signals", &refuse_signal);

    // Without a key, and about a run the tenant does not have.
    for row in ROUTES.iter().filter(|r| {
        matches!(
            r.access,
            Access::Key(_) | Access::Reader | Access::Writer | Access::Admin
        )
    }) {
        let (method, template) = (row.verb.method(), row.path);
        let listener = row.listener.as_str();
        let body = good_body(row.verb.as_str(), template);
        let bytes = request(method, &stage.path(template), &[], &body);
        let answer = exchange(stage.addr(listener), bytes).await;
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (401, "unauthenticated")
        );
        described.check_on(row.listener.as_str(), method, template, &answer);
        if template.contains("{run_id}") || template.contains("{letter_id}") {
            let path = template
                .replace("{run_id}", "nope")
                .replace("{letter_id}", "999999999");
            let answer = stage.keyed_on(listener, method, &path, &[], &body).await;
            assert_eq!(
                (answer.status, answer.code().as_str()),
                (404, "not_found"),
                "{path}"
            );
            described.check_on(row.listener.as_str(), method, template, &answer);
        }
    }

    // On either listener, the operator's routes that take a body refuse
    // one before they read it as theirs; a replayed letter is not
    // discarded, a discarded one not replayed; a listing's query is read
    // strictly.
    for listener in ["public", "admin"] {
        operator_refusals(stage, described, listener).await;
    }

    // A search with a parameter it does not know, on either listener.
    for listener in ["public", "admin"] {
        for template in ["/v1/runs", "/v1/runs/counts"] {
            let path = format!("{template}?colour=blue");
            let answer = stage.keyed_on(listener, "GET", &path, &[], b"").await;
            assert_eq!(
                (answer.status, answer.code().as_str()),
                (400, "invalid_query")
            );
            described.check_on(listener, "GET", template, &answer);
        }
    }

    // A key another caller holds, deciding, under the `reject` policy.
    let strict = json!({"workflow": "example", "tenant": "acme", "pool": "strict"});
    let fingerprint =
        ductor::api::start::route_request_from_body(strict.clone(), Some("busy".into()))
            .unwrap()
            .fingerprint;
    ductor::routing::reserve(&env.db.pool, "acme", "strict", "busy", &fingerprint, WAIT)
        .await
        .unwrap()
        .expect("the key is free");
    let busy = [("Idempotency-Key", "busy")];
    let answer = stage
        .keyed("POST", "/v1/runs", &busy, strict.to_string().as_bytes())
        .await;
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (409, "in_progress")
    );
    described.check("POST", "/v1/runs", &answer);
    let unknown = json!({"workflow": "nope"}).to_string();
    let answer = stage
        .keyed("POST", "/v1/runs", &[], unknown.as_bytes())
        .await;
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (422, "unknown_workflow")
    );
    described.check("POST", "/v1/runs", &answer);

    // A run retention deleted: its tombstone, as retention writes it.
    sqlx::query(
        "INSERT INTO run_tombstones (run_id, tenant_scope, workflow_name, workflow_version, \
         status, last_transition_seq, created_at, finished_at) \
         VALUES ('gone-1', 'acme', 'example', 1, 'succeeded', 3, now(), now())",
    )
    .execute(&env.db.owner)
    .await
    .unwrap();
    let answer = stage.keyed("GET", "/v1/runs/gone-1", &[], b"").await;
    assert_eq!((answer.status, answer.code().as_str()), (410, "run_purged"));
    described.check("GET", "/v1/runs/{run_id}", &answer);
}

/// The refusals of the operator's routes on `listener`: the redrive's,
/// the dead letters' bodies, settled letters, unknown query parameters.
async fn operator_refusals(stage: &Stage, described: &mut Described, listener: &str) {
    let addr = stage.addr(listener);
    let token = stage.token(listener);
    // A redrive's body: refused before it is read as one.
    let redrive = "/v1/outbox/redrive";
    for (headers, body, status, code) in [
        (vec![], b"[1]".to_vec(), 400, "invalid_request"),
        (vec![], b"{\"colour\": 1}".to_vec(), 400, "invalid_request"),
        (vec![], vec![b' '; 5000], 413, "body_too_large"),
        (
            vec![("Content-Type", "text/plain")],
            b"{}".to_vec(),
            415,
            "unsupported_media_type",
        ),
    ] {
        let answer = stage
            .keyed_on(listener, "POST", redrive, &headers, &body)
            .await;
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (status, code),
            "{redrive} on the {listener} listener"
        );
        described.check_on(listener, "POST", redrive, &answer);
    }
    let answer = exchange(addr, slow(redrive, token)).await;
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (408, "body_timeout")
    );
    described.check_on(listener, "POST", redrive, &answer);

    // Dead letters: a replayed one is not discarded, a discarded one not
    // replayed; bodies refused before they are read.
    let settled = [
        (
            format!("/v1/dead-letters/{}/discard", stage.replayed),
            "/v1/dead-letters/{letter_id}/discard",
        ),
        (
            format!("/v1/dead-letters/{}/replay", stage.discarded),
            "/v1/dead-letters/{letter_id}/replay",
        ),
    ];
    for (path, template) in settled {
        let body = json!({"reason": "again"}).to_string();
        let answer = stage
            .keyed_on(listener, "POST", &path, &[], body.as_bytes())
            .await;
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (409, "letter_settled"),
            "{path} on the {listener} listener"
        );
        described.check_on(listener, "POST", template, &answer);
    }
    for template in [
        "/v1/dead-letters/replay",
        "/v1/dead-letters/{letter_id}/discard",
    ] {
        let path = stage.path(template);
        for (headers, body, status, code) in [
            (vec![], b"[1]".to_vec(), 400, "invalid_request"),
            (vec![], vec![b' '; 5000], 413, "body_too_large"),
            (
                vec![("Content-Type", "text/plain")],
                b"{}".to_vec(),
                415,
                "unsupported_media_type",
            ),
        ] {
            let answer = stage
                .keyed_on(listener, "POST", &path, &headers, &body)
                .await;
            assert_eq!(
                (answer.status, answer.code().as_str()),
                (status, code),
                "{path} on the {listener} listener"
            );
            described.check_on(listener, "POST", template, &answer);
        }
        let answer = exchange(addr, slow(&path, token)).await;
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (408, "body_timeout")
        );
        described.check_on(listener, "POST", template, &answer);
    }
    for template in ["/v1/dead-letters", "/v1/dead-letters/counts"] {
        let answer = stage
            .keyed_on(
                listener,
                "GET",
                &format!("{template}?colour=blue"),
                &[],
                b"",
            )
            .await;
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (400, "invalid_query")
        );
        described.check_on(listener, "GET", template, &answer);
    }
}

/// Every route answers a head over the listener's bound with 431.
async fn heads_too_large(stage: &Stage, described: &mut Described) {
    let pad = "a".repeat(ductor::infra::http_server::MAX_HEADER_BYTES + 1024);
    for row in &ROUTES {
        let (method, template) = (row.verb.method(), row.path);
        let bytes = request(method, &stage.path(template), &[("X-Pad", &pad)], b"");
        let answer = exchange(stage.addr(row.listener.as_str()), bytes).await;
        assert_eq!(answer.status, 431, "{row:?}");
        described.check_on(row.listener.as_str(), method, template, &answer);
    }
}

/// Every keyed route answers 503 `unavailable` while the keys cannot be
/// read (the application role may not, for a moment).
async fn unavailable(stage: &Stage, described: &mut Described) {
    let env = &stage.env;
    let role: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&env.db.pool)
        .await
        .unwrap();
    sqlx::query(&format!("REVOKE SELECT ON api_keys FROM \"{role}\""))
        .execute(&env.db.owner)
        .await
        .unwrap();
    for row in ROUTES.iter().filter(|r| r.access != Access::Open) {
        let (method, template) = (row.verb.method(), row.path);
        let token = if matches!(row.access, Access::AdminKey | Access::Admin) {
            &stage.admin
        } else {
            &stage.all
        };
        let auth = bearer(token);
        let body = good_body(row.verb.as_str(), template);
        let bytes = request(method, &stage.path(template), &[(auth.0, &auth.1)], &body);
        let answer = exchange(stage.addr(row.listener.as_str()), bytes).await;
        assert_eq!(
            (answer.status, answer.code().as_str()),
            (503, "unavailable"),
            "{row:?}"
        );
        described.check_on(row.listener.as_str(), method, template, &answer);
    }
    sqlx::query(&format!("GRANT SELECT ON api_keys TO \"{role}\""))
        .execute(&env.db.owner)
        .await
        .unwrap();
    let answer = stage
        .keyed("GET", &stage.path("/v1/runs/{run_id}"), &[], b"")
        .await;
    assert_eq!(answer.status, 200, "the keys can be read again");
}

/// Both `/readyz` answer 503 while an apply lane is stalled (a lock on
/// `runs` held by someone else), and 200 once it commits.
async fn not_ready(stage: &Stage, described: &mut Described) {
    let env = &stage.env;
    let auth = bearer(&stage.admin);
    let admin_readyz = || {
        exchange(
            env.admin,
            request("GET", "/readyz", &[(auth.0, &auth.1)], b""),
        )
    };
    // As the owner: serve's role may not take such a lock.
    let mut lock = env.db.owner.begin().await.unwrap();
    sqlx::query("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let run_id = unique("stalled-");
    let start = json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
                       "tenant": "acme", "workflow": "example"});
    let requests = env.config.topic_names().requests();
    produce(
        &producer(),
        &requests,
        &run_id,
        start.to_string().as_bytes(),
        &[],
    )
    .await;
    // A poll: the lane holds its batch on its own loop until it counts as
    // stalled, and readiness is checked on its own task.
    let answer = eventually("readiness fails", WAIT, || async {
        let answer = admin_readyz().await;
        (answer.status == 503).then_some(answer)
    })
    .await;
    assert_eq!(answer.json()["ingress"]["ok"], false);
    described.check_on("admin", "GET", "/readyz", &answer);
    let answer = exchange(env.addr, request("GET", "/readyz", &[], b"")).await;
    assert_eq!(answer.status, 503);
    described.check("GET", "/readyz", &answer);
    lock.rollback().await.unwrap();
    eventually("readiness recovers", WAIT, || async {
        (admin_readyz().await.status == 200).then_some(())
    })
    .await;
}

/// Every route of both listeners answers 429 to an address past its failed
/// authentications (`server.auth_failure_burst`, then one a second).
async fn rate_limited(stage: &Stage, described: &mut Described) {
    let guess = format!("dk_{:016x}_{}", 7, "0".repeat(64));
    let fail = || {
        let auth = bearer(&guess);
        exchange(
            stage.env.addr,
            request("GET", "/v1/runs/nope", &[(auth.0, &auth.1)], b""),
        )
    };
    let mut tries = 0;
    while fail().await.status != 429 {
        tries += 1;
        assert!(tries < 200, "the address's failures are never used up");
    }
    for row in &ROUTES {
        let (method, template) = (row.verb.method(), row.path);
        let body = good_body(row.verb.as_str(), template);
        let bytes = request(method, &stage.path(template), &[], &body);
        let addr = stage.addr(row.listener.as_str());
        // A second may pass between two requests and let one through: fail
        // again first.
        let answer = eventually("the route is refused", WAIT, || async {
            fail().await;
            let answer = exchange(addr, bytes.clone()).await;
            (answer.status == 429).then_some(answer)
        })
        .await;
        assert_eq!(answer.code(), "rate_limited", "{row:?}");
        described.check_on(row.listener.as_str(), method, template, &answer);
    }
}

/// Without authentication, a run endpoint's request must name its tenant.
async fn missing_tenant(described: &mut Described) {
    let env = Env::start(|c| c.server.auth = AuthMode::Disabled).await;
    let answer = exchange(env.addr, request("GET", "/v1/runs/nope", &[], b"")).await;
    assert_eq!(
        (answer.status, answer.code().as_str()),
        (400, "missing_tenant")
    );
    described.check("GET", "/v1/runs/{run_id}", &answer);
    env.stop().await;
}
