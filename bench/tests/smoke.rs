//! A smoke run of `ductor-bench --quick` through the library: every phase
//! runs end to end against the real stack and reports positive figures.
//! Timings are never asserted; the quick figures are not measurements.

#[path = "../../tests/common/mod.rs"]
mod common;

use ductor::config::Config;
use ductor_bench::{BenchArgs, Report};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// Every number in `value`, with its path, except inside `profile` objects
/// (diagnostics that may legitimately be zero), the CPU per input and at
/// rest (a quick phase is shorter than a few clock ticks of some processes).
fn figures(path: &str, value: &Value, out: &mut Vec<(String, f64)>) {
    match value {
        Value::Number(n) => out.push((path.to_string(), n.as_f64().unwrap_or(f64::NAN))),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                figures(&format!("{path}[{i}]"), item, out);
            }
        }
        Value::Object(map) => {
            for (key, item) in map {
                if !["profile", "cpu_us_per_input", "idle_cpu"].contains(&key.as_str()) {
                    figures(&format!("{path}.{key}"), item, out);
                }
            }
        }
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_bench_reports_every_figure_positive() {
    let config = Config::load_from(
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
    .expect("default configuration is valid");
    let args = BenchArgs {
        runs: 30,
        duration_s: 0.5,
        quick: true,
        ..BenchArgs::default()
    };
    let report: Report = ductor_bench::run(&args, &config, &CancellationToken::new())
        .await
        .expect("the quick bench runs to the end");

    let line = report.json_line();
    assert!(!line.contains('\n'), "the JSON report is one line");
    let json: Value = serde_json::from_str(&line).expect("the report is JSON");
    every_part_is_reported(&json, &line);
    idle_is_reported(&json, &report.table());
    cpu_per_input_is_reported(&json);
    the_floor_and_the_lean_baseline_are_reported(&json);
    let mut all = Vec::new();
    figures("", &json, &mut all);
    assert!(all.len() > 30, "expected many figures, got {}", all.len());
    for (path, value) in &all {
        assert!(
            value.is_finite() && *value > 0.0,
            "{path} = {value} is not positive in {line}"
        );
    }
    assert!(
        report.table().contains("capacity/L") && report.table().contains("L_lean"),
        "the table shows the ratios"
    );
    assert!(
        report.peak_rss_mb > 1.0,
        "the serve's peak RSS is reported: {}",
        report.peak_rss_mb
    );
}

/// The idle phase ran its quick run's five runs, one at a time, and shows
/// in the JSON line and the table.
fn idle_is_reported(json: &Value, table: &str) {
    let idle = &json["idle"];
    assert_eq!(idle["runs"], 5, "a quick run's idle phase: {idle}");
    assert!(
        idle["p50_ms"].as_f64() <= idle["max_ms"].as_f64(),
        "the idle phase's quantiles are ordered: {idle}"
    );
    assert!(
        table.contains("idle (one run at a time"),
        "the table shows the idle phase"
    );
}

/// The CPU per input at capacity and at 50 %, by process group.
fn cpu_per_input_is_reported(json: &Value) {
    let cpu = &json["ratios"]["cpu_us_per_input"];
    for at in ["at_capacity", "at_50pct"] {
        for group in ["ductor", "postgres", "kafka", "total"] {
            assert!(
                cpu[at][group].as_f64().is_some_and(|us| us >= 0.0),
                "cpu_us_per_input.{at}.{group} is reported: {cpu}"
            );
        }
    }
    assert!(
        cpu["at_capacity"]["total"]
            .as_f64()
            .is_some_and(|us| us > 0.0),
        "the capacity window used CPU: {cpu}"
    );
}

/// One round against the hop floor at 25 and 50 % and at idle, the idle
/// CPU, and the lean baseline's batch size.
fn the_floor_and_the_lean_baseline_are_reported(json: &Value) {
    let rounds = &json["vs_floor"]["rounds"];
    assert_eq!(
        rounds.as_array().map(Vec::len),
        Some(1),
        "a quick run compares one round with the floor: {rounds}"
    );
    assert_eq!(
        rounds[0]["floor"].as_array().map(Vec::len),
        Some(2),
        "the floor is measured at 25 and 50 %: {rounds}"
    );
    assert_eq!(rounds[0]["floor_idle"]["runs"], 5, "the floor's idle runs");
    assert!(
        json["idle_cpu"]["cores"]["ductor"].as_f64().is_some(),
        "the idle CPU is reported: {}",
        json["idle_cpu"]
    );
    assert_eq!(
        json["b1_lean"]["k"], 100,
        "the lean baseline applies 100 inputs per transaction: {}",
        json["b1_lean"]
    );
}

/// Every phase, baseline and ratio has its key.
fn every_part_is_reported(json: &Value, line: &str) {
    for key in [
        "capacity",
        "capacity_sync_off",
        "latency",
        "idle",
        "b1a",
        "b1b",
        "b1_lean",
        "b2",
        "limit_inputs_per_s",
        "limit_lean_inputs_per_s",
        "vs_floor",
        "idle_cpu",
        "ratios",
        "peak_rss_mb",
    ] {
        assert!(json.get(key).is_some(), "the report has {key}: {line}");
    }
    assert_eq!(json["latency"].as_array().map(Vec::len), Some(4));
    for ratio in [
        "capacity_over_l",
        "capacity_over_l_lean",
        "p50_over_floor_at_25pct",
        "p99_over_floor_at_25pct",
        "p50_over_floor_at_50pct",
        "p99_over_floor_at_50pct",
        "idle_p50_over_floor",
        "capacity_over_b1b",
        "capacity_over_b1a",
        "sync_on_over_off",
        "p99_ms_at_50pct",
    ] {
        assert!(json["ratios"].get(ratio).is_some(), "ratio {ratio} missing");
    }
}
