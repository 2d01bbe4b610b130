//! Workflows that move data between their steps, end to end on the real
//! stack: `serve` folds the inputs, the example worker runs the tasks (its
//! output is its input with a member named after the step), and each step
//! gets what its selection names; a selection that finds nothing fails the
//! run with its cause. And `ductor workflows check`, the binary itself,
//! refuses each malformed definition with its rule.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{TestDb, eventually, example_worker, produce, producer, test_config};
use ductor::client::worker::{StepDispatch, StepOutcome};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const DONE: Duration = Duration::from_secs(120);

/// `checkout`: the items to `reserve`, the total to `charge` (its result
/// at `/payment`), the whole document to `notify`; the run's output is the
/// payment. `picky`: a step that selects what the input lacks.
fn workflows(dir: &Path) {
    let checkout = "name = \"checkout\"\nversion = 1\noutput = \"/payment\"\n\n\
         [[steps]]\nname = \"reserve\"\npool = \"p\"\ntimeout_ms = 5000\n\
         input = \"/input/order/items\"\n\n\
         [[steps]]\nname = \"charge\"\npool = \"p\"\ntimeout_ms = 5000\n\
         input = \"/input/order/total\"\nresult = \"/payment\"\n\n\
         [[steps]]\nname = \"notify\"\npool = \"p\"\ntimeout_ms = 5000\ninput = \"\"\n";
    let picky = "name = \"picky\"\nversion = 1\n\n\
         [[steps]]\nname = \"first\"\npool = \"p\"\ntimeout_ms = 5000\n\
         input = \"/input/customer\"\n";
    std::fs::write(dir.join("checkout.toml"), checkout).unwrap();
    std::fs::write(dir.join("picky.toml"), picky).unwrap();
}

/// `route`: fast orders to `express` (then `done`), the rest to
/// `standard`. `spin`: `count`, then back to it while its result says
/// done, at most twice.
fn choosing_workflows(dir: &Path) {
    let route = "name = \"route\"\nversion = 1\n\n\
         [[steps]]\nname = \"pick\"\nkind = \"choice\"\ndefault = \"standard\"\n\
         choices = [{ next = \"express\", when = { pointer = \"/input/speed\", equals = \"fast\" } }]\n\n\
         [[steps]]\nname = \"express\"\npool = \"p\"\ntimeout_ms = 5000\nnext = \"done\"\n\n\
         [[steps]]\nname = \"standard\"\npool = \"p\"\ntimeout_ms = 5000\n\n\
         [[steps]]\nname = \"done\"\npool = \"p\"\ntimeout_ms = 5000\n";
    let spin = "name = \"spin\"\nversion = 1\n\n\
         [[steps]]\nname = \"count\"\npool = \"p\"\ntimeout_ms = 5000\nmax_visits = 2\n\n\
         [[steps]]\nname = \"again\"\nkind = \"choice\"\nmax_visits = 5\ndefault = \"stop\"\n\
         choices = [{ next = \"count\", when = { pointer = \"/steps/count/count/done\", equals = true } }]\n\n\
         [[steps]]\nname = \"stop\"\npool = \"p\"\ntimeout_ms = 5000\n";
    std::fs::write(dir.join("route.toml"), route).unwrap();
    std::fs::write(dir.join("spin.toml"), spin).unwrap();
}

async fn finished(db: &TestDb, run_id: &str) -> (String, Value) {
    eventually(&format!("{run_id} ended"), DONE, || async {
        let row: Option<(String, Value)> =
            sqlx::query_as("SELECT status, state FROM runs WHERE run_id = $1")
                .bind(run_id)
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        row.filter(|(status, _)| status != "running")
    })
    .await
}

/// The `output` in the detail of each transition that finished a step, by
/// the step's index.
async fn step_outputs(db: &TestDb, run_id: &str) -> Vec<(i64, Value)> {
    sqlx::query_as(
        "SELECT (detail->>'completed_step')::bigint, detail->'output' FROM run_transitions \
         WHERE run_id = $1 AND detail ? 'completed_step' ORDER BY seq",
    )
    .bind(run_id)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_step_gets_what_its_selection_names_and_the_run_ends_with_its_output() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    let dir = tempfile::tempdir().unwrap();
    workflows(dir.path());
    config.coordinator.workflows_dir = PathBuf::from(dir.path());
    config.kafka.step_pools = vec!["p".into()];
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let shutdown = CancellationToken::new();
    let serve = tokio::spawn(ductor::cli::serve::run(config.clone(), shutdown.clone()));
    let mut worker = example_worker(&config)
        .args(["--pool", "p", "--fail-rate", "0", "--work-ms", "0"])
        .spawn()
        .expect("starting the example worker");

    let p = producer();
    let (good, bad) = (common::unique("checkout"), common::unique("picky"));
    let order = json!({"order": {"items": ["tea", "cups"], "total": 30}});
    for (run_id, workflow, input) in [
        (&good, "checkout", order.clone()),
        (&bad, "picky", json!({"order": 1})),
    ] {
        let start = json!({
            "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": "acme",
            "workflow": workflow, "input": input,
        });
        let topic = config.topic_names().requests();
        produce(&p, &topic, run_id, start.to_string().as_bytes(), &[]).await;
    }

    let (status, state) = finished(&db, &good).await;
    assert_eq!(status, "succeeded", "{state}");
    let outputs = step_outputs(&db, &good).await;
    let steps: Vec<i64> = outputs.iter().map(|(i, _)| *i).collect();
    assert_eq!(steps, [0, 1, 2]);
    // The worker echoes its input beside its own member.
    assert_eq!(outputs[0].1["input"], json!(["tea", "cups"]));
    assert_eq!(outputs[1].1["input"], json!(30));
    let notified = &outputs[2].1;
    assert_eq!(notified["input"], order, "{notified}");
    assert_eq!(notified["steps"]["reserve"], outputs[0].1, "{notified}");
    assert_eq!(notified["payment"], outputs[1].1, "{notified}");
    assert!(notified["notify"]["done"].as_bool().unwrap(), "{notified}");
    assert_eq!(state["output"], outputs[1].1, "the run ends with /payment");
    assert_eq!(state["results"]["payment"], outputs[1].1);
    assert_eq!(state["results"]["steps"]["notify"], *notified);

    let (status, state) = finished(&db, &bad).await;
    assert_eq!(status, "failed");
    let error = state["error"].as_str().unwrap();
    assert!(error.starts_with("unresolved_pointer"), "{error}");
    assert!(error.contains("/input/customer"), "{error}");
    // It fails in its first transition, the start's.
    let cause: Option<String> = sqlx::query_scalar(
        "SELECT detail->>'cause' FROM run_transitions WHERE run_id = $1 AND to_status = 'failed'",
    )
    .bind(&bad)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(cause.as_deref(), Some("unresolved_pointer"));
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM run_attempts WHERE run_id = $1")
        .bind(&bad)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempts, 0, "nothing was dispatched with a missing input");

    shutdown.cancel();
    serve.await.unwrap().unwrap();
    worker.kill().await.unwrap();
    db.drop_db().await;
}

/// The steps a run's attempts were dispatched to, with their step keys,
/// in order.
async fn dispatched(db: &TestDb, run_id: &str) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8')::jsonb->>'step', \
                convert_from(payload, 'UTF8')::jsonb->>'step_key' \
         FROM eec_effect_intent WHERE run_id = $1 AND ce_type = 'ductor.step.dispatch' \
         ORDER BY seq, effect_index",
    )
    .bind(run_id)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_choice_picks_the_next_step_and_a_loop_stops_at_its_bound() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    let dir = tempfile::tempdir().unwrap();
    choosing_workflows(dir.path());
    config.coordinator.workflows_dir = PathBuf::from(dir.path());
    config.kafka.step_pools = vec!["p".into()];
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let shutdown = CancellationToken::new();
    let serve = tokio::spawn(ductor::cli::serve::run(config.clone(), shutdown.clone()));
    let mut worker = example_worker(&config)
        .args(["--pool", "p", "--fail-rate", "0", "--work-ms", "0"])
        .spawn()
        .expect("starting the example worker");
    let p = producer();
    let (fast, slow, spin) = (
        common::unique("fast"),
        common::unique("slow"),
        common::unique("spin"),
    );
    for (run_id, workflow, input) in [
        (&fast, "route", json!({"speed": "fast"})),
        (&slow, "route", json!({"speed": "slow"})),
        (&spin, "spin", json!({})),
    ] {
        let start = json!({
            "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": "acme",
            "workflow": workflow, "input": input,
        });
        let topic = config.topic_names().requests();
        produce(&p, &topic, run_id, start.to_string().as_bytes(), &[]).await;
    }
    let steps = |d: Vec<(String, String)>| d.into_iter().map(|(s, _)| s).collect::<Vec<_>>();
    assert_eq!(finished(&db, &fast).await.0, "succeeded");
    assert_eq!(steps(dispatched(&db, &fast).await), ["express", "done"]);
    assert_eq!(finished(&db, &slow).await.0, "succeeded");
    assert_eq!(steps(dispatched(&db, &slow).await), ["standard", "done"]);

    let (status, state) = finished(&db, &spin).await;
    assert_eq!(status, "failed", "{state}");
    assert!(
        state["error"].as_str().unwrap().starts_with("loop_bound"),
        "{state}"
    );
    let keys = dispatched(&db, &spin).await;
    assert_eq!(
        keys,
        [
            ("count".to_owned(), format!("{spin}/step/0")),
            ("count".to_owned(), format!("{spin}/step/0/visit/2")),
        ]
    );
    assert_eq!(state["visits"]["0"]["count"], 3);
    assert_eq!(state["visits"]["1"]["count"], 2);

    shutdown.cancel();
    serve.await.unwrap().unwrap();
    worker.kill().await.unwrap();
    db.drop_db().await;
}

/// `fan`: `reserve` runs `east` (two steps) and `west` at once, then
/// `ship` gets their results. `fragile`: `slow`, which no worker answers,
/// beside `broken`, which fails for good.
fn parallel_workflows(dir: &Path) {
    let task = |name: &str, timeout_ms: u64| {
        format!("name = \"{name}\"\npool = \"p\"\ntimeout_ms = {timeout_ms}\n")
    };
    let fan = format!(
        "name = \"fan\"\nversion = 1\n\n\
         [[steps]]\nname = \"reserve\"\nkind = \"parallel\"\n\n\
         [[steps.branches]]\nname = \"east\"\n\
         [[steps.branches.steps]]\n{}\n[[steps.branches.steps]]\n{}\n\
         [[steps.branches]]\nname = \"west\"\n\
         [[steps.branches.steps]]\n{}\n\
         [[steps]]\n{}",
        task("east1", 5000),
        task("east2", 5000),
        task("west1", 5000),
        task("ship", 5000)
    );
    let fragile = format!(
        "name = \"fragile\"\nversion = 1\n\n\
         [[steps]]\nname = \"reserve\"\nkind = \"parallel\"\n\n\
         [[steps.branches]]\nname = \"good\"\n[[steps.branches.steps]]\n{}\n\
         [[steps.branches]]\nname = \"bad\"\n[[steps.branches.steps]]\n{}",
        task("slow", 60_000),
        task("broken", 5000)
    );
    let pack = format!(
        "name = \"pack\"\nversion = 1\n\n\
         [[steps]]\nname = \"each\"\nkind = \"map\"\ninput = \"/input/items\"\n\
         max_concurrency = 2\n\n\
         [[steps.steps]]\n{}\n\
         [[steps]]\n{}",
        task("wrap", 5000),
        task("ship", 5000)
    );
    std::fs::write(dir.join("pack.toml"), pack).unwrap();
    let stalled = format!(
        "name = \"stalled\"\nversion = 1\n\n\
         [[steps]]\nname = \"both\"\nkind = \"parallel\"\n\n\
         [[steps.branches]]\nname = \"one\"\n[[steps.branches.steps]]\n{}\n\
         [steps.branches.steps.retry]\nmax_attempts = 1\n\n\
         [[steps.branches]]\nname = \"two\"\n[[steps.branches.steps]]\n{}\n\
         [steps.branches.steps.retry]\nmax_attempts = 1\n",
        task("hang1", 1000),
        task("hang2", 1000)
    );
    std::fs::write(dir.join("stalled.toml"), stalled).unwrap();
    let rescued = format!(
        "name = \"rescued\"\nversion = 1\n\n\
         [[steps]]\n{}catch = {{ next = \"apologize\" }}\n\n\
         [[steps]]\n{}end = true\n\n\
         [[steps]]\n{}input = \"/errors/broken\"\n",
        task("broken", 5000),
        task("ship", 5000),
        task("apologize", 5000)
    );
    std::fs::write(dir.join("rescued.toml"), rescued).unwrap();
    let undo = |name: &str| {
        format!("compensate = {{ name = \"{name}\", pool = \"p\", timeout_ms = 5000 }}\n")
    };
    let undone = format!(
        "name = \"undone\"\nversion = 1\n\n\
         [[steps]]\n{}{}\n\
         [[steps]]\nname = \"hold\"\nkind = \"parallel\"\ncatch = {{ compensate = true }}\n\n\
         [[steps.branches]]\nname = \"east\"\n[[steps.branches.steps]]\n{}{}\n\
         [[steps.branches]]\nname = \"west\"\n[[steps.branches.steps]]\n{}{}\n\
         [[steps]]\n{}catch = {{ compensate = true }}\n",
        task("charge", 5000),
        undo("refund"),
        task("hold_east", 5000),
        undo("release_east"),
        task("hold_west", 5000),
        undo("release_west"),
        task("sink", 5000)
    );
    std::fs::write(dir.join("undone.toml"), undone).unwrap();
    // Any kind in a branch: a choice that skips ahead in its branch, a
    // wait for a signal, a map over the run's items.
    let mixed = format!(
        "name = \"mixed\"\nversion = 1\n\n\
         [[steps]]\nname = \"all\"\nkind = \"parallel\"\n\n\
         [[steps.branches]]\nname = \"pick\"\n\
         [[steps.branches.steps]]\nname = \"route\"\nkind = \"choice\"\ndefault = \"slow_lane\"\n\
         choices = [{{ next = \"fast_lane\", when = {{ pointer = \"/input/order\", equals = 9 }} }}]\n\
         [[steps.branches.steps]]\n{}\n[[steps.branches.steps]]\n{}\n\
         [[steps.branches]]\nname = \"hold\"\n\
         [[steps.branches.steps]]\nname = \"nod\"\nkind = \"await_signal\"\nsignal = \"go\"\n\
         timeout_ms = 60000\n\n\
         [[steps.branches]]\nname = \"many\"\n\
         [[steps.branches.steps]]\nname = \"each\"\nkind = \"map\"\ninput = \"/input/items\"\n\
         [[steps.branches.steps.steps]]\n{}",
        task("slow_lane", 5000),
        task("fast_lane", 5000),
        task("wrap", 5000)
    );
    std::fs::write(dir.join("mixed.toml"), mixed).unwrap();
    std::fs::write(dir.join("fan.toml"), fan).unwrap();
    std::fs::write(dir.join("fragile.toml"), fragile).unwrap();
}

/// Answers each attempt with its step, branch and input; `broken` fails
/// for good, and `slow` is never answered.
async fn branch_worker(step: StepDispatch) -> StepOutcome {
    match step.step.as_str() {
        "broken" => StepOutcome::Failed {
            message: "out of stock".into(),
            retryable: false,
        },
        "sink" => StepOutcome::Failed {
            message: "no courier".into(),
            retryable: false,
        },
        "slow" | "hang1" | "hang2" => std::future::pending().await,
        "wrap" => StepOutcome::Succeeded(json!({ "wrapped": step.input, "item": step.item })),
        _ => StepOutcome::Succeeded(json!({
            "step": step.step, "branch": step.branch, "input": step.input,
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn branches_join_a_failed_one_cancels_the_rest_a_map_keeps_its_order_a_catch_goes_on_and_a_compensation_undoes()
 {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    let dir = tempfile::tempdir().unwrap();
    parallel_workflows(dir.path());
    config.coordinator.workflows_dir = PathBuf::from(dir.path());
    config.kafka.step_pools = vec!["p".into()];
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let shutdown = CancellationToken::new();
    let serve = tokio::spawn(ductor::cli::serve::run(config.clone(), shutdown.clone()));
    let options = ductor::client::worker::WorkerOptions::from_config(&config, "p");
    let worker = tokio::spawn(ductor::client::worker::run(
        options,
        branch_worker,
        CancellationToken::new(),
    ));
    let p = producer();
    let (fan, fragile, pack, stalled, rescued, undone) = (
        common::unique("fan"),
        common::unique("fragile"),
        common::unique("pack"),
        common::unique("stalled"),
        common::unique("rescued"),
        common::unique("undone"),
    );
    let mixed = common::unique("mixed");
    let runs = [
        (&fan, "fan"),
        (&fragile, "fragile"),
        (&pack, "pack"),
        (&stalled, "stalled"),
        (&rescued, "rescued"),
        (&undone, "undone"),
        (&mixed, "mixed"),
    ];
    for (run_id, workflow) in runs {
        let start = json!({
            "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": "acme",
            "workflow": workflow, "input": {"order": 9, "items": ["cup", "pot", "tray"]},
        });
        let topic = config.topic_names().requests();
        produce(&p, &topic, run_id, start.to_string().as_bytes(), &[]).await;
    }

    let (status, state) = finished(&db, &fan).await;
    assert_eq!(status, "succeeded", "{state}");
    assert_eq!(state["v"], ductor::coordinator::STATE_VERSION);
    assert!(state.get("lanes").is_none(), "{state}");
    // Both branches were dispatched by the start, each under its own
    // stamp and step key; ship came last, outside any branch.
    let sent: Vec<(i64, String, Option<String>, String)> = sqlx::query_as(
        "SELECT seq, convert_from(payload, 'UTF8')::jsonb->>'step', \
                convert_from(payload, 'UTF8')::jsonb->>'branch', \
                convert_from(payload, 'UTF8')::jsonb->>'step_key' \
         FROM eec_effect_intent WHERE run_id = $1 AND ce_type = 'ductor.step.dispatch' \
         ORDER BY seq, effect_index",
    )
    .bind(&fan)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let first: Vec<_> = sent
        .iter()
        .filter(|d| d.0 == 1)
        .map(|d| (d.1.as_str(), d.2.as_deref(), d.3.clone()))
        .collect();
    assert_eq!(
        first,
        [
            ("east1", Some("east"), format!("{fan}/step/2")),
            ("west1", Some("west"), format!("{fan}/step/4")),
        ]
    );
    let last = sent.last().unwrap();
    assert_eq!((last.1.as_str(), last.2.as_deref()), ("ship", None));
    let stamps: std::collections::HashSet<uuid::Uuid> =
        sqlx::query_scalar("SELECT stamp FROM run_attempts WHERE run_id = $1")
            .bind(&fan)
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(stamps.len(), 4, "four attempts, four stamps");
    // ship got the branches' results by name; east2 got east1's.
    let outputs = step_outputs(&db, &fan).await;
    let ship = &outputs.last().unwrap().1;
    assert_eq!(ship["step"], "ship");
    let joined = &ship["input"];
    assert_eq!(joined["west"]["input"]["order"], 9, "{joined}");
    assert_eq!(joined["east"]["step"], "east2", "{joined}");
    assert_eq!(joined["east"]["input"]["step"], "east1", "{joined}");

    let (status, state) = finished(&db, &fragile).await;
    assert_eq!(status, "failed", "{state}");
    let error = state["error"].as_str().unwrap();
    assert!(
        error.starts_with("branch_failed: branch \"bad\""),
        "{error}"
    );
    let detail: Value = sqlx::query_scalar(
        "SELECT detail FROM run_transitions WHERE run_id = $1 AND to_status = 'failed'",
    )
    .bind(&fragile)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(detail["cause"], "branch_failed");
    assert_eq!(detail["branch_cause"], "not_retryable");
    let attempts: Vec<(String, String)> = sqlx::query_as(
        "SELECT status, coalesce(error, '') FROM run_attempts WHERE run_id = $1 ORDER BY step_index",
    )
    .bind(&fragile)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(
        attempts[0].0, "cancelled",
        "slow's attempt ends with the step"
    );
    assert!(attempts[0].1.starts_with("branch_failed"), "{attempts:?}");
    assert_eq!(attempts[1].0, "failed");

    // The map wrapped each item, its results in item order, each item's
    // attempt keyed apart.
    let (status, state) = finished(&db, &pack).await;
    assert_eq!(status, "succeeded", "{state}");
    let ship = step_outputs(&db, &pack).await.pop().unwrap().1;
    assert_eq!(
        ship["input"],
        json!([
            {"wrapped": "cup", "item": 0},
            {"wrapped": "pot", "item": 1},
            {"wrapped": "tray", "item": 2},
        ])
    );
    let keys: Vec<String> = dispatched(&db, &pack)
        .await
        .into_iter()
        .filter(|(step, _)| step == "wrap")
        .map(|(_, key)| key)
        .collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        (0..3)
            .map(|k| format!("{pack}/step/2/item/{k}"))
            .collect::<Vec<_>>()
    );
    let first: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM eec_effect_intent WHERE run_id = $1 AND seq = 1 \
         AND ce_type = 'ductor.step.dispatch'",
    )
    .bind(&pack)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(first, 2, "two items at once (max_concurrency)");

    // Both branches' timeout timers, committed by one transition, fire:
    // the first fails the step and cancels the other attempt.
    let (status, state) = finished(&db, &stalled).await;
    assert_eq!(status, "failed", "{state}");
    let detail: Value = sqlx::query_scalar(
        "SELECT detail FROM run_transitions WHERE run_id = $1 AND to_status = 'failed'",
    )
    .bind(&stalled)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(detail["branch_cause"], "attempts_exhausted", "{detail}");
    assert_eq!(detail["cancelled_stamps"].as_array().map(Vec::len), Some(1));

    // broken fails for good: its catch takes the run on to apologize,
    // which reads the error, and the run succeeds.
    let (status, state) = finished(&db, &rescued).await;
    assert_eq!(status, "succeeded", "{state}");
    let kinds: Vec<String> =
        sqlx::query_scalar("SELECT kind FROM run_transitions WHERE run_id = $1 ORDER BY seq")
            .bind(&rescued)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(kinds, ["run.started", "step.caught", "run.succeeded"]);
    let apologized = step_outputs(&db, &rescued).await.pop().unwrap().1;
    assert_eq!(apologized["step"], "apologize");
    let error = &apologized["input"];
    assert_eq!(
        (&error["step"], &error["cause"]),
        (&json!("broken"), &json!("not_retryable"))
    );
    assert!(
        error["error"].as_str().unwrap().ends_with("out of stock"),
        "{error}"
    );
    assert_eq!(state["results"]["errors"]["broken"], *error);

    // sink fails for good after the charge and both holds: the holds are
    // released, newest first, then the charge refunded, each with the
    // output of the step it undoes under that step's key; the run fails
    // compensated.
    let (status, state) = finished(&db, &undone).await;
    assert_eq!(status, "failed", "{state}");
    let undos: Vec<(String, String, Value)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8')::jsonb->>'step', \
                convert_from(payload, 'UTF8')::jsonb->>'step_key', \
                convert_from(payload, 'UTF8')::jsonb->'input' \
         FROM eec_effect_intent WHERE run_id = $1 AND ce_type = 'ductor.step.dispatch' \
         ORDER BY seq, effect_index",
    )
    .bind(&undone)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let names: Vec<&str> = undos.iter().map(|u| u.0.as_str()).collect();
    assert_eq!(names.len(), 7, "{names:?}");
    assert_eq!(names[..4], ["charge", "hold_east", "hold_west", "sink"]);
    // The branch that answered last is released first.
    let held_last = step_outputs(&db, &undone)
        .await
        .into_iter()
        .filter_map(|(_, o)| o["branch"].as_str().map(str::to_owned))
        .next_back()
        .unwrap();
    let first_release = format!("release_{held_last}");
    assert_eq!(names[4], first_release, "{names:?}");
    assert_eq!(names[6], "refund");
    let (_, key, input) = &undos[6];
    assert_eq!(key, &format!("{undone}/step/0/compensate"));
    assert_eq!(input["step"], "charge", "{input}");
    let (_, key, input) = &undos[4];
    let held = if held_last == "east" { 3 } else { 4 };
    assert_eq!(key, &format!("{undone}/step/{held}/compensate"));
    assert_eq!(input["branch"], held_last.as_str(), "{input}");
    let detail: Value = sqlx::query_scalar(
        "SELECT detail FROM run_transitions WHERE run_id = $1 AND to_status = 'failed'",
    )
    .bind(&undone)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (&detail["cause"], &detail["compensated_cause"]),
        (&json!("compensated"), &json!("not_retryable")),
        "{detail}"
    );
    assert!(state.get("compensable").is_none(), "{state}");

    // Any kind in a branch: the choice skipped the slow lane, the wait
    // took its signal, the map wrapped each item.
    eventually("mixed started", DONE, || async {
        sqlx::query_scalar::<_, String>("SELECT run_id FROM runs WHERE run_id = $1")
            .bind(&mixed)
            .fetch_optional(&db.pool)
            .await
            .unwrap()
    })
    .await;
    let go = json!({
        "type": "wakeup.signal", "schema_version": 1, "run_id": mixed, "tenant": "acme",
        "signal_id": "go-1", "name": "go", "payload": {"ok": true},
    });
    let wakeups = config.topic_names().wakeups();
    produce(&p, &wakeups, &mixed, go.to_string().as_bytes(), &[]).await;
    let (status, state) = finished(&db, &mixed).await;
    assert_eq!(status, "succeeded", "{state}");
    let out = &state["output"];
    assert_eq!(out["pick"]["step"], "fast_lane", "{out}");
    assert_eq!(out["hold"]["nod"]["signal_id"], "go-1", "{out}");
    assert_eq!(out["hold"]["nod"]["payload"], json!({"ok": true}), "{out}");
    let wrapped: Vec<&Value> = out["many"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| &w["wrapped"])
        .collect();
    assert_eq!(
        wrapped,
        [&json!("cup"), &json!("pot"), &json!("tray")],
        "{out}"
    );
    let lanes: Vec<String> = sqlx::query_scalar(
        "SELECT convert_from(payload, 'UTF8')::jsonb->>'step' FROM eec_effect_intent \
         WHERE run_id = $1 AND ce_type = 'ductor.step.dispatch' ORDER BY seq, effect_index",
    )
    .bind(&mixed)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(!lanes.contains(&"slow_lane".to_owned()), "{lanes:?}");

    shutdown.cancel();
    serve.await.unwrap().unwrap();
    worker.abort();
    db.drop_db().await;
}

/// One file per rule of `ductor workflows check`, and a good one first:
/// its name, its text, and what its line must say.
fn one_file_per_rule() -> Vec<(&'static str, String, &'static str)> {
    let task = |name: &str, extra: &str| {
        format!("[[steps]]\nname = \"{name}\"\npool = \"p\"\ntimeout_ms = 1000\n{extra}\n")
    };
    let head = |name: &str| format!("name = \"{name}\"\nversion = 1\n");
    vec![
        (
            "good",
            head("good") + &task("a", "") + &task("b", "input = \"/steps/a\""),
            "ok",
        ),
        ("syntax", "name = ".to_owned(), "[syntax]"),
        (
            "unknown",
            head("unknown") + &task("a", "colour = \"red\""),
            "[unknown_field]",
        ),
        (
            "invalid",
            head("invalid") + &task("a", "").replace("1000", "0"),
            "[invalid]",
        ),
        (
            "other_kind",
            head("other_kind") + &task("a", "duration_ms = 5"),
            "[field_of_other_kind]",
        ),
        (
            "twice",
            head("twice") + &task("a", "") + &task("a", ""),
            "[duplicate_step]",
        ),
        (
            "ahead",
            head("ahead") + &task("a", "input = \"/steps/b\"") + &task("b", ""),
            "[unresolvable_pointer]",
        ),
        (
            "into_input",
            head("into_input") + &task("a", "result = \"/input/x\""),
            "[result_path]",
        ),
        (
            "again",
            head("good") + &task("a", ""),
            "[duplicate_version]",
        ),
        (
            "nowhere",
            head("nowhere") + &task("a", "next = \"zz\""),
            "[unknown_step]",
        ),
        (
            "island",
            head("island") + &task("a", "end = true") + &task("b", ""),
            "[unreachable_step]",
        ),
        (
            "unbounded",
            head("unbounded") + &task("a", "next = \"a\""),
            "[unbounded_back_edge]",
        ),
        (
            "circle",
            head("circle") + &task("a", "next = \"a\"\nmax_visits = 2"),
            "[no_end]",
        ),
        (
            "in_branch",
            head("in_branch")
                + "[[steps]]\nname = \"p\"\nkind = \"parallel\"\n\
                   branches = [{ name = \"b\", steps = [{ name = \"w\", pool = \"p\", \
                   timeout_ms = 1000, next = \"w\" }] }]\n",
            "[not_in_branch]",
        ),
        ("deep", head("deep") + &nested(4), "[too_deep]"),
        (
            "undo_more",
            head("undo_more")
                + &task(
                    "a",
                    "compensate = { name = \"u\", pool = \"p\", timeout_ms = 1000, next = \"a\" }",
                ),
            "[not_in_compensation]",
        ),
        (
            "orphan",
            head("orphan")
                + "[[steps]]\nname = \"c\"\nkind = \"child\"\nworkflow = \"nobody\"\ntimeout_ms = 1000\n",
            "[unknown_workflow]",
        ),
        (
            "itself",
            head("itself")
                + "[[steps]]\nname = \"c\"\nkind = \"child\"\nworkflow = \"itself\"\ntimeout_ms = 1000\n",
            "[child_cycle]",
        ),
    ]
}

/// A parallel step with a parallel step in its branch, `depth` deep, a
/// task at the bottom.
fn nested(depth: u32) -> String {
    let mut step = "{ name = \"leaf\", pool = \"p\", timeout_ms = 1000 }".to_owned();
    for d in 1..depth {
        step = format!(
            "{{ name = \"p{d}\", kind = \"parallel\", branches = [{{ name = \"b\", steps = [{step}] }}] }}"
        );
    }
    format!(
        "[[steps]]\nname = \"p{depth}\"\nkind = \"parallel\"\n\
         branches = [{{ name = \"b\", steps = [{step}] }}]\n"
    )
}

/// One malformed definition per rule, each refused by the binary with it;
/// a good file beside them passes, and the status says that one was not.
#[test]
fn workflows_check_refuses_each_malformed_definition_with_its_rule() {
    let dir = tempfile::tempdir().unwrap();
    let files = one_file_per_rule();
    let mut paths = Vec::new();
    for (name, text, _) in &files {
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).unwrap();
        paths.push(path);
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ductor"))
        .args(["workflows", "check"])
        .args(&paths)
        .output()
        .expect("running ductor workflows check");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), files.len(), "{stdout}");
    for ((name, _, expected), line) in files.iter().zip(&lines) {
        assert!(line.contains(&format!("{name}.toml")), "{line}");
        if *expected == "ok" {
            assert!(line.starts_with("ok "), "{line}");
        } else {
            assert!(line.starts_with("refused "), "{line}");
            assert!(line.contains(expected), "{name}: {line}");
        }
    }
    // The step is named where the refusal is about one.
    assert!(lines[6].contains("step \"a\""), "{}", lines[6]);
    assert!(
        stderr.contains("17 of 18 workflow files refused"),
        "{stderr}"
    );

    // Every file good: status 0.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ductor"))
        .args(["workflows", "check", "config/workflows/order.toml"])
        .arg(&paths[0])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// `parcel`: `prepare`, then `ship`, a child run of `label` (its task
/// `print`), then `notify`. `waiting`: a child run of `stuck`, whose task
/// is never answered. `doomed`: a child run of `spoiled`, whose task fails
/// for good, and no retry.
fn child_workflows(dir: &Path) {
    let task =
        |name: &str| format!("[[steps]]\nname = \"{name}\"\npool = \"p\"\ntimeout_ms = 5000\n");
    let child = |name: &str, workflow: &str, extra: &str| {
        format!(
            "[[steps]]\nname = \"{name}\"\nkind = \"child\"\nworkflow = \"{workflow}\"\n\
             timeout_ms = 60000\n{extra}"
        )
    };
    let files = [
        (
            "label",
            format!("name = \"label\"\nversion = 1\n\n{}", task("print")),
        ),
        (
            "stuck",
            format!("name = \"stuck\"\nversion = 1\n\n{}", task("slow")),
        ),
        (
            "spoiled",
            format!("name = \"spoiled\"\nversion = 1\n\n{}", task("broken")),
        ),
        (
            "parcel",
            format!(
                "name = \"parcel\"\nversion = 1\n\n{}\n{}\n{}",
                task("prepare"),
                child("ship", "label", ""),
                task("notify")
            ),
        ),
        (
            "waiting",
            format!(
                "name = \"waiting\"\nversion = 1\n\n{}",
                child("wait", "stuck", "")
            ),
        ),
        (
            "doomed",
            format!(
                "name = \"doomed\"\nversion = 1\n\n{}",
                child("try", "spoiled", "retry = { max_attempts = 1 }\n")
            ),
        ),
    ];
    for (name, text) in files {
        std::fs::write(dir.join(format!("{name}.toml")), text).unwrap();
    }
}

/// The child run a parent started, once it exists: its id and state.
async fn child_of(db: &TestDb, parent: &str) -> (String, Value) {
    eventually(&format!("a child of {parent}"), DONE, || async {
        sqlx::query_as("SELECT run_id, state FROM runs WHERE state->'parent'->>'run_id' = $1")
            .bind(parent)
            .fetch_optional(&db.pool)
            .await
            .unwrap()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_child_run_answers_its_step_and_a_cancelled_parent_cancels_it() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    let dir = tempfile::tempdir().unwrap();
    child_workflows(dir.path());
    config.coordinator.workflows_dir = PathBuf::from(dir.path());
    config.kafka.step_pools = vec!["p".into()];
    // Child runs' starts and answers then pass only with serve's own
    // signature.
    config.signatures.timer_key = Some(ductor::config::SigningKey(
        "serve-timer-key-for-children".into(),
    ));
    ductor::infra::kafka::create_configured_topics(&config)
        .await
        .expect("creating topics");
    let shutdown = CancellationToken::new();
    let serve = tokio::spawn(ductor::cli::serve::run(config.clone(), shutdown.clone()));
    let options = ductor::client::worker::WorkerOptions::from_config(&config, "p");
    let worker = tokio::spawn(ductor::client::worker::run(
        options,
        branch_worker,
        CancellationToken::new(),
    ));
    let p = producer();
    let (parcel, waiting, doomed) = (
        common::unique("parcel"),
        common::unique("waiting"),
        common::unique("doomed"),
    );
    for (run_id, workflow) in [
        (&parcel, "parcel"),
        (&waiting, "waiting"),
        (&doomed, "doomed"),
    ] {
        let start = json!({
            "type": "run.start", "schema_version": 1, "run_id": run_id, "tenant": "acme",
            "workflow": workflow, "input": {"order": 9},
        });
        let topic = config.topic_names().requests();
        produce(&p, &topic, run_id, start.to_string().as_bytes(), &[]).await;
    }

    // The parcel's child ran `label` with the output of `prepare`, and
    // its output is the step's.
    let (status, state) = finished(&db, &parcel).await;
    assert_eq!(status, "succeeded", "{state}");
    let (child, child_state) = child_of(&db, &parcel).await;
    assert_eq!(child_state["workflow"], "label");
    assert_eq!(child_state["status"], "succeeded");
    let outputs = step_outputs(&db, &parcel).await;
    assert_eq!(outputs[1].0, 1, "{outputs:?}");
    assert_eq!(outputs[1].1, child_state["output"]);
    assert_eq!(outputs[1].1["step"], "print");
    assert_eq!(outputs[1].1["input"]["step"], "prepare");
    let ship_stamp: String = sqlx::query_scalar(
        "SELECT stamp::text FROM run_attempts WHERE run_id = $1 AND step_index = 1",
    )
    .bind(&parcel)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        child, ship_stamp,
        "the child is named by its attempt's stamp"
    );
    assert_eq!(child_state["parent"]["stamp"], ship_stamp.as_str());
    // Decided once by the routing plane, under the step's key.
    let decided: Vec<(String, String)> = sqlx::query_as(
        "SELECT idempotency_key, decision_id FROM eec_routing_idempotency \
         WHERE idempotency_key LIKE $1",
    )
    .bind(format!("{parcel}/%"))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        decided,
        [(format!("{parcel}/step/1/child/1"), child.clone())]
    );

    // A child that fails fails its step, and the parent with it.
    let (status, state) = finished(&db, &doomed).await;
    assert_eq!(status, "failed", "{state}");
    let error = state["error"].as_str().unwrap();
    assert!(error.contains("child run"), "{error}");
    assert!(error.contains("out of stock"), "{error}");

    // Cancelling the parent cancels its running child.
    let (stuck, _) = child_of(&db, &waiting).await;
    eventually("the stuck child dispatched", DONE, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM run_attempts WHERE run_id = $1")
            .bind(&stuck)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        (n > 0).then_some(())
    })
    .await;
    let cancel = json!({
        "type": "wakeup.cancel", "schema_version": 1, "run_id": waiting, "tenant": "acme",
    });
    let wakeups = config.topic_names().wakeups();
    produce(&p, &wakeups, &waiting, cancel.to_string().as_bytes(), &[]).await;
    let (status, _) = finished(&db, &waiting).await;
    assert_eq!(status, "cancelled");
    let (status, state) = finished(&db, &stuck).await;
    assert_eq!(status, "cancelled", "{state}");
    let reason: Option<String> = sqlx::query_scalar(
        "SELECT detail->>'reason' FROM run_transitions WHERE run_id = $1 AND to_status = 'cancelled'",
    )
    .bind(&stuck)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(reason.as_deref(), Some("its parent no longer waits for it"));

    shutdown.cancel();
    serve.await.unwrap().unwrap();
    worker.abort();
    db.drop_db().await;
}
