//! One partitioning rule for every producer: a run's inputs belong on
//! partition `murmur2(run_id) % n`, the Java client's rule. Inputs a
//! producer with librdkafka's default hash (CRC32) put elsewhere are
//! forwarded once to their run's partition; Ductor's own producers follow
//! the rule. Against the real broker and Postgres.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use ductor::contract::headers::{FORWARDED_FROM, FORWARDS};
use ductor::contract::partition::partition_for;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::producer::FutureProducer;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);
const RUNS: usize = 40;

fn start_json(run_id: &str) -> Vec<u8> {
    json!({
        "type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": "acme", "workflow": "example", "input": {"order": run_id},
    })
    .to_string()
    .into_bytes()
}

/// A producer with librdkafka's default partitioner, CRC32 of the key: what
/// a client that does not follow the rule does.
fn crc32_producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers())
        .set("enable.idempotence", "true")
        .set("partitioner", "consistent_random")
        .set("linger.ms", "0")
        .create()
        .expect("creating a CRC32 producer")
}

fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    m.headers()
        .and_then(|hs| hs.iter().find(|h| h.key == name).and_then(|h| h.value))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// How many messages `topic` holds, over all its partitions.
async fn messages_on(topic: &str) -> i64 {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap_servers())
            .create()
            .expect("creating a metadata reader");
        let metadata = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .expect("reading metadata");
        let partitions = metadata.topics()[0].partitions().len() as i32;
        (0..partitions)
            .map(|p| {
                let (low, high) = consumer
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .expect("reading watermarks");
                high - low
            })
            .sum()
    })
    .await
    .unwrap()
}

async fn run_count(db: &TestDb, run_id: &str) -> i64 {
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let n = sqlx::query_scalar("SELECT count(*) FROM runs WHERE run_id = $1")
        .bind(run_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    n
}

/// Each misrouted input (`"<topic>/<partition>/<offset>"` to its run and
/// home partition) has one copy among `read`, on its run's partition, and
/// nothing else is a copy.
fn assert_one_copy_each(read: &[OwnedMessage], misrouted: &BTreeMap<String, (String, i32)>) {
    let copies = read.iter().filter(|m| header(m, FORWARDED_FROM).is_some());
    let mut seen = BTreeSet::new();
    for copy in copies {
        let from = header(copy, FORWARDED_FROM).unwrap();
        let (run_id, home) = misrouted
            .get(&from)
            .unwrap_or_else(|| panic!("a copy of {from}, which was not misrouted"));
        assert_eq!(copy.partition(), *home, "copy of {from}");
        assert_eq!(copy.key(), Some(run_id.as_bytes()), "the key is kept");
        assert_eq!(copy.payload(), Some(start_json(run_id).as_slice()));
        assert_eq!(header(copy, FORWARDS).as_deref(), Some("1"));
        assert!(seen.insert(from.clone()), "two copies of {from}");
    }
    assert_eq!(seen.len(), misrouted.len());
}

/// The first `n` records of `topic`, published by Ductor keyed by run,
/// are each on its run's partition.
async fn assert_on_their_runs_partitions(topic: &str, n: usize, partitions: i32) {
    for d in &read_n(&reader(&[topic]), n, WAIT).await {
        let run_id = std::str::from_utf8(d.key().expect("keyed by its run")).unwrap();
        assert_eq!(
            d.partition(),
            partition_for(run_id.as_bytes(), partitions),
            "{topic}: record of {run_id}"
        );
    }
}

#[tokio::test]
async fn inputs_hashed_with_crc32_are_forwarded_once_to_their_runs_partition() {
    let serve = Serve::start(|c| c.drainer.enabled = true).await;
    let names = serve.config.topic_names();
    let requests = names.requests();
    let partitions = serve.config.kafka.partitions as i32;
    assert!(
        partitions > 1,
        "the test needs a topic with a wrong partition"
    );

    let producer = crc32_producer();
    let mut misrouted = BTreeMap::new();
    let mut runs = Vec::new();
    for i in 0..RUNS {
        let run_id = unique(&format!("crc-{i}-"));
        let (partition, offset) =
            produce(&producer, &requests, &run_id, &start_json(&run_id), &[]).await;
        let home = partition_for(run_id.as_bytes(), partitions);
        if partition != home {
            misrouted.insert(
                format!("{requests}/{partition}/{offset}"),
                (run_id.clone(), home),
            );
        }
        runs.push(run_id);
    }
    assert!(
        !misrouted.is_empty(),
        "CRC32 put all {RUNS} runs where murmur2 does"
    );

    // Every run starts, once, wherever its start was produced.
    eventually("every run started", WAIT, || async {
        let counts = futures::future::join_all(runs.iter().map(|r| run_count(&serve.db, r))).await;
        counts.iter().all(|&n| n == 1).then_some(())
    })
    .await;
    let forwarded = "ductor_inputs_total";
    let label = format!("outcome=\"forwarded\",topic=\"{requests}\"");
    let label_alt = format!("topic=\"{requests}\",outcome=\"forwarded\"");
    eventually(
        "the misrouted starts counted as forwarded",
        WAIT,
        || async {
            let text = scrape(serve.admin, &[]).await;
            let n = ductor_testkit::metrics::sum(&text, forwarded, &label)
                + ductor_testkit::metrics::sum(&text, forwarded, &label_alt);
            (n == misrouted.len() as f64).then_some(())
        },
    )
    .await;

    // One copy of each misrouted start, on its run's partition, saying
    // where it came from; nothing else was added to the topic.
    let total = RUNS + misrouted.len();
    assert_eq!(messages_on(&requests).await, total as i64);
    let read = read_n(&reader(&[&requests]), total, WAIT).await;
    assert_one_copy_each(&read, &misrouted);

    // Ductor's own producer (the outbox) follows the rule: each first
    // dispatch is on its run's partition of the steps topic.
    assert_on_their_runs_partitions(&names.steps("default"), RUNS, partitions).await;
    serve.stop().await;
}

#[tokio::test]
async fn an_input_forwarded_as_often_as_allowed_is_dead_lettered_as_misrouted() {
    let serve = Serve::start(|c| c.coordinator.max_input_forwards = 1).await;
    let names = serve.config.topic_names();
    let requests = names.requests();
    let partitions = serve.config.kafka.partitions as i32;
    let run_id = unique("astray-");
    let wrong = (partition_for(run_id.as_bytes(), partitions) + 1) % partitions;
    let producer = producer();
    let value = start_json(&run_id);
    let record = rdkafka::producer::FutureRecord::to(&requests)
        .partition(wrong)
        .key(&run_id)
        .payload(&value[..])
        .headers(
            rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                key: FORWARDS,
                value: Some("1"),
            }),
        );
    let (_, offset) = producer
        .send(record, Duration::from_secs(30))
        .await
        .map(|d| (d.partition, d.offset))
        .map_err(|(e, _)| e)
        .expect("producing");
    // A good start behind it on the same partition applies.
    let good = loop {
        let candidate = unique("behind-");
        if partition_for(candidate.as_bytes(), partitions) == wrong {
            break candidate;
        }
    };
    produce(&producer, &requests, &good, &start_json(&good), &[]).await;
    eventually("the start behind it applied", WAIT, || async {
        (run_count(&serve.db, &good).await == 1).then_some(())
    })
    .await;

    let letters = read_n(&reader(&[&names.dead_letters()]), 1, WAIT).await;
    let letter = &letters[0];
    assert_eq!(
        header(letter, "ductor-dlq-error-class").as_deref(),
        Some("misrouted")
    );
    assert_eq!(
        header(letter, "ductor-dlq-stage").as_deref(),
        Some("validate")
    );
    assert_eq!(
        header(letter, "ductor-dlq-offset"),
        Some(offset.to_string())
    );
    assert_eq!(
        header(letter, "ductor-dlq-partition"),
        Some(wrong.to_string())
    );
    assert_eq!(run_count(&serve.db, &run_id).await, 0, "never applied");
    serve.stop().await;
}
