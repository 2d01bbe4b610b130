//! A serve SIGKILLed in the middle of a healthy workload and restarted at
//! once costs the runs a pause, never a failure: the restart measurement
//! of `ductor-chaos restart`, small. Its full-size figures go in the issue
//! notes.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::*;
use ductor_chaos::restart::RestartArgs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serve_killed_and_restarted_mid_load_fails_no_run() {
    let db = TestDb::migrated().await;
    let config = test_config(&db);
    let args = RestartArgs {
        runs: 400,
        rate: 100.0,
        kill_after_s: 2.0,
        steps: 2,
        step_timeout_ms: 2_000,
        dynamic_membership: false,
        settle_timeout_s: 120,
        serve_bin: Some(common::ductor_bin()),
    };
    let report = ductor_chaos::restart::run(&config, &args)
        .await
        .expect("the measurement runs to the end");
    println!("{}", report.json_line());
    assert!(report.ok(), "{}", report.json_line());
    assert_eq!(report.succeeded, 400);
    assert!(
        report.first_completion_after_kill_ms >= 0,
        "runs went on after the kill"
    );
    db.drop_db().await;
}
