//! The hostile-input harness, quick: thousands of generated inputs that
//! Ductor must refuse, among good runs on the same partitions, through the
//! real Kafka ingress and the HTTP API. `DUCTOR_FUZZ_BAD_INPUTS` sets how
//! many (5,000 by default); the long run's figures go in the issue notes.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::*;
use ductor_chaos::fuzz::FuzzArgs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_inputs_are_all_refused_once_and_every_good_run_completes() {
    let db = TestDb::migrated().await;
    let mut config = test_config(&db);
    // Small limits, so that values past every limit are cheap to send.
    let c = &mut config.coordinator;
    c.max_input_bytes = 65_536;
    c.max_json_depth = 16;
    c.max_string_bytes = 1_024;
    c.max_array_items = 100;
    c.max_object_keys = 50;
    // A lane that holds a batch this long fails the run (`lane_stalled`).
    c.stall_after_ms = 10_000;
    let bad_inputs = std::env::var("DUCTOR_FUZZ_BAD_INPUTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(5_000);
    let args = FuzzArgs {
        bad_inputs,
        good_runs: (bad_inputs / 50).max(20),
        http_every: 10,
        seed: 1,
        rss_bound_mb: 1024.0,
        settle_timeout_s: 300,
        serve_bin: Some(common::ductor_bin()),
    };
    let report = ductor_chaos::fuzz::run(&config, &args)
        .await
        .expect("the harness runs to the end");
    println!("{}", report.json_line());
    assert!(report.ok(), "{}", report.json_line());
    assert_eq!(report.bad_inputs, bad_inputs);
    assert_eq!(
        report.dead_lettered + report.http_4xx,
        bad_inputs,
        "every hostile input was refused once"
    );
    assert!(report.http_4xx > 0 && report.dead_lettered > 0);
    assert!(report.classes.len() > 8, "{:?}", report.classes);
    assert!(report.garbage_runs > 0 && report.hostile_results > report.good_runs);
    assert!(report.hostile_retries > 0, "{}", report.json_line());
    assert!(
        report.retries_applied > 0 && report.retries_dead_lettered > 0,
        "{}",
        report.json_line()
    );
    db.drop_db().await;
}
