//! `ductor-views`: the operator's views over many runs. Seeds a database of
//! its own with N runs (a million by default) spread over tenants,
//! workflows, versions, statuses, steps and correlation ids, then times
//! the statements `GET /v1/runs` and `GET /v1/runs/counts` run — the same
//! functions the API calls — and shows each one's plan, which says why the
//! time does not grow with the table: a keyset scan of an index, or the
//! kept counts.
//!
//! In: the configuration's database (`database.migrate_url` creates and
//! seeds the scratch database) and the number of runs. Out: one row per
//! statement (median and worst of its repetitions, the plan's first nodes)
//! and a JSON line of them. Guarantees: the scratch database is dropped at
//! the end, also after an error; timings are printed, never judged.

use std::time::Instant;

use anyhow::Context;
use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use ductor::api::operator::query::RunQuery;
use ductor::api::operator::store::{self, Statement};
use ductor::config::Config;
use ductor_testkit::scratch::ScratchDatabase;

/// Tenants, workflows and versions the seeded runs spread over.
pub const TENANTS: u64 = 20;
pub const WORKFLOWS: u64 = 10;
pub const VERSIONS: u64 = 3;
/// Runs one seeding statement inserts.
const SEED_CHUNK: u64 = 100_000;
/// `server.count_scan_limit`'s default.
pub const SCAN_LIMIT: i64 = 10_000;

#[derive(Debug, Clone, clap::Args)]
pub struct ViewsArgs {
    /// Runs to seed.
    #[arg(long, default_value_t = 1_000_000)]
    pub runs: u64,
    /// Times each statement runs; the median and the worst are reported.
    #[arg(long, default_value_t = 7)]
    pub repeat: usize,
}

/// One statement's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Timed {
    pub name: String,
    pub query: String,
    pub median_ms: f64,
    pub worst_ms: f64,
    /// Rows answered (runs in the page, or the total counted).
    pub rows: i64,
    /// The plan's node types, outermost first, with the relation or index
    /// each reads.
    pub plan: Vec<String>,
}

/// A seeded scratch database.
pub struct Seeded {
    pub pool: PgPool,
    scratch: ScratchDatabase,
}

impl Seeded {
    /// Creates and migrates a scratch database and seeds it with `runs`
    /// runs; the kept counts are filled as the migration fills them.
    pub async fn create(config: &Config, runs: u64) -> anyhow::Result<Seeded> {
        let admin_url = config.database.migrate_url().expose().to_string();
        let scratch = ScratchDatabase::create(&admin_url, "ductor_views_").await?;
        let mut database = config.database.clone();
        database.url =
            ductor::config::DatabaseUrl::new(scratch.url_for(config.database.url.expose())?);
        database.migrate_url = Some(ductor::config::DatabaseUrl::new(
            scratch.url_for(&admin_url)?,
        ));
        let seeded = async {
            ductor::infra::db::migrate_database(&database).await?;
            // Seeding takes seconds a statement: not worth a warning each.
            let quiet: sqlx::postgres::PgConnectOptions =
                database
                    .migrate_url()
                    .expose()
                    .parse()
                    .context("reading database.migrate_url")?;
            let quiet = sqlx::ConnectOptions::log_slow_statements(
                quiet,
                tracing::log::LevelFilter::Off,
                std::time::Duration::ZERO,
            );
            let owner = PgPoolOptions::new()
                .max_connections(2)
                .connect_with(quiet)
                .await
                .context("connecting as the migrator")?;
            seed(&owner, runs).await?;
            owner.close().await;
            PgPoolOptions::new()
                .max_connections(2)
                .connect(database.url.expose())
                .await
                .context("connecting as the application role")
        };
        match seeded.await {
            Ok(pool) => Ok(Seeded { pool, scratch }),
            Err(e) => {
                let _ = scratch.drop().await;
                Err(e)
            }
        }
    }

    pub async fn drop(self) -> anyhow::Result<()> {
        self.pool.close().await;
        self.scratch.drop().await
    }
}

/// Inserts `runs` runs: run `i` is of tenant `i % 20`, workflow `i / 3 %
/// 10`, version `1 + i / 7 % 3`, at step `i / 11 % 4`, with correlation id
/// `corr-i`, created `i` milliseconds before the first; one in ten running,
/// seven in ten succeeded, two failed, one cancelled, in every tenant.
async fn seed(owner: &PgPool, runs: u64) -> anyhow::Result<()> {
    let mut from = 0;
    while from < runs {
        let to = (from + SEED_CHUNK).min(runs);
        sqlx::query(
            "INSERT INTO runs (run_id, tenant_scope, pool_id, workflow_name, workflow_version, \
                 status, record_version, last_transition_seq, state, created_at, updated_at, \
                 finished_at) \
             SELECT 'seed-' || i, 'tenant-' || lpad((i % $3)::text, 2, '0'), 'default', \
                 'wf-' || (i / 3 % $4), 1 + i / 7 % $5, s.status, 1, 4, \
                 jsonb_build_object('step_index', i / 11 % 4, 'attempt', 1, \
                     'correlation_id', 'corr-' || i, 'status', s.status, \
                     'input', jsonb_build_object('order', 'order-' || i, 'amount', i % 1000, \
                         'note', repeat('x', 200))), \
                 t.at, t.at, CASE WHEN s.status = 'running' THEN NULL ELSE t.at END \
             FROM generate_series($1::int8, $2::int8 - 1) AS i, \
                 LATERAL (SELECT (ARRAY['running', 'succeeded', 'succeeded', 'succeeded', \
                     'succeeded', 'succeeded', 'succeeded', 'failed', 'failed', 'cancelled'] \
                     )[1 + i / 20 * 7 % 10] AS status) s, \
                 LATERAL (SELECT timestamptz '2026-12-01 00:00:00+00' \
                     - make_interval(secs => i / 1000.0) AS at) t",
        )
        .bind(i64::try_from(from)?)
        .bind(i64::try_from(to)?)
        .bind(i64::try_from(TENANTS)?)
        .bind(i64::try_from(WORKFLOWS)?)
        .bind(i64::try_from(VERSIONS)?)
        .execute(owner)
        .await
        .context("seeding runs")?;
        eprintln!("[views] seeded {to} of {runs} runs");
        from = to;
    }
    sqlx::raw_sql(
        "INSERT INTO run_counts (tenant_scope, workflow_name, workflow_version, status, n) \
         SELECT tenant_scope, workflow_name, workflow_version, status, count(*) FROM runs \
         GROUP BY 1, 2, 3, 4 \
         ON CONFLICT (tenant_scope, workflow_name, workflow_version, status) \
             DO UPDATE SET n = EXCLUDED.n",
    )
    .execute(owner)
    .await
    .context("counting the seeded runs")?;
    for analyse in ["VACUUM ANALYZE runs", "ANALYZE run_counts"] {
        sqlx::raw_sql(analyse)
            .execute(owner)
            .await
            .context("analysing the seeded runs")?;
    }
    Ok(())
}

/// The searches measured: a name, and the query string an operator sends.
pub fn searches(runs: u64) -> Vec<(&'static str, Statement, String)> {
    let correlation = format!("correlation_id=corr-{}", runs / 2 + 7);
    vec![
        ("newest page, every tenant", Statement::Page, String::new()),
        ("newest page, one tenant", Statement::Page, "tenant=tenant-07".into()),
        ("failed runs of a tenant", Statement::Page, "tenant=tenant-07&status=failed".into()),
        ("one correlation id", Statement::Page, correlation),
        (
            "a workflow version, cancelled",
            Statement::Page,
            "workflow=wf-3&version=2&status=cancelled".into(),
        ),
        ("runs at step 2 of a tenant", Statement::Page, "tenant=tenant-07&step=2".into()),
        (
            "a tenant's hour",
            Statement::Page,
            "tenant=tenant-07&created_after=2026-11-30T23:00:00Z&created_before=2026-12-01T00:00:00Z"
                .into(),
        ),
        ("counts, every tenant", Statement::Counts, String::new()),
        ("counts, one tenant's workflow", Statement::Counts, "tenant=tenant-07&workflow=wf-2".into()),
        (
            "counts, a tenant's hour (scanned)",
            Statement::Counts,
            "tenant=tenant-07&created_after=2026-11-30T23:00:00Z".into(),
        ),
    ]
}

/// Times each search, and the page reached by following `next` twenty
/// times from the newest.
pub async fn measure(pool: &PgPool, runs: u64, repeat: usize) -> anyhow::Result<Vec<Timed>> {
    let mut timed = Vec::new();
    for (name, which, query) in searches(runs) {
        let parsed = RunQuery::parse(Some(&query), 500).map_err(anyhow::Error::msg)?;
        timed.push(time(pool, name, which, &query, &parsed, repeat).await?);
    }
    let mut deep = RunQuery::parse(Some("tenant=tenant-07"), 500).map_err(anyhow::Error::msg)?;
    for _ in 0..20 {
        let page = store::page(pool, &deep).await?;
        let next = page
            .next
            .context("fewer than 21 pages of a tenant's runs")?;
        deep = RunQuery::parse(Some(&format!("tenant=tenant-07&after={next}")), 500)
            .map_err(anyhow::Error::msg)?;
    }
    let deep_text = "tenant=tenant-07&after=<the 20th next>".to_owned();
    timed.push(
        time(
            pool,
            "21st page of a tenant",
            Statement::Page,
            &deep_text,
            &deep,
            repeat,
        )
        .await?,
    );
    Ok(timed)
}

async fn time(
    pool: &PgPool,
    name: &str,
    which: Statement,
    text: &str,
    query: &RunQuery,
    repeat: usize,
) -> anyhow::Result<Timed> {
    let mut ms = Vec::new();
    let mut rows = 0;
    for _ in 0..repeat.max(1) {
        let started = Instant::now();
        rows = match which {
            Statement::Page => i64::try_from(store::page(pool, query).await?.runs.len())?,
            Statement::Counts => store::counts(pool, query, SCAN_LIMIT).await?.total,
        };
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(f64::total_cmp);
    let plan = store::explain(pool, which, query, SCAN_LIMIT).await?;
    Ok(Timed {
        name: name.to_owned(),
        query: text.to_owned(),
        median_ms: ms[ms.len() / 2],
        worst_ms: ms[ms.len() - 1],
        rows,
        plan: plan_nodes(&plan),
    })
}

/// The plan's nodes, outermost first: `Index Scan Backward runs_created_idx`,
/// `Seq Scan runs`, ...
pub fn plan_nodes(explained: &Value) -> Vec<String> {
    let mut nodes = Vec::new();
    let mut stack = vec![&explained[0]["Plan"]];
    while let Some(node) = stack.pop() {
        let Some(kind) = node["Node Type"].as_str() else {
            continue;
        };
        let direction = node["Scan Direction"]
            .as_str()
            .filter(|d| *d == "Backward")
            .map(|d| format!(" {d}"))
            .unwrap_or_default();
        let on = node["Index Name"]
            .as_str()
            .or(node["Relation Name"].as_str())
            .map(|r| format!(" {r}"))
            .unwrap_or_default();
        nodes.push(format!("{kind}{direction}{on}"));
        if let Some(children) = node["Plans"].as_array() {
            stack.extend(children.iter().rev());
        }
    }
    nodes
}

/// `ductor-views`: seed, measure, print, drop.
pub async fn main(args: ViewsArgs, config: Config) -> anyhow::Result<()> {
    let started = Instant::now();
    let seeded = Seeded::create(&config, args.runs).await?;
    eprintln!(
        "[views] {} runs seeded in {:.0} s",
        args.runs,
        started.elapsed().as_secs_f64()
    );
    let measured = measure(&seeded.pool, args.runs, args.repeat).await;
    seeded.drop().await?;
    let timed = measured?;
    println!(
        "{:<36} {:>10} {:>10} {:>6}  plan",
        "statement", "median ms", "worst ms", "rows"
    );
    for t in &timed {
        println!(
            "{:<36} {:>10.2} {:>10.2} {:>6}  {}",
            t.name,
            t.median_ms,
            t.worst_ms,
            t.rows,
            t.plan.join(" > ")
        );
    }
    println!(
        "{}",
        serde_json::json!({ "runs": args.runs, "statements": timed })
    );
    Ok(())
}
