//! One writer per run, by construction: three `serve` processes share the
//! coordinator group, the input topics are co-partitioned, and each run's
//! start, signal and results (three topics) reach one process. In steady
//! state no batch loses an optimistic-lock race; through a rolling restart
//! of every serve, a run changes writers only when its partitions move, and
//! never back and forth between two at once.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use ductor::config::Config;
use ductor_testkit::serve_process::ServeProcess;
use rdkafka::producer::FutureProducer;
use serde_json::json;
use tokio::process::Child;

const DONE: Duration = Duration::from_secs(180);
const RUNS_PER_WAVE: usize = 24;

fn spawn_worker(config: &Config) -> Child {
    example_worker(config)
        .args(["--fail-rate", "0", "--work-ms", "0"])
        .spawn()
        .expect("starting the example worker")
}

/// Starts a wave of runs, and signals each once it exists: the start, the
/// signal and the results of one run travel on three topics.
async fn wave(db: &TestDb, p: &FutureProducer, config: &Config, name: &str) -> Vec<String> {
    let ids: Vec<String> = (0..RUNS_PER_WAVE)
        .map(|i| format!("{name}-{i:02}-{}", unique("r")))
        .collect();
    let names = config.topic_names();
    for id in &ids {
        let start = json!({"type": "run.start", "schema_version": 1, "run_id": id,
            "tenant": "acme", "workflow": "example", "input": {"id": id}});
        let topic = names.requests();
        produce(p, &topic, id, start.to_string().as_bytes(), &[]).await;
    }
    for id in &ids {
        eventually("the run exists", DONE, || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM runs WHERE run_id = $1")
                .bind(id)
                .fetch_one(&db.pool)
                .await
                .unwrap();
            (n == 1).then_some(())
        })
        .await;
        let signal = json!({"type": "wakeup.signal", "schema_version": 1, "run_id": id,
            "tenant": "acme", "signal_id": "s", "name": "poke"});
        let topic = names.wakeups();
        produce(p, &topic, id, signal.to_string().as_bytes(), &[]).await;
    }
    ids
}

async fn all_succeeded(db: &TestDb, ids: &[String]) {
    eventually("every run succeeded", DONE, || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM runs WHERE run_id = ANY($1) AND status = 'succeeded'",
        )
        .bind(ids)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (n == ids.len() as i64).then_some(())
    })
    .await;
}

async fn conflicts(admins: &[SocketAddr]) -> f64 {
    let mut total = 0.0;
    for admin in admins {
        let (status, body) = http(*admin, "GET", "/metrics", &[], b"").await;
        assert_eq!(status, 200);
        total += String::from_utf8(body)
            .unwrap()
            .lines()
            .find(|l| l.starts_with("ductor_apply_conflicts_total"))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0.0, |v| v.parse().unwrap());
    }
    total
}

/// Waits until the coordinator group is stable with `members` members.
async fn group_stable(config: &Config, members: usize) {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers())
        .create()
        .expect("a metadata client");
    let consumer = std::sync::Arc::new(consumer);
    let group = config.kafka.group_id.clone();
    eventually("the group is stable", DONE, || {
        let (consumer, group) = (consumer.clone(), group.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                let list = consumer
                    .fetch_group_list(Some(&group), Duration::from_secs(5))
                    .ok()?;
                let g = list.groups().first()?;
                (g.state() == "Stable" && g.members().len() == members).then_some(())
            })
            .await
            .unwrap()
        }
    })
    .await;
}

/// The writers of each run's transitions applied from Kafka, in seq order.
async fn writers(db: &TestDb, ids: &[String]) -> HashMap<String, Vec<String>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT run_id, writer FROM run_transitions \
         WHERE run_id = ANY($1) AND source_topic IS NOT NULL ORDER BY run_id, seq",
    )
    .bind(ids)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut by_run: HashMap<String, Vec<String>> = HashMap::new();
    for (run, writer) in rows {
        by_run.entry(run).or_default().push(writer);
    }
    by_run
}

/// Writers that come back after another wrote the run: two at once.
fn interleaved(writers: &[String]) -> bool {
    let mut seen: Vec<&str> = Vec::new();
    for w in writers {
        if seen.last() != Some(&w.as_str()) {
            if seen.contains(&w.as_str()) {
                return true;
            }
            seen.push(w);
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::too_many_lines)]
async fn three_serves_write_each_run_from_one_process() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    config.kafka.partitions = 6;
    config.kafka.session_timeout_ms = 6_000;
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let bin = ductor_bin();
    let mut serves = Vec::new();
    for _ in 0..3 {
        serves.push(ServeProcess::start(&bin, &config).await.expect("a serve"));
    }
    let mut worker = spawn_worker(&config);
    let p = producer();

    // Steady state: three members, the group stable, a first wave done.
    let warm = wave(&db, &p, &config, "warm").await;
    all_succeeded(&db, &warm).await;
    group_stable(&config, 3).await;
    let admins: Vec<SocketAddr> = serves.iter().map(|s| s.admin_addr).collect();
    let before = conflicts(&admins).await;
    let steady = wave(&db, &p, &config, "steady").await;
    all_succeeded(&db, &steady).await;
    let lost = conflicts(&admins).await - before;
    assert_eq!(
        lost, 0.0,
        "batches lost an optimistic-lock race in steady state"
    );
    let steady_writers = writers(&db, &steady).await;
    for (run, w) in &steady_writers {
        let mut distinct = w.clone();
        distinct.dedup();
        assert_eq!(distinct.len(), 1, "{run} was written by {w:?}");
    }
    let processes: std::collections::HashSet<&str> = steady_writers
        .values()
        .flatten()
        .map(|w| w.split('/').next().unwrap())
        .collect();
    assert_eq!(processes.len(), 3, "every serve wrote runs: {processes:?}");

    // A rolling restart: each serve in turn stops and a new one joins,
    // while runs go on.
    let mut rolled = Vec::new();
    for i in 0..3 {
        let ids = wave(&db, &p, &config, &format!("roll{i}")).await;
        let old = serves.remove(0);
        old.stop().await;
        serves.push(ServeProcess::start(&bin, &config).await.expect("a serve"));
        rolled.extend(ids);
    }
    all_succeeded(&db, &rolled).await;
    for (run, w) in writers(&db, &rolled).await {
        assert!(!interleaved(&w), "{run} was written by two at once: {w:?}");
    }

    let _ = worker.kill().await;
    for s in serves {
        s.stop().await;
    }
    db.drop_db().await;
}

/// Input topics of different partition counts cannot be co-partitioned:
/// `topics create` and `serve` refuse them, naming the counts.
#[tokio::test]
async fn input_topics_of_different_partition_counts_are_refused() {
    let db = TestDb::migrated().await;
    let config = test_config(&db);
    let names = config.topic_names();
    let (wakeups, others) = (
        vec![names.wakeups()],
        vec![names.requests(), names.attempt_results()],
    );
    ductor::infra::kafka::ensure_topics(&config.kafka, &wakeups, 2)
        .await
        .unwrap();
    ductor::infra::kafka::ensure_topics(&config.kafka, &others, 3)
        .await
        .unwrap();
    let err = ductor::cli::commands::create_topics(&config)
        .await
        .expect_err("topics create refuses them")
        .to_string();
    assert!(err.contains(&format!("{} has 2", wakeups[0])), "{err}");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let err = ductor::cli::serve::run(config.clone(), shutdown)
        .await
        .expect_err("serve refuses them")
        .to_string();
    assert!(err.contains("one partition count"), "{err}");
    db.drop_db().await;
}
