//! `ductor runs list|counts|show|cancel|retry`, `ductor dlq
//! list|show|replay|discard` and `ductor outbox status|redrive`:
//! the operator's views and actions from a terminal or a script, over the
//! same HTTP API the console uses (see [`crate::api::operator`]).
//!
//! In: a command's arguments and an [`ApiClient`]. Out: what the command
//! prints — a readable table, or the API's JSON (`--output json`) — or a
//! [`CliError`]. Guarantees: the tables are pure functions of the API's
//! answers, unit-tested; a JSON output is the API's answer as it came (for
//! `runs list --all`, the pages' runs in one answer).

use serde_json::{Value, json};

use super::client::{ApiClient, CliError};

/// How a command prints its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// The filters of `runs list` and `runs counts`, as the API's query
/// parameters.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RunFilterArgs {
    /// Runs of this tenant (a key with the admin scope sees every tenant
    /// without it).
    #[arg(long)]
    pub tenant: Option<String>,
    #[arg(long)]
    pub workflow: Option<String>,
    /// A version of `--workflow`.
    #[arg(long)]
    pub version: Option<u32>,
    /// running, succeeded, failed or cancelled.
    #[arg(long)]
    pub status: Option<String>,
    /// The current step's index (0-based).
    #[arg(long)]
    pub step: Option<u32>,
    #[arg(long)]
    pub correlation_id: Option<String>,
    /// Created at or after this RFC 3339 time.
    #[arg(long)]
    pub created_after: Option<String>,
    /// Created before this RFC 3339 time.
    #[arg(long)]
    pub created_before: Option<String>,
}

impl RunFilterArgs {
    /// The query string of these filters, and of `extra` pairs.
    pub fn query(&self, extra: &[(&str, String)]) -> String {
        let mut pairs = url::form_urlencoded::Serializer::new(String::new());
        let fields = [
            ("tenant", self.tenant.clone()),
            ("workflow", self.workflow.clone()),
            ("version", self.version.map(|v| v.to_string())),
            ("status", self.status.clone()),
            ("step", self.step.map(|s| s.to_string())),
            ("correlation_id", self.correlation_id.clone()),
            ("created_after", self.created_after.clone()),
            ("created_before", self.created_before.clone()),
        ];
        for (name, value) in fields {
            if let Some(value) = value {
                pairs.append_pair(name, &value);
            }
        }
        for (name, value) in extra {
            pairs.append_pair(name, value);
        }
        let text = pairs.finish();
        if text.is_empty() {
            text
        } else {
            format!("?{text}")
        }
    }
}

/// `ductor runs list`: a page (or, with `all`, every page) of runs.
pub async fn list_runs(
    client: &ApiClient,
    filter: &RunFilterArgs,
    limit: Option<u32>,
    after: Option<String>,
    all: bool,
    output: Output,
) -> Result<String, CliError> {
    let mut runs = Vec::new();
    let mut after = after;
    loop {
        let mut extra = Vec::new();
        if let Some(limit) = limit {
            extra.push(("limit", limit.to_string()));
        }
        if let Some(after) = &after {
            extra.push(("after", after.clone()));
        }
        let page = client
            .get(&format!("/v1/runs{}", filter.query(&extra)))
            .await?;
        runs.extend(page["runs"].as_array().cloned().unwrap_or_default());
        after = page["next"].as_str().map(str::to_owned);
        if !all || after.is_none() {
            break;
        }
    }
    let page = json!({ "runs": runs, "next": after });
    Ok(match output {
        Output::Json => page.to_string(),
        Output::Table => runs_table(&page),
    })
}

/// `ductor runs counts`.
pub async fn count_runs(
    client: &ApiClient,
    filter: &RunFilterArgs,
    output: Output,
) -> Result<String, CliError> {
    let counts = client
        .get(&format!("/v1/runs/counts{}", filter.query(&[])))
        .await?;
    Ok(match output {
        Output::Json => counts.to_string(),
        Output::Table => counts_table(&counts),
    })
}

/// `ductor runs show`.
pub async fn show_run(
    client: &ApiClient,
    run_id: &str,
    output: Output,
) -> Result<String, CliError> {
    let path = format!("/v1/runs/{}/history", encode(run_id));
    let history = client.get(&path).await?;
    Ok(match output {
        Output::Json => history.to_string(),
        Output::Table => history_text(&history),
    })
}

/// What `ductor runs cancel` and `ductor runs retry` ask of a run.
pub struct ActionArgs {
    pub reason: Option<String>,
    /// The action's name; the server picks one when it is absent. Sent
    /// again with the same one, a retry retries the run at most once.
    pub action_id: Option<String>,
}

impl ActionArgs {
    fn body(self) -> Value {
        let mut body = json!({});
        if let Some(reason) = self.reason {
            body["reason"] = json!(reason);
        }
        if let Some(action_id) = self.action_id {
            body["action_id"] = json!(action_id);
        }
        body
    }
}

/// `ductor runs cancel`.
pub async fn cancel_run(
    client: &ApiClient,
    run_id: &str,
    args: ActionArgs,
) -> Result<String, CliError> {
    let path = format!("/v1/runs/{}/cancel", encode(run_id));
    Ok(client.post(&path, &args.body()).await?.to_string())
}

/// `ductor runs retry`: the run, failed, starts again from the step it
/// failed in. The answer names the action id, to send again safely.
pub async fn retry_run(
    client: &ApiClient,
    run_id: &str,
    args: ActionArgs,
) -> Result<String, CliError> {
    let path = format!("/v1/runs/{}/retry", encode(run_id));
    Ok(client.post(&path, &args.body()).await?.to_string())
}

/// `ductor outbox status`.
pub async fn outbox_status(client: &ApiClient, output: Output) -> Result<String, CliError> {
    let picture = client.get("/v1/outbox").await?;
    Ok(match output {
        Output::Json => picture.to_string(),
        Output::Table => outbox_table(&picture),
    })
}

/// `ductor outbox redrive`.
pub async fn redrive(
    client: &ApiClient,
    run_id: Option<String>,
    topic: Option<String>,
) -> Result<String, CliError> {
    let body = json!({ "run_id": run_id, "topic": topic });
    Ok(client.post("/v1/outbox/redrive", &body).await?.to_string())
}

/// The filters of `dlq list`, as the API's query parameters.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LetterFilterArgs {
    /// Letters of this tenant (a key with the admin scope sees every
    /// tenant's without it).
    #[arg(long)]
    pub tenant: Option<String>,
    /// The error class (malformed, unknown_run, ...).
    #[arg(long)]
    pub class: Option<String>,
    /// The stage that refused the input (decode, validate, route, apply).
    #[arg(long)]
    pub stage: Option<String>,
    #[arg(long)]
    pub source_topic: Option<String>,
    /// pending, replaying, replayed or discarded.
    #[arg(long)]
    pub status: Option<String>,
    /// Dead-lettered at or after this RFC 3339 time.
    #[arg(long)]
    pub since: Option<String>,
    /// Dead-lettered before this RFC 3339 time.
    #[arg(long)]
    pub until: Option<String>,
}

impl LetterFilterArgs {
    fn pairs(&self) -> Vec<(&'static str, String)> {
        [
            ("tenant", &self.tenant),
            ("class", &self.class),
            ("stage", &self.stage),
            ("source_topic", &self.source_topic),
            ("status", &self.status),
            ("since", &self.since),
            ("until", &self.until),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.clone().map(|v| (name, v)))
        .collect()
    }

    /// The API's `filter` object of these filters (the tenant apart).
    fn filter(&self) -> Value {
        let mut filter = serde_json::Map::new();
        for (name, value) in self.pairs() {
            if name != "tenant" {
                filter.insert(name.to_owned(), Value::String(value));
            }
        }
        Value::Object(filter)
    }
}

/// `ductor dlq list`: a page of dead letters, newest first.
pub async fn list_letters(
    client: &ApiClient,
    filter: &LetterFilterArgs,
    limit: Option<u32>,
    after: Option<i64>,
    output: Output,
) -> Result<String, CliError> {
    let mut pairs = url::form_urlencoded::Serializer::new(String::new());
    for (name, value) in filter.pairs() {
        pairs.append_pair(name, &value);
    }
    if let Some(limit) = limit {
        pairs.append_pair("limit", &limit.to_string());
    }
    if let Some(after) = after {
        pairs.append_pair("after", &after.to_string());
    }
    let page = client
        .get(&format!("/v1/dead-letters?{}", pairs.finish()))
        .await?;
    Ok(match output {
        Output::Json => page.to_string(),
        Output::Table => letters_table(&page),
    })
}

/// `ductor dlq show`: one letter, whole, as JSON.
pub async fn show_letter(client: &ApiClient, id: i64) -> Result<String, CliError> {
    let letter = client.get(&format!("/v1/dead-letters/{id}")).await?;
    Ok(serde_json::to_string_pretty(&letter).unwrap_or_default())
}

/// `ductor dlq replay ID`, or with filters and no id, the letters they
/// find (one page; `{}` for all).
pub async fn replay_letters(
    client: &ApiClient,
    id: Option<i64>,
    filter: &LetterFilterArgs,
) -> Result<String, CliError> {
    let answer = match id {
        Some(id) => {
            client
                .post(&format!("/v1/dead-letters/{id}/replay"), &json!({}))
                .await?
        }
        None => {
            let body = json!({ "tenant": filter.tenant, "filter": filter.filter() });
            client.post("/v1/dead-letters/replay", &body).await?
        }
    };
    Ok(answer.to_string())
}

/// `ductor dlq discard ID --reason R`.
pub async fn discard_letter(client: &ApiClient, id: i64, reason: &str) -> Result<String, CliError> {
    let path = format!("/v1/dead-letters/{id}/discard");
    Ok(client
        .post(&path, &json!({ "reason": reason }))
        .await?
        .to_string())
}

/// `dlq list`'s table.
pub fn letters_table(page: &Value) -> String {
    let rows: Vec<Vec<String>> = page["letters"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|l| {
            vec![
                text(&l["id"]),
                text(&l["dead_lettered_at"]),
                format!("{}/{}", text(&l["stage"]), text(&l["class"])),
                text(&l["tenant"]),
                text(&l["run_id"]),
                text(&l["status"]),
                text(&l["error"]),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "ID",
            "AT",
            "STAGE/CLASS",
            "TENANT",
            "RUN",
            "STATUS",
            "ERROR",
        ],
        &rows,
    );
    if let Some(next) = page["next"].as_i64() {
        out.push_str(&format!("\nmore: --after {next}"));
    }
    out
}

/// A run id as one path segment.
fn encode(segment: &str) -> String {
    url::form_urlencoded::byte_serialize(segment.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

/// Rows under a header, each column as wide as its widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join("  ").trim_end().to_owned()
    };
    let mut out = vec![line(header.iter().map(|h| (*h).to_owned()).collect())];
    out.extend(rows.iter().map(|r| line(r.clone())));
    out.join("\n")
}

fn text(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `runs list`'s table.
pub fn runs_table(page: &Value) -> String {
    let rows: Vec<Vec<String>> = page["runs"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|r| {
            vec![
                text(&r["run_id"]),
                text(&r["tenant"]),
                format!("{}@{}", text(&r["workflow"]), text(&r["workflow_version"])),
                text(&r["status"]),
                text(&r["step_index"]),
                text(&r["correlation_id"]),
                text(&r["created_at"]),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "RUN",
            "TENANT",
            "WORKFLOW",
            "STATUS",
            "STEP",
            "CORRELATION",
            "CREATED",
        ],
        &rows,
    );
    if let Some(next) = page["next"].as_str() {
        out.push_str(&format!("\nmore: --after {next}"));
    }
    out
}

/// `runs counts`' table.
pub fn counts_table(counts: &Value) -> String {
    let rows: Vec<Vec<String>> = ["running", "succeeded", "failed", "cancelled", "total"]
        .iter()
        .map(|s| vec![(*s).to_owned(), text(&counts[*s])])
        .collect();
    let mut out = table(&["STATUS", "RUNS"], &rows);
    if counts["exact"] == false {
        out.push_str("\n(at least: counting stopped at server.count_scan_limit)");
    }
    out
}

/// `runs show`'s text: the run, its attempts, its transitions.
pub fn history_text(history: &Value) -> String {
    let run = &history["run"];
    let mut out = vec![
        format!("run        {}", text(&run["run_id"])),
        format!("tenant     {}", text(&run["tenant"])),
        format!(
            "workflow   {}@{}",
            text(&run["workflow"]),
            text(&run["workflow_version"])
        ),
        format!(
            "status     {} (step {}, attempt {})",
            text(&run["status"]),
            text(&run["step_index"]),
            text(&run["attempt"])
        ),
        format!("created    {}", text(&run["created_at"])),
        format!("finished   {}", text(&run["finished_at"])),
        format!("input      {}", history["input"]),
        format!("output     {}", history["output"]),
        format!("error      {}", text(&history["error"])),
        String::new(),
    ];
    out.push(attempts_table(&history["attempts"]));
    out.push(String::new());
    out.push(transitions_table(&history["transitions"]));
    out.join("\n")
}

/// A run's attempts, a row each.
fn attempts_table(attempts: &Value) -> String {
    let rows: Vec<Vec<String>> = attempts
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|a| {
            vec![
                text(&a["step_index"]),
                text(&a["attempt"]),
                text(&a["status"]),
                text(&a["dispatched_at"]),
                text(&a["finished_at"]),
                text(&a["error"]),
            ]
        })
        .collect();
    table(
        &[
            "STEP",
            "ATTEMPT",
            "STATUS",
            "DISPATCHED",
            "FINISHED",
            "ERROR",
        ],
        &rows,
    )
}

/// A run's transitions, a row each, with their effects.
fn transitions_table(transitions: &Value) -> String {
    let rows: Vec<Vec<String>> = transitions
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|t| {
            let effects: Vec<String> = t["effects"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|e| format!("{} {}", text(&e["ce_type"]), text(&e["publish_status"])))
                .collect();
            vec![
                text(&t["seq"]),
                text(&t["kind"]),
                format!("{} -> {}", text(&t["from_status"]), text(&t["to_status"])),
                text(&t["created_at"]),
                effects.join(", "),
            ]
        })
        .collect();
    table(&["SEQ", "KIND", "STATUS", "AT", "EFFECTS"], &rows)
}

/// `outbox status`' table.
pub fn outbox_table(picture: &Value) -> String {
    let columns = [
        "backlog",
        "due",
        "scheduled",
        "deferred",
        "parked",
        "oldest_due_age_s",
    ];
    let row = |name: String, v: &Value| {
        let mut cells = vec![name];
        cells.extend(columns.iter().map(|c| text(&v[*c])));
        cells
    };
    let mut rows: Vec<Vec<String>> = picture["topics"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|t| row(text(&t["topic"]), t))
        .collect();
    rows.push(row("(all)".into(), picture));
    let mut out = table(
        &[
            "TOPIC",
            "BACKLOG",
            "DUE",
            "SCHEDULED",
            "DEFERRED",
            "PARKED",
            "OLDEST DUE (S)",
        ],
        &rows,
    );
    let parked: Vec<Vec<String>> = picture["parked_intents"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|p| {
            vec![
                text(&p["run_id"]),
                format!("{}/{}", text(&p["seq"]), text(&p["effect_index"])),
                text(&p["topic"]),
                text(&p["publish_failures"]),
                text(&p["last_error"]),
            ]
        })
        .collect();
    if !parked.is_empty() {
        out.push_str("\n\nparked:\n");
        out.push_str(&table(
            &["RUN", "EFFECT", "TOPIC", "FAILURES", "ERROR"],
            &parked,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_become_the_api_s_query() {
        let f = RunFilterArgs {
            tenant: Some("acme corp".into()),
            status: Some("failed".into()),
            step: Some(2),
            ..RunFilterArgs::default()
        };
        assert_eq!(
            f.query(&[("limit", "5".into())]),
            "?tenant=acme+corp&status=failed&step=2&limit=5"
        );
        assert_eq!(RunFilterArgs::default().query(&[]), "");
        assert_eq!(encode("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn a_table_lines_up_its_columns() {
        let t = table(
            &["A", "LONGER"],
            &[
                vec!["wide cell".into(), "x".into()],
                vec!["y".into(), "z".into()],
            ],
        );
        assert_eq!(t, "A          LONGER\nwide cell  x\ny          z");
    }

    #[test]
    fn the_runs_table_shows_each_run_and_how_to_go_on() {
        let page = json!({"runs": [{"run_id": "r1", "tenant": "acme", "workflow": "pay",
            "workflow_version": 2, "status": "failed", "step_index": 1, "correlation_id": null,
            "created_at": "2026-12-05T10:00:00Z"}], "next": "123.r1"});
        let t = runs_table(&page);
        assert!(
            t.starts_with("RUN  TENANT  WORKFLOW  STATUS  STEP  CORRELATION  CREATED"),
            "{t}"
        );
        assert!(t.contains("r1   acme    pay@2     failed  1     -"), "{t}");
        assert!(t.ends_with("more: --after 123.r1"), "{t}");
        let counts = json!({"running": 1, "succeeded": 2, "failed": 0, "cancelled": 0,
            "total": 3, "exact": false});
        let c = counts_table(&counts);
        assert!(c.contains("succeeded  2") && c.contains("at least"), "{c}");
    }

    #[test]
    fn dead_letters_are_a_table_and_their_filters_a_query_or_a_body() {
        let f = LetterFilterArgs {
            tenant: Some("acme".into()),
            class: Some("malformed".into()),
            ..LetterFilterArgs::default()
        };
        assert_eq!(f.filter(), json!({"class": "malformed"}));
        let page = json!({"letters": [{"id": 7, "dead_lettered_at": "2026-12-05T10:00:00Z",
            "stage": "decode", "class": "malformed", "tenant": null, "run_id": null,
            "status": "pending", "error": "not JSON"}], "next": 7});
        let t = letters_table(&page);
        assert!(t.contains("decode/malformed"), "{t}");
        assert!(t.ends_with("more: --after 7"), "{t}");
    }

    #[test]
    fn a_history_shows_attempts_and_transitions_with_their_effects() {
        let h = json!({"run": {"run_id": "r1", "status": "succeeded"}, "input": {"n": 1},
            "output": 2, "error": null,
            "attempts": [{"step_index": 0, "attempt": 1, "status": "succeeded"}],
            "transitions": [{"seq": 1, "kind": "run.started", "from_status": null,
                "to_status": "running", "effects": [{"ce_type": "ductor.step.dispatch",
                "publish_status": "delivered"}]}]});
        let t = history_text(&h);
        assert!(t.contains("input      {\"n\":1}"), "{t}");
        assert!(t.contains("run.started  - -> running"), "{t}");
        assert!(t.contains("ductor.step.dispatch delivered"), "{t}");
    }
}
