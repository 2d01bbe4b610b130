//! What `deploy/` gives Prometheus and Grafana reads only what a running
//! serve exports. The dashboard's queries, the alert rules and the series
//! of their unit tests are read for the metrics they name, and each name
//! (and each label value a matcher asks for) must be on the admin
//! `/metrics` of a serve that has just started, before anything has been
//! counted: a rule over a series that does not exist never fires. The
//! consumer lag those rules watch is checked against a real backlog. That
//! the rules and the configuration parse as Prometheus reads them, and
//! that each rule fires when it should, is `scripts/deploy-check`'s part
//! (promtool); here the files' shapes are checked against each other.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use ductor::auth::Scope;
use ductor::config::AdminAuth;
use serde_json::{Value, json};
use yaml_rust2::{Yaml, YamlLoader};

const WAIT: Duration = Duration::from_secs(60);

const DASHBOARD: &str = "deploy/grafana/dashboards/ductor.json";
const RULES: &str = "deploy/prometheus/alerts.yml";
const RULE_TESTS: &str = "deploy/prometheus/alerts_test.yml";
const PROMETHEUS: &str = "deploy/prometheus/prometheus.yml";
const DATASOURCES: &str = "deploy/grafana/provisioning/datasources/prometheus.yml";
const DASHBOARD_PROVIDERS: &str = "deploy/grafana/provisioning/dashboards/ductor.yml";

/// Series Prometheus makes itself, for every target and every alert: never
/// on a target's page.
const PROMETHEUS_OWN: [&str; 7] = [
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
    "ALERTS",
    "ALERTS_FOR_STATE",
];

/// Labels whose values are the deployment's: those Prometheus gives a
/// target's series as it scrapes them, and the topics (named after
/// `kafka.topic_prefix`).
const DEPLOYMENT_LABELS: [&str; 3] = ["job", "instance", "topic"];

/// What operators watch, by the metric that shows it: each is on the
/// dashboard and in an alert rule.
const WATCHED: [&str; 10] = [
    "ductor_ingress_consumer_lag_messages",
    "ductor_apply_seconds_bucket",
    "ductor_outbox_due",
    "ductor_outbox_oldest_due_age_seconds",
    "ductor_outbox_parked",
    "ductor_dead_letters_total",
    "ductor_apply_conflicts_total",
    "ductor_ingress_stalled_lanes",
    "ductor_api_auth_failures_total",
    "ductor_api_refused_total",
];

// ---------------------------------------------------------------------------
// Against a serve.

/// Every metric the dashboard, the rules and the rules' tests name is on a
/// fresh serve's admin `/metrics` (read with an admin key, as Prometheus
/// reads it), with every label value their matchers ask for.
#[tokio::test]
async fn every_series_the_dashboard_and_the_alerts_read_is_on_a_fresh_serve() {
    let queries = Queries::read();
    // The reader finds what a dashboard and rules of this scope read: a
    // reader that found nothing would pass everything below.
    let dashboard = queries.metrics("dashboard");
    let alerts = queries.metrics("alert rule");
    assert!(dashboard.len() >= 30, "the dashboard reads {dashboard:?}");
    assert!(alerts.len() >= 12, "the alert rules read {alerts:?}");
    for watched in WATCHED {
        assert!(dashboard.contains(watched), "no panel reads {watched}");
        assert!(alerts.contains(watched), "no alert rule reads {watched}");
    }

    let env = Serve::start(|c| {
        c.drainer.enabled = true;
        c.server.admin_auth = AdminAuth::Key;
    })
    .await;
    let key = api_key(&env.db, "ops", &[Scope::Admin]).await;
    let authorization = bearer(&key);
    let (status, _) = http(env.admin, "GET", "/metrics", &[], b"").await;
    assert_eq!(status, 401, "the admin listener takes keys");
    let text = scrape(env.admin, &[(authorization.0, authorization.1.as_str())]).await;
    let exposition = Exposition::parse(&text);
    let missing = queries.missing_from(&exposition);
    assert!(
        missing.is_empty(),
        "read by deploy/ but not on a fresh serve's /metrics:\n{}",
        missing.join("\n")
    );
    env.stop().await;
}

/// `ductor_ingress_consumer_lag_messages` counts the inputs the ingress
/// has read but cannot commit while the database holds it up, and falls
/// to zero once they are applied.
#[tokio::test]
async fn the_consumer_lag_counts_a_backlog_the_ingress_cannot_apply_and_drains() {
    let env = Serve::start(|c| c.kafka.statistics_interval_ms = 100).await;
    let requests = env.config.topic_names().requests();
    let on_requests = format!("topic=\"{requests}\"");
    let lag = || metric(env.admin, &[], ductor::ingress::CONSUMER_LAG, &on_requests);
    assert_eq!(lag().await, 0.0, "nothing sent, nothing behind");
    // The owner holds the runs table: every batch waits on its write.
    let mut hold = env.db.owner.begin().await.unwrap();
    sqlx::query("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let producer = producer();
    let starts = 12;
    for i in 0..starts {
        let run_id = format!("lag-{i}");
        let start = json!({
            "type": "run.start", "schema_version": 1, "run_id": run_id,
            "tenant": "acme", "workflow": "example", "input": {"n": i},
        });
        produce(
            &producer,
            &requests,
            &run_id,
            start.to_string().as_bytes(),
            &[],
        )
        .await;
    }
    eventually("the lag to count every start", WAIT, || async {
        (lag().await == f64::from(starts)).then_some(())
    })
    .await;
    // Read by the holder: anyone else would wait on its lock.
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM runs")
        .fetch_one(&mut *hold)
        .await
        .unwrap();
    assert_eq!(applied, 0, "nothing was applied meanwhile");
    hold.rollback().await.unwrap();
    eventually("the lag to drain", WAIT, || async {
        (lag().await == 0.0).then_some(())
    })
    .await;
    assert_eq!(env.db.count("runs").await, i64::from(starts));
    env.stop().await;
}

// ---------------------------------------------------------------------------
// The files against each other, without a stack.

/// Every alert names its severity and says what is wrong, what it costs
/// and where to look; and its unit tests make it fire.
#[test]
fn every_alert_has_a_severity_annotations_and_a_test_that_fires_it() {
    let rules = yaml(RULES);
    let tests = yaml(RULE_TESTS);
    let fired: BTreeSet<&str> = list(&tests["tests"])
        .iter()
        .flat_map(|test| list(&test["alert_rule_test"]))
        .filter(|case| !list(&case["exp_alerts"]).is_empty())
        .filter_map(|case| case["alertname"].as_str())
        .collect();
    let tested_files: Vec<&str> = list(&tests["rule_files"])
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    assert_eq!(tested_files, ["alerts.yml"], "the tests read the rules");
    let mut alerts = Vec::new();
    for rule in list(&rules["groups"])
        .iter()
        .flat_map(|group| list(&group["rules"]))
    {
        let Some(name) = rule["alert"].as_str() else {
            continue;
        };
        alerts.push(name);
        let severity = rule["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("warning" | "critical")),
            "{name}: severity {severity:?}"
        );
        for annotation in ["summary", "description", "runbook"] {
            let text = rule["annotations"][annotation].as_str().unwrap_or_default();
            assert!(text.len() > 20, "{name}: {annotation} {text:?}");
        }
        assert!(fired.contains(name), "no test of {name} makes it fire");
    }
    assert!(alerts.len() >= 12, "{alerts:?}");
    let unique: BTreeSet<&str> = alerts.iter().copied().collect();
    assert_eq!(unique.len(), alerts.len(), "an alert name is used twice");
}

/// The dashboard is Grafana's shape: panels with unique ids and places,
/// each query on the dashboard's data source variable, and the variables
/// its queries use.
#[test]
fn the_dashboard_s_panels_query_its_data_source_variable() {
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(workspace_dir().join(DASHBOARD)).unwrap())
            .expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "ductor");
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("templating variables")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(variables, ["datasource", "job", "instance"]);
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or_default();
        assert!(
            ids.insert(panel["id"].as_u64().expect("a panel id")),
            "{title}: id used twice"
        );
        assert!(
            panel["gridPos"]["w"].as_u64().is_some(),
            "{title}: no place"
        );
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        assert!(
            panel["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{title}: no description"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
            let expr = target["expr"].as_str().expect("a query");
            assert!(
                expr.contains("job=\"$job\""),
                "{title}: {expr} ignores $job"
            );
            queries += 1;
        }
    }
    assert!(queries >= 30, "{queries} queries");
}

/// What the alert rules assume of Prometheus' configuration (the job they
/// name, the rule file), and what the dashboard assumes of Grafana's (a
/// Prometheus data source, and a provider for the dashboards' folder).
#[test]
fn the_configurations_provide_what_the_rules_and_the_dashboard_assume() {
    let prometheus = yaml(PROMETHEUS);
    let rule_files: Vec<&str> = list(&prometheus["rule_files"])
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    assert_eq!(rule_files, ["alerts.yml"]);
    let jobs: Vec<&str> = list(&prometheus["scrape_configs"])
        .iter()
        .filter_map(|c| c["job_name"].as_str())
        .collect();
    assert_eq!(jobs, ["ductor"], "alerts.yml names up{{job=\"ductor\"}}");
    let scrape = &list(&prometheus["scrape_configs"])[0];
    assert_eq!(
        scrape["scheme"].as_str(),
        Some("https"),
        "admin keys go over TLS"
    );
    assert!(
        scrape["authorization"]["credentials_file"]
            .as_str()
            .is_some()
    );

    let datasources = yaml(DATASOURCES);
    let source = &list(&datasources["datasources"])[0];
    assert_eq!(source["type"].as_str(), Some("prometheus"));
    assert_eq!(source["isDefault"].as_bool(), Some(true));
    let providers = yaml(DASHBOARD_PROVIDERS);
    let provider = &list(&providers["providers"])[0];
    assert_eq!(provider["type"].as_str(), Some("file"));
    assert!(provider["options"]["path"].as_str().is_some());
}

// ---------------------------------------------------------------------------
// The queries of deploy/.

/// Every PromQL expression of `deploy/`, with where it comes from.
struct Queries {
    /// `(source, expression)`; the source is `dashboard`, `alert rule` or
    /// `rule test`.
    exprs: Vec<(&'static str, String)>,
    /// Names recording rules give their results: no target exports them.
    recorded: BTreeSet<String>,
}

impl Queries {
    fn read() -> Queries {
        let mut exprs = Vec::new();
        let dashboard: Value = serde_json::from_str(
            &std::fs::read_to_string(workspace_dir().join(DASHBOARD)).unwrap(),
        )
        .expect("the dashboard is JSON");
        dashboard_exprs(&dashboard["panels"], &mut exprs);
        for variable in dashboard["templating"]["list"].as_array().unwrap() {
            let query = match &variable["query"] {
                Value::Object(q) => q.get("query").and_then(Value::as_str),
                other => other.as_str(),
            };
            if variable["type"] == "query"
                && let Some(expr) = query.and_then(variable_expr)
            {
                exprs.push(("dashboard", expr));
            }
        }
        let rules = yaml(RULES);
        let mut recorded = BTreeSet::new();
        for rule in list(&rules["groups"])
            .iter()
            .flat_map(|group| list(&group["rules"]))
        {
            exprs.push(("alert rule", rule["expr"].as_str().unwrap().to_owned()));
            if let Some(name) = rule["record"].as_str() {
                recorded.insert(name.to_owned());
            }
        }
        let tests = yaml(RULE_TESTS);
        for test in list(&tests["tests"]) {
            for input in list(&test["input_series"]) {
                exprs.push(("rule test", input["series"].as_str().unwrap().to_owned()));
            }
            for case in list(&test["promql_expr_test"]) {
                exprs.push(("rule test", case["expr"].as_str().unwrap().to_owned()));
            }
        }
        Queries { exprs, recorded }
    }

    /// The metrics the expressions of `source` name.
    fn metrics(&self, source: &str) -> BTreeSet<String> {
        self.exprs
            .iter()
            .filter(|(s, _)| *s == source)
            .flat_map(|(_, expr)| selectors(expr).unwrap_or_else(|e| panic!("{expr}: {e}")))
            .map(|s| s.metric)
            .collect()
    }

    /// What the expressions name that `exposition` does not have: a
    /// metric, or a label value an equality (or a plain alternation)
    /// matcher asks for.
    fn missing_from(&self, exposition: &Exposition) -> Vec<String> {
        let mut missing = BTreeSet::new();
        for (source, expr) in &self.exprs {
            for selector in selectors(expr).unwrap_or_else(|e| panic!("{expr}: {e}")) {
                let metric = selector.metric.as_str();
                if PROMETHEUS_OWN.contains(&metric) || self.recorded.contains(metric) {
                    continue;
                }
                if !exposition.has(metric, None) {
                    missing.insert(format!("{metric} (read by: {source})"));
                    continue;
                }
                for (label, value) in selector.required_labels() {
                    if !exposition.has(metric, Some((&label, &value))) {
                        missing.insert(format!(
                            "{metric}{{{label}=\"{value}\"}} (read by: {source})"
                        ));
                    }
                }
            }
        }
        missing.into_iter().collect()
    }
}

/// The `expr` of every query under `node`, rows' panels included.
fn dashboard_exprs(node: &Value, out: &mut Vec<(&'static str, String)>) {
    match node {
        Value::Object(map) => {
            if let Some(Value::String(expr)) = map.get("expr") {
                out.push(("dashboard", expr.clone()));
            }
            map.values().for_each(|v| dashboard_exprs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| dashboard_exprs(v, out)),
        _ => {}
    }
}

/// The PromQL inside a Grafana query variable: the series selector of
/// `label_values(selector, label)` (the label is no metric), the query of
/// `query_result(...)`; `None` for the forms that name no series.
fn variable_expr(query: &str) -> Option<String> {
    let query = query.trim();
    if let Some(inner) = query
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
    {
        return inner
            .rsplit_once(',')
            .map(|(selector, _)| selector.to_owned());
    }
    query
        .strip_prefix("query_result(")
        .and_then(|q| q.strip_suffix(')'))
        .map(str::to_owned)
}

fn yaml(path: &str) -> Yaml {
    let text = std::fs::read_to_string(workspace_dir().join(path))
        .unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let mut docs = YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(docs.len(), 1, "{path} is one document");
    docs.remove(0)
}

/// The items of a YAML sequence; none where there is no sequence.
fn list(node: &Yaml) -> &[Yaml] {
    node.as_vec().map_or(&[], Vec::as_slice)
}

// ---------------------------------------------------------------------------
// Metric names in PromQL.

/// A series selector: a metric name and its label matchers.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Selector {
    metric: String,
    matchers: Vec<Matcher>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Matcher {
    label: String,
    op: String,
    value: String,
}

impl Selector {
    /// The `(label, value)` pairs each series of the selector must carry:
    /// those of `=` matchers, and each word of a `=~` matcher that is a
    /// plain alternation (`a|b`). Values with a dashboard variable, and
    /// [`DEPLOYMENT_LABELS`], are left out.
    fn required_labels(&self) -> Vec<(String, String)> {
        let plain = |v: &str| {
            !v.is_empty()
                && v.split('|').all(|w| {
                    !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                })
        };
        self.matchers
            .iter()
            .filter(|m| !DEPLOYMENT_LABELS.contains(&m.label.as_str()) && !m.value.contains('$'))
            .flat_map(|m| match m.op.as_str() {
                "=" => vec![(m.label.clone(), m.value.clone())],
                "=~" if plain(&m.value) => m
                    .value
                    .split('|')
                    .map(|w| (m.label.clone(), w.to_owned()))
                    .collect(),
                _ => Vec::new(),
            })
            .collect()
    }
}

/// Words that are PromQL's own: binary operators, modifiers, and the
/// number literals spelt as words. Case does not matter to PromQL.
const KEYWORDS: [&str; 8] = [
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
];

/// Keywords followed by a list of label names in parentheses.
const LABEL_LISTS: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The series selectors of a PromQL expression (Grafana's `$variables`
/// allowed): each identifier that is not a keyword, not a function or an
/// aggregation (followed by `(`), and not in a label list (`by (...)`),
/// with the matchers of the braces after it; `{__name__="x"}` names `x`.
/// Strings, durations and ranges (`[5m]`, `[$__rate_interval]`) are
/// skipped.
fn selectors(expr: &str) -> Result<Vec<Selector>, String> {
    let b = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' | b'\'' | b'`' => i = read_string(b, i)?.1,
            b'#' => {
                i = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |n| i + n)
            }
            b'[' => i = after(b, i, b']')?,
            b'{' => {
                let (matchers, next) = read_matchers(b, i)?;
                if let Some(name) = matchers
                    .iter()
                    .find(|m| m.label == "__name__" && m.op == "=")
                {
                    out.push(Selector {
                        metric: name.value.clone(),
                        matchers: matchers.clone(),
                    });
                }
                i = next;
            }
            b'$' => {
                i += 1;
                if b.get(i) == Some(&b'{') {
                    i = after(b, i, b'}')?;
                } else {
                    while i < b.len() && is_word(b[i]) {
                        i += 1;
                    }
                }
            }
            c if c.is_ascii_digit()
                || (c == b'.' && b.get(i + 1).is_some_and(u8::is_ascii_digit)) =>
            {
                i = after_number(b, i);
            }
            c if c.is_ascii_alphabetic() || c == b'_' || c == b':' => {
                let start = i;
                while i < b.len() && (is_word(b[i]) || b[i] == b':') {
                    i += 1;
                }
                let word = &expr[start..i];
                let lower = word.to_ascii_lowercase();
                let next = skip_space(b, i);
                let next_word = b[next..]
                    .iter()
                    .position(|&c| !is_word(c))
                    .map_or(&b[next..], |n| &b[next..next + n])
                    .to_ascii_lowercase();
                if LABEL_LISTS.contains(&lower.as_str()) {
                    if b.get(next) == Some(&b'(') {
                        i = after(b, next, b')')?;
                    }
                } else if KEYWORDS.contains(&lower.as_str())
                    || b.get(next) == Some(&b'(')
                    || next_word == b"by"
                    || next_word == b"without"
                {
                    // A keyword, or a function or an aggregation (whose
                    // label list may come before its parentheses).
                } else if b.get(next) == Some(&b'{') {
                    let (matchers, after_braces) = read_matchers(b, next)?;
                    out.push(Selector {
                        metric: word.to_owned(),
                        matchers,
                    });
                    i = after_braces;
                } else {
                    out.push(Selector {
                        metric: word.to_owned(),
                        matchers: Vec::new(),
                    });
                }
            }
            _ => i += 1,
        }
    }
    Ok(out)
}

fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn skip_space(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// Just past the first `close` from `open` on.
fn after(b: &[u8], open: usize, close: u8) -> Result<usize, String> {
    b[open..]
        .iter()
        .position(|&c| c == close)
        .map(|n| open + n + 1)
        .ok_or_else(|| format!("no '{}' after offset {open}", close as char))
}

/// Just past a number or a duration: `0.99`, `1e-3`, `0x1F`, `5m`, `1h30m`.
fn after_number(b: &[u8], mut i: usize) -> usize {
    let start = i;
    while i < b.len() {
        let c = b[i];
        let exponent_sign = (c == b'+' || c == b'-')
            && matches!(b[i - 1], b'e' | b'E')
            && b[start..i - 1]
                .iter()
                .all(|d| d.is_ascii_digit() || *d == b'.');
        if is_word(c) || c == b'.' || exponent_sign {
            i += 1;
        } else {
            break;
        }
    }
    i
}

/// The text of the string that opens at `open`, escapes resolved, and the
/// offset just past it. Raw strings (backticks) have no escapes.
fn read_string(b: &[u8], open: usize) -> Result<(String, usize), String> {
    let quote = b[open];
    let mut text = Vec::new();
    let mut i = open + 1;
    while i < b.len() {
        match b[i] {
            c if c == quote => {
                let text = String::from_utf8(text).map_err(|e| e.to_string())?;
                return Ok((text, i + 1));
            }
            b'\\' if quote != b'`' && i + 1 < b.len() => {
                text.push(b[i + 1]);
                i += 2;
            }
            c => {
                text.push(c);
                i += 1;
            }
        }
    }
    Err(format!("a string opened at offset {open} does not end"))
}

/// The matchers of the braces that open at `open`, and the offset just
/// past them.
fn read_matchers(b: &[u8], open: usize) -> Result<(Vec<Matcher>, usize), String> {
    let mut matchers = Vec::new();
    let mut i = open + 1;
    loop {
        while i < b.len() && (b[i].is_ascii_whitespace() || b[i] == b',') {
            i += 1;
        }
        match b.get(i) {
            None => return Err(format!("braces opened at offset {open} do not close")),
            Some(b'}') => return Ok((matchers, i + 1)),
            _ => {}
        }
        let (label, next) = if matches!(b[i], b'"' | b'\'') {
            read_string(b, i)?
        } else {
            let start = i;
            while i < b.len() && is_word(b[i]) {
                i += 1;
            }
            if start == i {
                return Err(format!("no label name at offset {i}"));
            }
            (String::from_utf8_lossy(&b[start..i]).into_owned(), i)
        };
        i = skip_space(b, next);
        let op = ["=~", "!=", "!~", "="]
            .into_iter()
            .find(|op| b[i..].starts_with(op.as_bytes()));
        let Some(op) = op else {
            // A quoted name alone: `{"metric.name"}`.
            matchers.push(Matcher {
                label: "__name__".into(),
                op: "=".into(),
                value: label,
            });
            continue;
        };
        i = skip_space(b, i + op.len());
        if !matches!(b.get(i), Some(b'"' | b'\'' | b'`')) {
            return Err(format!("no value for {label} at offset {i}"));
        }
        let (value, next) = read_string(b, i)?;
        matchers.push(Matcher {
            label,
            op: op.into(),
            value,
        });
        i = next;
    }
}

/// A Prometheus text exposition: each sample's metric name and labels.
struct Exposition {
    samples: Vec<(String, BTreeMap<String, String>)>,
}

impl Exposition {
    fn parse(text: &str) -> Exposition {
        let samples = ductor_testkit::metrics::samples(text)
            .map(|(series, _)| {
                let Some(open) = series.find('{') else {
                    return (series.to_owned(), BTreeMap::new());
                };
                let labels = read_matchers(series.as_bytes(), open)
                    .unwrap_or_else(|e| panic!("{series}: {e}"))
                    .0
                    .into_iter()
                    .map(|m| (m.label, m.value))
                    .collect();
                (series[..open].to_owned(), labels)
            })
            .collect();
        Exposition { samples }
    }

    /// Whether a sample of `metric` exists, carrying `label` if given.
    fn has(&self, metric: &str, label: Option<(&str, &str)>) -> bool {
        self.samples.iter().any(|(name, labels)| {
            name == metric && label.is_none_or(|(l, v)| labels.get(l).is_some_and(|have| have == v))
        })
    }
}

#[test]
fn the_reader_finds_the_metrics_where_promql_puts_them() {
    let names = |expr: &str| -> Vec<String> {
        selectors(expr)
            .unwrap()
            .into_iter()
            .map(|s| s.metric)
            .collect()
    };
    assert_eq!(
        names(
            r#"histogram_quantile(0.99, sum by (le, phase) (rate(ductor_apply_phase_seconds_bucket{job="$job", instance=~"$instance"}[$__rate_interval])))"#
        ),
        ["ductor_apply_phase_seconds_bucket"]
    );
    assert_eq!(
        names(
            "(sum without (instance) (deriv(lag_messages[15m])) > 0)\n  and (sum without (instance) (lag_messages) > 1e+3)"
        ),
        ["lag_messages", "lag_messages"]
    );
    assert_eq!(
        names("a_total / on(run) group_left(tenant) b_info offset 5m or vector(0) * bool c"),
        ["a_total", "b_info", "c"]
    );
    assert_eq!(
        names(r#"{__name__="by_name", x="not_a_metric"} + count(x{y='by'}) # up"#),
        ["by_name", "x"]
    );
    assert_eq!(names("sum(rate(x_total[5m:1m] @ start()))"), ["x_total"]);
    assert_eq!(names("max(up) > Inf AND NaN"), ["up"]);
    assert!(selectors(r#"x{a="unterminated}"#).is_err());

    let selector = &selectors(r#"refused_total{reason=~"rate_limited|auth_failures", stage="apply", job="ductor", class=~".+"}"#).unwrap()[0];
    assert_eq!(
        selector.required_labels(),
        [
            ("reason".to_owned(), "rate_limited".to_owned()),
            ("reason".to_owned(), "auth_failures".to_owned()),
            ("stage".to_owned(), "apply".to_owned()),
        ]
    );
    assert_eq!(
        variable_expr(r#"label_values(ductor_ready{job="$job"}, instance)"#).as_deref(),
        Some(r#"ductor_ready{job="$job"}"#)
    );
    assert_eq!(variable_expr("label_values(job)"), None);
}

#[test]
fn the_exposition_is_read_by_name_and_label() {
    let text = "# TYPE a_seconds histogram\n\
        a_seconds_bucket{le=\"+Inf\"} 3\n\
        a_seconds_sum 1.5\n\
        refused_total{reason=\"rate_limited\",path=\"a \\\"b\\\"\"} 0\n";
    let exposition = Exposition::parse(text);
    assert!(exposition.has("a_seconds_bucket", Some(("le", "+Inf"))));
    assert!(exposition.has("a_seconds_sum", None));
    assert!(
        !exposition.has("a_seconds", None),
        "a histogram's name alone is no series"
    );
    assert!(exposition.has("refused_total", Some(("path", "a \"b\""))));
    assert!(!exposition.has("refused_total", Some(("reason", "overloaded"))));
}
