//! The operator's views over a seeded table: every search is read from an
//! index and never by a scan of `runs`, the counts a filter of tenant and
//! workflow asks for are read from the kept counts alone, paging by cursor
//! visits each run once, newest first, and the counts agree with the runs.
//! `ductor-views` times the same statements over a million runs; this
//! test, over fewer, proves what keeps them fast.

#[path = "../../tests/common/mod.rs"]
mod common;

use ductor::api::operator::query::RunQuery;
use ductor::api::operator::store::{self, Statement};
use ductor::config::Config;
use ductor_bench::views::{SCAN_LIMIT, Seeded, TENANTS, plan_nodes, searches};

const RUNS: u64 = 20_000;

fn config() -> Config {
    Config::load_from(
        None,
        vec![
            ("DATABASE_URL".to_string(), common::database_url()),
            ("DATABASE_MIGRATE_URL".to_string(), common::migrate_url()),
            (
                "KAFKA_BOOTSTRAP_SERVERS".to_string(),
                common::bootstrap_servers(),
            ),
        ],
    )
    .expect("default configuration is valid")
}

fn query(text: &str) -> RunQuery {
    RunQuery::parse(Some(text), 500).expect("a valid query")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn searches_read_indexes_counts_read_the_kept_counts_and_pages_cover_each_run_once() {
    let seeded = Seeded::create(&config(), RUNS).await.expect("seeding");
    let pool = &seeded.pool;

    for (name, which, text) in searches(RUNS) {
        let q = query(&text);
        let plan = plan_nodes(&store::explain(pool, which, &q, SCAN_LIMIT).await.unwrap());
        assert!(!plan.is_empty(), "{name}: no plan");
        assert!(
            !plan.iter().any(|node| node == "Seq Scan runs"),
            "{name} ({text}) reads the whole table: {plan:?}"
        );
        if which == Statement::Counts && q.filter.counted_exactly() {
            assert!(
                plan.iter()
                    .all(|node| !node.ends_with(" runs") && !node.contains("runs_")),
                "{name} ({text}) reads runs instead of the kept counts: {plan:?}"
            );
        }
    }

    // Every run of a tenant, page by page: each once, newest first.
    let tenant = "tenant-03";
    let mut seen: Vec<(chrono::DateTime<chrono::Utc>, String)> = Vec::new();
    let mut text = format!("tenant={tenant}&limit=97");
    loop {
        let page = store::page(pool, &query(&text)).await.unwrap();
        assert!(page.runs.len() <= 97);
        assert!(page.runs.iter().all(|r| r.tenant == tenant));
        seen.extend(page.runs.iter().map(|r| (r.created_at, r.run_id.clone())));
        match page.next {
            Some(next) => text = format!("tenant={tenant}&limit=97&after={next}"),
            None => break,
        }
    }
    let expected = usize::try_from(RUNS / TENANTS).unwrap();
    assert_eq!(seen.len(), expected);
    assert!(
        seen.windows(2).all(|w| w[0] > w[1]),
        "pages run newest first, without a repeat"
    );

    // The counts, kept or scanned, are the runs'.
    let counted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM runs WHERE tenant_scope = $1 AND status = 'failed'",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(counted > 0, "the seed has failed runs in every tenant");
    let kept = store::counts(pool, &query(&format!("tenant={tenant}")), SCAN_LIMIT)
        .await
        .unwrap();
    assert_eq!((kept.failed, kept.exact), (counted, true));
    assert_eq!(kept.total, i64::try_from(expected).unwrap());
    let scanned = store::counts(
        pool,
        &query(&format!(
            "tenant={tenant}&created_after=2000-01-01T00:00:00Z"
        )),
        SCAN_LIMIT,
    )
    .await
    .unwrap();
    assert_eq!(
        (scanned.failed, scanned.total, scanned.exact),
        (kept.failed, kept.total, true)
    );
    let capped = store::counts(pool, &query("created_after=2000-01-01T00:00:00Z"), 1_000)
        .await
        .unwrap();
    assert_eq!((capped.total, capped.exact), (1_000, false));
    seeded.drop().await.unwrap();
}
