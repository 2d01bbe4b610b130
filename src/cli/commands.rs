//! The operator's one-shot commands of the `ductor` binary: each takes the
//! configuration, does one thing against Postgres or Kafka, and returns what
//! the binary prints. The binary only parses its arguments and calls these.
//!
//! In: the [`Config`] and a command's arguments. Out: what the binary
//! prints (lines, or JSON), or an error with its context. Guarantees:
//! `submit` validates, bounds and routes a start as the HTTP API does
//! (without a key: the operator names the tenant); `topics create` fails
//! when the input topics' partition counts differ (unless
//! `kafka.require_copartitioned = false`) or a topic takes smaller records
//! than `kafka.message_max_bytes`; `submit` and `outbox redrive` write
//! only on a schema whose migrations are exactly this binary's, and
//! `migrate` leaves a newer binary's schema alone.

use anyhow::Context;

use crate::config::Config;

/// `ductor migrate`: applies pending database migrations as the migrator
/// (`database.migrate_url`) and grants the application role and the keys
/// role their rights.
pub async fn migrate(config: &Config) -> anyhow::Result<()> {
    crate::infra::db::migrate_database(&config.database).await
}

/// `ductor topics create`: creates every configured topic (existing ones are
/// left alone) and returns a line per topic. Fails, after creating, when a
/// topic's `max.message.bytes` is below what Ductor's envelopes need.
pub async fn create_topics(config: &Config) -> anyhow::Result<Vec<String>> {
    let outcomes = crate::infra::kafka::create_configured_topics(config).await?;
    let lines = outcomes
        .into_iter()
        .map(|o| {
            let verb = if o.created { "created" } else { "exists " };
            format!("{verb} {}", o.topic)
        })
        .collect();
    let (kafka, inputs) = (config.kafka.clone(), config.topic_names().inputs());
    let counts =
        tokio::task::spawn_blocking(move || crate::infra::kafka::partition_counts(&kafka, &inputs))
            .await??;
    if let Some(why) = crate::infra::kafka::copartition_error(&counts)
        && config.kafka.require_copartitioned
    {
        anyhow::bail!(why);
    }
    let small =
        crate::infra::kafka::topics_below_limit(&config.kafka, &config.all_topics()).await?;
    if !small.is_empty() {
        return Err(crate::infra::kafka::limits_error(&config.kafka, &small));
    }
    Ok(lines)
}

/// `ductor outbox redrive`: puts parked intents (of one run, or bound for one
/// topic, or all) back into the claim rounds; returns how many.
pub async fn redrive(
    config: &Config,
    run: Option<&str>,
    topic: Option<&str>,
) -> anyhow::Result<u64> {
    let pool = crate::infra::db::connect(&config.database).await?;
    crate::infra::db::check_migrated(&pool).await?;
    crate::outbox::Drainer::redrive_parked(&pool, run, topic).await
}

/// `ductor inspect run`: a run's state, attempts and history, as JSON.
pub async fn inspect_run(config: &Config, run_id: &str) -> anyhow::Result<serde_json::Value> {
    let pool = crate::infra::db::connect(&config.database).await?;
    let run = super::inspect::run(&pool, run_id)
        .await?
        .with_context(|| format!("no run with id {run_id:?}"))?;
    Ok(serde_json::to_value(run)?)
}

/// What `ductor submit` starts: the fields of a start request, the input
/// still as the JSON text the operator typed.
pub struct SubmitArgs {
    pub workflow: String,
    pub input: String,
    pub tenant: String,
    pub pool: String,
    pub workflow_version: Option<u32>,
    /// Requests with the same key (per tenant and pool) get the same run;
    /// without one (or an empty one), every submit is a new run.
    pub idempotency_key: Option<String>,
}

/// `ductor submit`: starts a run through the routing plane, with the limits
/// and validation the HTTP API applies, and returns its decision with an
/// `outcome` of `created` or `duplicate`.
pub async fn submit(args: SubmitArgs, config: &Config) -> anyhow::Result<serde_json::Value> {
    let limits = config.input_limits();
    let input: serde_json::Value = crate::contract::parse_value(args.input.as_bytes(), &limits)
        .map_err(|e| anyhow::anyhow!("--input: {e}"))?;
    let mut body = serde_json::json!({
        "workflow": args.workflow,
        "tenant": args.tenant,
        "pool": args.pool,
        "input": input,
    });
    if let Some(version) = args.workflow_version {
        body["workflow_version"] = version.into();
    }
    let key = args.idempotency_key.filter(|k| !k.is_empty());
    let request = crate::api::start::route_request_from_body(body, key)
        .map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
    crate::contract::bound_start(&request.start, args.input.len(), &limits)
        .map_err(|e| anyhow::anyhow!("--input: {}: {}", e.class.as_str(), e.message))?;
    let workflows = crate::infra::workflows::load_dir(&config.coordinator.workflows_dir)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let pool = crate::infra::db::connect(&config.database).await?;
    crate::infra::db::check_migrated(&pool).await?;
    let mut applier = crate::apply::Applier::new(config, pool, workflows);
    applier.writer = std::sync::Arc::new(crate::apply::Writer::new("submit"));
    // No drainer runs in this process: the drainers of the `serve`
    // processes learn of the run's first effects by the commit's NOTIFY,
    // not by their poll.
    applier.notify_commits = true;
    let submitted = crate::api::start::submit(&applier, &config.routing, request)
        .await
        .map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
    let status = match submitted {
        crate::api::start::Submitted::Created(_) => "created",
        crate::api::start::Submitted::Duplicate(_) => "duplicate",
    };
    let mut out = serde_json::to_value(submitted.decision())?;
    out["outcome"] = status.into();
    Ok(out)
}

/// `ductor schemas --out DIR`: writes the contract's JSON Schemas under
/// `DIR` (`messages/<type>.json`, `headers/<name>.json`) and the HTTP API's
/// OpenAPI document (`openapi.json`), and returns a line per file, `wrote`
/// or `same` (an unchanged file is not rewritten).
pub fn write_schemas(dir: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let mut lines = Vec::new();
    let contract = crate::contract::schema::catalogue()
        .into_iter()
        .map(|file| (file.path.clone(), file.text()));
    let openapi = (
        crate::api::openapi::FILE.to_owned(),
        crate::api::openapi::text(),
    );
    for (file, text) in contract.chain([openapi]) {
        let path = dir.join(&file);
        if std::fs::read_to_string(&path).is_ok_and(|old| old == text) {
            lines.push(format!("same  {}", path.display()));
            continue;
        }
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        lines.push(format!("wrote {}", path.display()));
    }
    Ok(lines)
}

/// What `ductor workflows check` found: a line per file, and how many
/// were refused.
pub struct Checked {
    pub lines: Vec<String>,
    pub refused: usize,
}

/// `ductor workflows check FILE...`: each file as `serve` would load it;
/// `ok <file>: workflow "order" version 1, 5 steps`, or the refusal
/// naming the file, the workflow, the step, the field and the rule.
pub fn check_workflows(files: &[std::path::PathBuf]) -> Checked {
    let mut refused = 0;
    let lines = crate::infra::workflows::check_files(files)
        .into_iter()
        .zip(files)
        .map(|(outcome, file)| match outcome {
            Ok(def) => format!(
                "ok {}: workflow {:?} version {}, {} steps",
                file.display(),
                def.name,
                def.version,
                def.steps.len()
            ),
            Err(e) => {
                refused += 1;
                format!("refused {e}")
            }
        })
        .collect();
    Checked { lines, refused }
}
