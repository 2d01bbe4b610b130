//! Recorded dead letters against the real broker and Postgres: every input
//! the ingress refuses is recorded once, whole, however often it is
//! redelivered; a replay produces its input again once, signed by Ductor,
//! and starts its run once; a discarded letter is never replayed; a tenant
//! sees only its own letters; an input that reached the broker compressed
//! comes out of the dead-letter topic and the table whole; and retention,
//! not serve's role, deletes old letters.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::time::Duration;

use common::*;
use ductor::config::{Config, SigningKey};
use ductor::contract::headers::{DLQ_TRUNCATED, REPLAY_ID};
use ductor::infra::crash::{CrashHooks, CrashPoint};
use ductor::ingress::dead_letters::{
    Bytes, DeadLetterError, DeadLetters, DiscardStatus, Letter, LetterFilter, LetterStatus,
    LetterSummary, Page, ReplayStatus,
};
use ductor::ingress::{IngressContext, StepReport};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);
const ACME_KEY: &str = "acme-key-0123456789";

/// A message on an input topic: topic, partition, offset.
type At = (String, i32, i64);

struct Stack {
    db: TestDb,
    config: Config,
    producer: FutureProducer,
}

impl Stack {
    async fn new(tweak: impl FnOnce(&mut Config)) -> Stack {
        let db = TestDb::migrated().await;
        let mut config = test_config(&db);
        tweak(&mut config);
        ductor::infra::kafka::create_configured_topics(&config)
            .await
            .expect("creating topics");
        Stack {
            db,
            config,
            producer: producer(),
        }
    }

    /// An ingress subscribed to the input topics, to step.
    fn ingress(&self, crash: CrashHooks) -> IngressContext {
        let workflows = ductor::infra::workflows::load_dir(&self.config.coordinator.workflows_dir)
            .expect("loading workflows");
        let mut ctx = IngressContext::new(&self.config, self.db.pool.clone(), workflows)
            .expect("creating ingress");
        ctx.crash = crash;
        ductor::ingress::subscribe(&ctx).expect("subscribing the ingress");
        ctx
    }

    fn letters(&self) -> DeadLetters {
        DeadLetters::new(&self.config, self.db.pool.clone()).expect("the operations")
    }

    async fn send(&self, topic: &str, key: &str, value: &[u8], headers: &[(&str, &str)]) -> At {
        let (partition, offset) = produce(&self.producer, topic, key, value, headers).await;
        (topic.to_owned(), partition, offset)
    }

    async fn rows(&self) -> i64 {
        self.db.count("dead_letters").await
    }

    async fn run_count(&self, run_id: &str) -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM runs WHERE run_id = $1), \
                    (SELECT count(*) FROM run_transitions WHERE run_id = $1)",
        )
        .bind(run_id)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Every letter of the scope, newest first.
    async fn all(&self, tenant: Option<&str>) -> Vec<LetterSummary> {
        let page = self
            .letters()
            .list(tenant, &LetterFilter::default(), Page::default())
            .await
            .expect("listing letters");
        assert_eq!(page.next, None);
        page.letters
    }
}

/// Steps `ingress` one batch at a time until its batches held every
/// message of `sent`, whatever topics they are on; what they did, added up.
async fn step_until(ingress: &IngressContext, sent: &[At]) -> StepReport {
    let deadline = tokio::time::Instant::now() + WAIT;
    let shutdown = CancellationToken::new();
    let mut total = StepReport::default();
    while !sent.iter().all(|(t, p, o)| total.covers(t, *p, *o)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the batches did not hold {sent:?} within {WAIT:?}: {total:?}"
        );
        let stepped = ductor::ingress::step(ingress, INGRESS_STEP_WAIT, &shutdown)
            .await
            .expect("stepping the ingress");
        if let Some(report) = stepped {
            add_report(&mut total, &report);
        }
    }
    total
}

/// The next offset of `topic`/`partition`: what a replay would move.
async fn high_watermark(topic: &str, partition: i32) -> i64 {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", bootstrap_servers())
            .create()
            .expect("creating a watermark probe");
        consumer
            .fetch_watermarks(&topic, partition, Duration::from_secs(10))
            .expect("fetching watermarks")
            .1
    })
    .await
    .expect("the watermark probe panicked")
}

fn header(m: &OwnedMessage, name: &str) -> Option<Vec<u8>> {
    m.headers()
        .and_then(|hs| hs.iter().find(|h| h.key == name).and_then(|h| h.value))
        .map(<[u8]>::to_vec)
}

/// An input Ductor did not refuse, checked as the chaos checker checks
/// them: its headers and its value against the contract's schemas.
fn input_on_contract(m: &OwnedMessage) {
    let headers: Vec<(String, Vec<u8>)> = m
        .headers()
        .map(|hs| {
            hs.iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default();
    ductor_testkit::schemas::check_headers("input", &headers).expect("input headers");
    let value: Value = serde_json::from_slice(m.payload().unwrap_or_default()).expect("JSON");
    ductor_testkit::schemas::check_message(&value).expect("an input of the contract");
}

/// The letter of the input at `at`.
fn of<'a>(letters: &'a [LetterSummary], at: &At) -> &'a LetterSummary {
    letters
        .iter()
        .find(|l| (&l.source_topic, l.source_partition, l.source_offset) == (&at.0, at.1, at.2))
        .unwrap_or_else(|| panic!("no letter for {at:?}"))
}

fn text(bytes: Option<&Bytes>) -> Option<&str> {
    match bytes {
        Some(Bytes::Utf8(text)) => Some(text),
        _ => None,
    }
}

fn signal(run_id: &str, tenant: &str) -> Vec<u8> {
    json!({"type": "wakeup.signal", "schema_version": 1, "run_id": run_id,
           "tenant": tenant, "signal_id": "s1", "name": "poke"})
    .to_string()
    .into_bytes()
}

#[tokio::test]
async fn a_malformed_and_a_refused_input_are_recorded_once_also_when_redelivered() {
    let s = Stack::new(|_| {}).await;
    let names = s.config.topic_names();
    let ghost = unique("ghost-");
    let malformed = s
        .send(&names.requests(), "k-1", b"{not json", &[("trace", "t-1")])
        .await;
    let refused = s
        .send(&names.wakeups(), &ghost, &signal(&ghost, "acme"), &[])
        .await;

    // The first ingress records and publishes both letters, and stops each
    // time before storing the offsets, as a crash there would.
    let mut crash = CrashHooks::default();
    crash.arm(CrashPoint::IngressAfterCommit);
    let crashing = s.ingress(crash);
    let shutdown = CancellationToken::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while s.rows().await < 2 {
        assert!(tokio::time::Instant::now() < deadline, "not recorded");
        match ductor::ingress::step(&crashing, INGRESS_STEP_WAIT, &shutdown).await {
            Ok(None) => {}
            Ok(Some(report)) => panic!("the hook lets no batch through: {report:?}"),
            Err(e) => assert!(e.to_string().contains("after commit"), "{e:#}"),
        }
    }
    ductor::ingress::close(&crashing);
    drop(crashing);

    // Redelivered, both are refused again, and recorded no second time.
    let restarted = s.ingress(CrashHooks::default());
    let again = step_until(&restarted, &[malformed.clone(), refused.clone()]).await;
    assert_eq!(again.dead_lettered(), 2, "{again:?}");
    assert_eq!(s.rows().await, 2, "one row per input, redelivered or not");
    // The topic has each letter twice (at least once), each on the contract.
    let dlq = reader(&[&names.dead_letters()]);
    read_n(&dlq, 4, WAIT).await;

    let letters = s.all(None).await;
    let (bad, ghostly) = (of(&letters, &malformed), of(&letters, &refused));
    assert_eq!(
        (bad.stage.as_str(), bad.class.as_str()),
        ("decode", "malformed")
    );
    assert_eq!((bad.tenant.as_deref(), bad.run_id.as_deref()), (None, None));
    assert_eq!(
        (ghostly.stage.as_str(), ghostly.class.as_str()),
        ("validate", "unknown_run")
    );
    assert_eq!(ghostly.tenant.as_deref(), Some("acme"));
    assert_eq!(ghostly.run_id.as_deref(), Some(ghost.as_str()));
    assert_eq!(ghostly.input_type.as_deref(), Some("wakeup.signal"));
    assert!(letters.iter().all(|l| l.status == LetterStatus::Pending));
    let whole: Letter = s.letters().show(None, bad.id).await.unwrap();
    assert_eq!(text(whole.value.as_ref()), Some("{not json"));
    assert_eq!(text(whole.key.as_ref()), Some("k-1"));
    assert_eq!(whole.headers.len(), 1);
    assert_eq!(whole.headers[0].key, "trace");
    assert_eq!(text(whole.headers[0].value.as_ref()), Some("t-1"));
    ductor::ingress::close(&restarted);
    s.db.drop_db().await;
}

#[tokio::test]
async fn a_replayed_letter_starts_its_run_once_however_often_it_is_replayed() {
    // Starts of pool "signed" must carry their tenant's signature.
    let s = Stack::new(|c| {
        c.signatures.pools = vec!["signed".into()];
        c.signatures
            .tenant_keys
            .insert("acme".into(), SigningKey(ACME_KEY.into()));
    })
    .await;
    let requests = s.config.topic_names().requests();
    let run_id = unique("replayed-");
    let start = json!({"type": "run.start", "schema_version": 1, "run_id": run_id,
        "tenant": "acme", "workflow": "example", "pool": "signed", "input": {"n": 1}})
    .to_string();
    let unsigned = s.send(&requests, &run_id, start.as_bytes(), &[]).await;
    let ingress = s.ingress(CrashHooks::default());
    let refused = step_until(&ingress, std::slice::from_ref(&unsigned)).await;
    assert_eq!(refused.dead_lettered(), 1, "{refused:?}");
    let filter = LetterFilter {
        class: Some("unauthenticated".into()),
        ..LetterFilter::default()
    };
    let letters = s.letters();
    let page = letters
        .list(Some("acme"), &filter, Page::default())
        .await
        .unwrap();
    assert_eq!(page.letters.len(), 1);
    let id = page.letters[0].id;

    // Replayed through Ductor, which signs it with acme's key: the run
    // starts.
    let first = letters.replay(Some("acme"), id).await.expect("replaying");
    assert_eq!(first.status, ReplayStatus::Replayed);
    assert!(first.signed);
    assert_eq!(first.topic, requests);
    assert_eq!(
        first.run.as_ref().map(|r| r.run_id.as_str()),
        Some(run_id.as_str())
    );
    let replayed_at: At = (requests.clone(), first.partition, first.offset);
    let applied = step_until(&ingress, std::slice::from_ref(&replayed_at)).await;
    assert_eq!(
        (applied.applied, applied.dead_lettered()),
        (1, 0),
        "{applied:?}"
    );
    assert_eq!(s.run_count(&run_id).await, (1, 1));

    // Again: the first replay's outcome, and nothing produced.
    let second = letters
        .replay(Some("acme"), id)
        .await
        .expect("replaying again");
    assert_eq!(second.status, ReplayStatus::AlreadyReplayed);
    assert_eq!(
        (&second.replay_id, second.partition, second.offset),
        (&first.replay_id, first.partition, first.offset)
    );
    assert!(second.run.as_ref().is_some_and(|r| r.exists), "{second:?}");
    assert_eq!(
        high_watermark(&requests, first.partition).await,
        first.offset + 1,
        "a second replay produced a record"
    );
    let shown = letters.show(Some("acme"), id).await.unwrap();
    assert_eq!(shown.summary.status, LetterStatus::Replayed);
    assert_eq!(s.run_count(&run_id).await, (1, 1), "one run, one start");

    // The replay is the original value, signed, with its replay id, and on
    // the contract.
    let topic = reader(&[&requests]);
    let records = read_n(&topic, 2, WAIT).await;
    let copy = records
        .iter()
        .find(|m| m.offset() == first.offset && m.partition() == first.partition)
        .expect("the replayed record");
    assert_eq!(copy.payload(), Some(start.as_bytes()));
    assert_eq!(copy.key(), Some(run_id.as_bytes()));
    assert_eq!(
        header(copy, REPLAY_ID),
        Some(first.replay_id.clone().into_bytes())
    );
    assert!(header(copy, ductor::contract::signature::SIGNATURE).is_some());
    input_on_contract(copy);
    ductor::ingress::close(&ingress);
    s.db.drop_db().await;
}

/// The copies one replay may produce (a crash before it was recorded, two
/// operators at once) carry one replay id, by which a start that names no
/// key of its own is keyed: one run.
#[tokio::test]
async fn copies_of_one_replay_of_a_keyless_start_make_one_run() {
    let s = Stack::new(|_| {}).await;
    let requests = s.config.topic_names().requests();
    let replay_id = uuid::Uuid::new_v4().to_string();
    let start = json!({"type": "run.start", "schema_version": 1, "tenant": "acme",
        "workflow": "example"})
    .to_string();
    let mut sent = Vec::new();
    for _ in 0..2 {
        let at = s
            .send(&requests, "k", start.as_bytes(), &[(REPLAY_ID, &replay_id)])
            .await;
        sent.push(at);
    }
    let ingress = s.ingress(CrashHooks::default());
    let report = step_until(&ingress, &sent).await;
    assert_eq!((report.applied, report.no_ops), (1, 1), "{report:?}");
    assert_eq!(s.db.count("runs").await, 1);
    ductor::ingress::close(&ingress);
    s.db.drop_db().await;
}

#[tokio::test]
async fn a_discarded_letter_is_never_replayed_nor_a_replayed_one_discarded() {
    let s = Stack::new(|_| {}).await;
    let wakeups = s.config.topic_names().wakeups();
    let mut sent = Vec::new();
    for _ in 0..4 {
        let ghost = unique("ghost-");
        sent.push(s.send(&wakeups, &ghost, &signal(&ghost, "acme"), &[]).await);
    }
    let ingress = s.ingress(CrashHooks::default());
    step_until(&ingress, &sent).await;
    ductor::ingress::close(&ingress);
    let letters = s.letters();
    let mut ids: Vec<i64> = s.all(Some("acme")).await.iter().map(|l| l.id).collect();
    ids.sort_unstable();
    let &[a, b, c, d] = ids.as_slice() else {
        panic!("four letters: {ids:?}")
    };

    let discarded = letters
        .discard(Some("acme"), a, "  not ours ")
        .await
        .unwrap();
    assert_eq!(
        (discarded.status, discarded.reason.as_str()),
        (DiscardStatus::Discarded, "not ours")
    );
    let again = letters
        .discard(Some("acme"), a, "something else")
        .await
        .unwrap();
    assert_eq!(
        (again.status, again.reason.as_str(), again.discarded_at),
        (
            DiscardStatus::AlreadyDiscarded,
            "not ours",
            discarded.discarded_at
        )
    );
    assert!(matches!(
        letters.replay(Some("acme"), a).await,
        Err(DeadLetterError::Discarded { .. })
    ));
    let shown = letters.show(None, a).await.unwrap();
    assert_eq!(shown.summary.status, LetterStatus::Discarded);
    assert!(shown.summary.replay.is_none(), "no replay was claimed");
    assert!(matches!(
        letters.discard(Some("acme"), b, "   ").await,
        Err(DeadLetterError::NoReason)
    ));
    letters.replay(None, b).await.expect("replaying b");
    assert!(matches!(
        letters.discard(None, b, "late").await,
        Err(DeadLetterError::Replayed(id)) if id == b
    ));

    // A filtered set, a page of one at a time: the two still pending, oldest
    // first; neither the discarded nor the replayed one.
    let filter = LetterFilter {
        class: Some("unknown_run".into()),
        ..LetterFilter::default()
    };
    let mut cursor = None;
    let mut replayed = Vec::new();
    loop {
        let page = Page { cursor, limit: 1 };
        let batch = letters
            .replay_matching(Some("acme"), &filter, page)
            .await
            .unwrap();
        assert!(batch.refused.is_empty(), "{batch:?}");
        replayed.extend(batch.replayed.iter().map(|o| o.id));
        match batch.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(replayed, [c, d]);
    let statuses: Vec<LetterStatus> = s.all(None).await.iter().map(|l| l.status).collect();
    assert_eq!(
        statuses,
        [
            LetterStatus::Replayed,
            LetterStatus::Replayed,
            LetterStatus::Replayed,
            LetterStatus::Discarded
        ]
    );
    s.db.drop_db().await;
}

#[tokio::test]
async fn a_tenant_sees_and_acts_on_its_own_letters_only() {
    let s = Stack::new(|_| {}).await;
    let names = s.config.topic_names();
    let mut sent = Vec::new();
    for tenant in ["acme", "globex"] {
        let ghost = unique("ghost-");
        sent.push(
            s.send(&names.wakeups(), &ghost, &signal(&ghost, tenant), &[])
                .await,
        );
    }
    sent.push(s.send(&names.requests(), "k", b"[1,", &[]).await);
    let ingress = s.ingress(CrashHooks::default());
    step_until(&ingress, &sent).await;
    ductor::ingress::close(&ingress);
    let letters = s.letters();

    let acme = s.all(Some("acme")).await;
    assert_eq!(acme.len(), 1);
    assert_eq!(acme[0].tenant.as_deref(), Some("acme"));
    let globex = s.all(Some("globex")).await;
    assert_eq!(globex.len(), 1);
    let theirs = globex[0].id;
    assert!(matches!(
        letters.show(Some("acme"), theirs).await,
        Err(DeadLetterError::NotFound(_))
    ));
    assert!(matches!(
        letters.replay(Some("acme"), theirs).await,
        Err(DeadLetterError::NotFound(_))
    ));
    assert!(matches!(
        letters.discard(Some("acme"), theirs, "mine now").await,
        Err(DeadLetterError::NotFound(_))
    ));
    assert_eq!(
        letters.show(None, theirs).await.unwrap().summary.status,
        LetterStatus::Pending,
        "another tenant changed nothing"
    );
    let counts = letters
        .counts(Some("acme"), &LetterFilter::default())
        .await
        .unwrap();
    assert_eq!(counts.len(), 1);
    assert_eq!(
        (
            counts[0].stage.as_str(),
            counts[0].class.as_str(),
            counts[0].letters
        ),
        ("validate", "unknown_run", 1)
    );
    let everyone = letters
        .counts(None, &LetterFilter::default())
        .await
        .unwrap();
    assert_eq!(everyone.iter().map(|c| c.letters).sum::<i64>(), 3);

    // Every tenant's, and the one whose tenant could not be read, a page
    // of one at a time: each once, newest first.
    let (mut seen, mut cursor) = (Vec::new(), None);
    loop {
        let page = letters
            .list(None, &LetterFilter::default(), Page { cursor, limit: 1 })
            .await
            .unwrap();
        seen.extend(page.letters.iter().map(|l| l.id));
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0] > w[1]), "{seen:?}");
    let letters = &letters;
    let only = |filter: LetterFilter| async move {
        letters
            .list(None, &filter, Page::default())
            .await
            .unwrap()
            .letters
            .len()
    };
    let decode = LetterFilter {
        stage: Some("decode".into()),
        source_topic: Some(names.requests()),
        ..LetterFilter::default()
    };
    assert_eq!(only(decode).await, 1);
    let pending = LetterFilter {
        status: Some(LetterStatus::Pending),
        ..LetterFilter::default()
    };
    assert_eq!(only(pending).await, 3);
    let later = LetterFilter {
        since: Some(chrono::Utc::now() + chrono::Duration::hours(1)),
        ..LetterFilter::default()
    };
    assert_eq!(only(later).await, 0);
    s.db.drop_db().await;
}

/// The case of the issue: 2 MiB of value that reached the broker only
/// because its producer compressed it. Its letter is compressed too, and
/// arrives whole on the dead-letter topic and in the table; a replay sends
/// those bytes back.
#[tokio::test]
async fn an_input_the_broker_took_compressed_is_dead_lettered_whole() {
    let s = Stack::new(|_| {}).await;
    let names = s.config.topic_names();
    let requests = names.requests();
    let compressing: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers())
        .set("compression.type", "lz4")
        .set("message.max.bytes", (8 << 20).to_string())
        .set("linger.ms", "0")
        .create()
        .expect("creating a compressing producer");
    let value = json!({"type": "run.start", "schema_version": 1, "run_id": unique("big-"),
        "tenant": "acme", "workflow": "example", "input": "x".repeat(2 << 20)})
    .to_string();
    assert!(value.len() as u64 > s.config.kafka.message_max_bytes * 2);
    let (partition, offset) = produce(&compressing, &requests, "big", value.as_bytes(), &[]).await;
    let big: At = (requests.clone(), partition, offset);
    let ingress = s.ingress(CrashHooks::default());
    step_until(&ingress, std::slice::from_ref(&big)).await;

    let dlq = reader(&[&names.dead_letters()]);
    let letter = read_n(&dlq, 1, WAIT).await.remove(0);
    assert_eq!(
        header(&letter, "ductor-dlq-error-class").as_deref(),
        Some(&b"too_large"[..])
    );
    assert_eq!(header(&letter, DLQ_TRUNCATED), None, "nothing was cut");
    assert_eq!(letter.payload().map(<[u8]>::len), Some(value.len()));
    assert!(
        letter.payload() == Some(value.as_bytes()),
        "the value, whole"
    );
    assert_eq!(letter.key(), Some(&b"big"[..]));

    let letters = s.letters();
    let rows = s.all(Some("acme")).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].value_bytes, value.len() as i64);
    assert!(!rows[0].value_cut);
    let recorded = letters.show(Some("acme"), rows[0].id).await.unwrap();
    assert!(
        text(recorded.value.as_ref()) == Some(value.as_str()),
        "recorded whole"
    );

    // A replay sends the whole value back (refused again, as too large,
    // and recorded whole again at its new offset).
    let replay = letters.replay(Some("acme"), rows[0].id).await.unwrap();
    let again: At = (requests.clone(), replay.partition, replay.offset);
    let refused = step_until(&ingress, std::slice::from_ref(&again)).await;
    assert_eq!(refused.dead_lettered(), 1);
    let rows = s.all(Some("acme")).await;
    let second = rows
        .iter()
        .find(|l| l.source_offset == replay.offset && l.source_partition == replay.partition)
        .expect("the replay's own letter");
    let shown = letters.show(None, second.id).await.unwrap();
    assert!(
        text(shown.value.as_ref()) == Some(value.as_str()),
        "replayed whole"
    );
    assert!(
        shown.headers.iter().any(
            |h| h.key == REPLAY_ID && text(h.value.as_ref()) == Some(replay.replay_id.as_str())
        )
    );
    ductor::ingress::close(&ingress);
    s.db.drop_db().await;
}

/// Old letters go by retention's function; serve's role may delete none
/// itself, nor rewrite what a letter says.
#[tokio::test]
async fn retention_deletes_old_letters_and_serve_cannot_delete_or_rewrite_one() {
    let s = Stack::new(|_| {}).await;
    let requests = s.config.topic_names().requests();
    let mut sent = Vec::new();
    for _ in 0..2 {
        sent.push(s.send(&requests, "k", b"{not json", &[]).await);
    }
    let ingress = s.ingress(CrashHooks::default());
    step_until(&ingress, &sent).await;
    ductor::ingress::close(&ingress);
    for sql in [
        "DELETE FROM dead_letters",
        "UPDATE dead_letters SET class = 'nothing'",
        "UPDATE dead_letters SET value = NULL",
    ] {
        let err = sqlx::raw_sql(sql).execute(&s.db.pool).await.expect_err(sql);
        let code = err.as_database_error().and_then(|d| d.code());
        assert_eq!(code.as_deref(), Some("42501"), "{sql}: {err}");
    }
    sqlx::query(
        "UPDATE dead_letters SET dead_lettered_at = now() - interval '2 hours' \
         WHERE source_offset = $1",
    )
    .bind(sent[0].2)
    .execute(&s.db.owner)
    .await
    .unwrap();
    let mut config = s.config.dead_letters.clone();
    config.retention_ms = 3_600_000;
    let purged = ductor::ingress::dead_letters::retention::purge(&s.db.pool, &config)
        .await
        .expect("retention as the application role");
    assert_eq!(purged, 1);
    let left = s.all(None).await;
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].source_offset, sent[1].2);
    config.retention_ms = 0;
    assert_eq!(
        ductor::ingress::dead_letters::retention::purge(&s.db.pool, &config)
            .await
            .unwrap(),
        0,
        "0 keeps every letter"
    );
    s.db.drop_db().await;
}

/// A letter whose row keeps only part of its value cannot be replayed (it
/// would be another input); refused before it is claimed, it stays pending
/// and can be discarded.
#[tokio::test]
async fn a_letter_recorded_cut_is_not_replayed_and_can_still_be_discarded() {
    let s = Stack::new(|c| c.dead_letters.max_value_bytes = 8).await;
    let requests = s.config.topic_names().requests();
    let sent = s.send(&requests, "k", b"{not json at all", &[]).await;
    let ingress = s.ingress(CrashHooks::default());
    step_until(&ingress, std::slice::from_ref(&sent)).await;
    ductor::ingress::close(&ingress);
    let letters = s.letters();
    let cut = &s.all(None).await[0];
    assert!(cut.value_cut && cut.value_bytes == 16, "{cut:?}");
    let shown = letters.show(None, cut.id).await.unwrap();
    assert_eq!(text(shown.value.as_ref()), Some("{not jso"));
    assert!(matches!(
        letters.replay(None, cut.id).await,
        Err(DeadLetterError::NotReplayable { .. })
    ));
    assert_eq!(s.all(None).await[0].status, LetterStatus::Pending);
    let discarded = letters.discard(None, cut.id, "cut").await.unwrap();
    assert_eq!(discarded.status, DiscardStatus::Discarded);
    s.db.drop_db().await;
}
