//! Property tests of the pure coordinator: a simulated world of workers and timers
//! drives runs to completion, then the same inputs are re-delivered duplicated,
//! interleaved across runs and mixed with nonsense, and the outcomes are compared.
//! The simulated workflows are straight lines of tasks, sleeps and waits, some of
//! them selecting their data by pointer, some looping back through a choice.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use ductor::contract::*;
use ductor::coordinator::*;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use uuid::Uuid;

const CASES: u32 = 256;
/// A state cap the simulated runs stay far below.
const STATE_CAP: usize = 1 << 20;

// ---- the simulated world ---------------------------------------------------------

/// What the worker does with one dispatched attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Behaviour {
    Succeed,
    FailRetryable,
    FailPermanent,
    /// Never answers: the timeout timer fires.
    NoAnswer,
    /// Answers after the timeout fired: a stale result.
    LateSucceed,
    LateFail,
}

/// One step of a simulated workflow.
#[derive(Debug, Clone, Copy, PartialEq)]
enum StepSpec {
    /// A task: (timeout_ms, max_attempts).
    Task(u64, u32),
    /// A sleep of this many ms.
    Sleep(u64),
    /// A wait for the signal `poke` of at most this many ms, failing the
    /// run when it times out unless `true` (go on).
    Await(u64, bool),
    /// A child run of the workflow `kid`, simulated as a worker answers a
    /// task: (timeout_ms, max_attempts).
    Child(u64, u32),
}

fn step_spec() -> impl Strategy<Value = StepSpec> {
    prop_oneof![
        4 => (1_000u64..5_000, 1u32..=4).prop_map(|(t, a)| StepSpec::Task(t, a)),
        1 => (1u64..8_000).prop_map(StepSpec::Sleep),
        2 => (1_000u64..20_000, any::<bool>()).prop_map(|(t, c)| StepSpec::Await(t, c)),
        1 => (1_000u64..5_000, 1u32..=4).prop_map(|(t, a)| StepSpec::Child(t, a)),
    ]
}

#[derive(Debug, Clone)]
struct Scenario {
    steps: Vec<StepSpec>,
    output_topic: bool,
    /// Behaviour of the n-th dispatched attempt; attempts past the end succeed.
    script: Vec<Behaviour>,
    /// (signal id index, delivery time in ms); ids repeat on purpose.
    signals: Vec<(u8, i64)>,
    cancel_at: Option<i64>,
    /// (action id index, delay in ms) of the retries sent after each
    /// failure of the run, naming it; ids repeat on purpose, so that a run
    /// is retried at most three times.
    retries: Vec<(u8, i64)>,
    /// Whether the workflow moves data by selection: every other step
    /// takes the run's input (`/input`), the others the whole document,
    /// and the run ends with the first step's result (`/steps/step0`).
    selects: bool,
    /// Whether the workflow loops (with two steps or more): a choice after
    /// the first step goes back to it while its result names its first
    /// attempt, so the first step runs once or twice.
    loops: bool,
    /// Whether the workflow ends with a parallel step, and what a failed
    /// branch does: branch `a` runs a task and a sleep, `b` a task. With
    /// `map`, a map of that task and sleep over the input's three items,
    /// two at once, instead.
    parallel: Option<OnFailure>,
    map: bool,
    /// Whether that parallel step or map catches its failure: the run then
    /// goes on at a last step, `rescue`.
    catches: bool,
    /// Whether every task step names a compensation (`undo_<step>`), and
    /// the last step (or, with `catches`, the parallel step or map)
    /// compensates its failure instead.
    compensates: bool,
    /// Whether branch `b` answers at once and branch `a` just before its
    /// deadline, rather than each half-way to its deadline.
    b_first: bool,
}

impl Scenario {
    fn loops(&self) -> bool {
        self.loops && self.steps.len() >= 2
    }
}

fn behaviour() -> impl Strategy<Value = Behaviour> {
    prop_oneof![
        4 => Just(Behaviour::Succeed),
        2 => Just(Behaviour::FailRetryable),
        1 => Just(Behaviour::FailPermanent),
        1 => Just(Behaviour::NoAnswer),
        1 => Just(Behaviour::LateSucceed),
        1 => Just(Behaviour::LateFail),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop::collection::vec(step_spec(), 1..=4),
        any::<bool>(),
        prop::collection::vec(behaviour(), 0..12),
        prop::collection::vec((0u8..4, 0i64..30_000), 0..6),
        prop_oneof![3 => Just(None), 1 => (0i64..30_000).prop_map(Some)],
        prop_oneof![
            1 => Just(Vec::new()),
            1 => prop::collection::vec((0u8..3, 0i64..5_000), 1..4),
        ],
        any::<bool>(),
        any::<bool>(),
        (
            prop_oneof![
                2 => Just(None),
                1 => Just(Some(OnFailure::FailFast)),
                1 => Just(Some(OnFailure::AllSettled)),
            ],
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                steps,
                output_topic,
                script,
                signals,
                cancel_at,
                retries,
                selects,
                loops,
                (parallel, map, catches, compensates),
            )| {
                Scenario {
                    steps,
                    output_topic,
                    script,
                    signals,
                    cancel_at,
                    retries,
                    selects,
                    loops,
                    parallel,
                    map,
                    catches,
                    compensates,
                    b_first: false,
                }
            },
        )
}

/// The items of every run's input, which a map step maps over.
const ITEMS: [u32; 3] = [1, 2, 3];

fn definition(name: &str, scn: &Scenario) -> WorkflowDefinition {
    let mut def = straight(name, scn);
    if scn.loops() {
        let back = condition::Condition {
            pointer: Some("/steps/step0/attempt".into()),
            less: Some(2.0),
            ..condition::Condition::default()
        };
        let again = StepDefinition {
            max_visits: Some(3),
            ..StepDefinition::choice("again", vec![("step0", back)], "step1")
        };
        def.steps.insert(1, again);
    }
    if let Some(on_failure) = scn.parallel {
        let task = |name: &str, timeout_ms: u64, max_attempts: u32| StepDefinition {
            retry: RetryPolicy {
                max_attempts,
                ..RetryPolicy::default()
            },
            ..StepDefinition::task(name, "pool-fan", timeout_ms)
        };
        let a = vec![task("fa1", 2_000, 2), StepDefinition::sleep("fa2", 300)];
        let fan = if scn.map {
            StepDefinition {
                on_failure,
                input: Some("/input/items".into()),
                max_concurrency: Some(2),
                ..StepDefinition::map("fan", a)
            }
        } else {
            StepDefinition {
                on_failure,
                ..StepDefinition::parallel(
                    "fan",
                    vec![("a", a), ("b", vec![task("fb1", 1_500, 3)])],
                )
            }
        };
        if scn.catches && scn.compensates {
            def.steps.push(compensating(fan));
        } else if scn.catches {
            let fan = StepDefinition {
                end: true,
                catch: Some(Catch {
                    next: Some("rescue".into()),
                    result: None,
                    compensate: false,
                }),
                ..fan
            };
            def.steps.push(fan);
            def.steps.push(task("rescue", 1_000, 2));
        } else {
            def.steps.push(fan);
        }
    }
    if scn.compensates {
        undo_tasks(&mut def.steps);
        let last = def.steps.last_mut().unwrap();
        if last.catch.is_none() && last.kind == StepKind::Task {
            *last = compensating(last.clone());
        }
    }
    def
}

/// `step`, whose failure compensates the run.
fn compensating(step: StepDefinition) -> StepDefinition {
    StepDefinition {
        catch: Some(Catch {
            next: None,
            result: None,
            compensate: true,
        }),
        ..step
    }
}

/// Every task step in `steps` and in the branches and maps among them
/// gets a compensation: `undo_<step>`, two attempts.
fn undo_tasks(steps: &mut [StepDefinition]) {
    for step in steps {
        if step.kind == StepKind::Task {
            let undo = StepDefinition {
                retry: RetryPolicy {
                    max_attempts: 2,
                    ..RetryPolicy::default()
                },
                ..StepDefinition::task(&format!("undo_{}", step.name), "pool-undo", 1_000)
            };
            step.compensate = Some(Box::new(undo));
        }
        undo_tasks(&mut step.steps);
        for branch in &mut step.branches {
            undo_tasks(&mut branch.steps);
        }
    }
}

/// The workflow the child steps start: one task.
fn kid() -> WorkflowDefinition {
    WorkflowDefinition {
        name: "kid".into(),
        version: 1,
        steps: vec![StepDefinition::task("chore", "pool-kid", 1_000)],
        output_topic: None,
        output: None,
    }
}

/// The retry policy of a straight line's tasks and child steps.
fn straight_retry(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        initial_backoff_ms: 100,
        max_backoff_ms: 1_000,
        multiplier: 2.0,
        jitter: 0.2,
    }
}

fn straight(name: &str, scn: &Scenario) -> WorkflowDefinition {
    WorkflowDefinition {
        name: name.to_owned(),
        version: 1,
        steps: scn
            .steps
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let name = format!("step{i}");
                let step = match *spec {
                    StepSpec::Task(timeout_ms, max_attempts) => StepDefinition {
                        retry: straight_retry(max_attempts),
                        ..StepDefinition::task(&name, &format!("pool{}", i % 2), timeout_ms)
                    },
                    StepSpec::Sleep(ms) => StepDefinition::sleep(&name, ms),
                    StepSpec::Child(timeout_ms, max_attempts) => StepDefinition {
                        retry: straight_retry(max_attempts),
                        ..StepDefinition::child(&name, "kid", timeout_ms)
                    },
                    StepSpec::Await(timeout_ms, go_on) => {
                        let on_timeout = if go_on {
                            OnTimeout::Continue
                        } else {
                            OnTimeout::Fail
                        };
                        StepDefinition::await_signal(&name, "poke", timeout_ms, on_timeout)
                    }
                };
                let input = if i % 2 == 0 { "/input" } else { "" };
                StepDefinition {
                    input: scn.selects.then(|| input.to_owned()),
                    ..step
                }
            })
            .collect(),
        output_topic: scn.output_topic.then(|| "out.topic".to_owned()),
        output: scn.selects.then(|| "/steps/step0".to_owned()),
    }
}

fn t0() -> DateTime<Utc> {
    DateTime::from_timestamp_millis(1_700_000_000_000).unwrap()
}

fn at(ms: i64) -> DateTime<Utc> {
    t0() + chrono::TimeDelta::milliseconds(ms)
}

fn ms_of(t: DateTime<Utc>) -> i64 {
    (t - t0()).num_milliseconds()
}

/// FNV-1a over the run id and a seed; deterministic "randomness" per (run, seq).
fn hash(run_id: &str, seq: i64, seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in run_id.bytes().chain(seq.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    // final avalanche (splitmix64)
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The entropy of transition `seq` of `run_id`: a replay draws the same randomness.
fn entropy_for(run_id: &str, seq: i64) -> Entropy {
    let hi = hash(run_id, seq, 1);
    let lo = hash(run_id, seq, 2);
    Entropy {
        stamp: Uuid::from_u128((u128::from(hi) << 64) | u128::from(lo)),
        jitter_unit: (hash(run_id, seq, 3) >> 11) as f64 / (1u64 << 53) as f64,
    }
}

/// Folds with the entropy the next transition of this run would draw.
fn deliver(
    state: Option<&RunState>,
    input: &Input,
    wf: &Workflows,
    now: DateTime<Utc>,
) -> Decision {
    deliver_capped(state, input, wf, now, STATE_CAP)
}

/// [`deliver`] with a state cap of `cap` bytes.
fn deliver_capped(
    state: Option<&RunState>,
    input: &Input,
    wf: &Workflows,
    now: DateTime<Utc>,
    cap: usize,
) -> Decision {
    let seq = state.map_or(0, |s| s.last_transition_seq) + 1;
    fold(
        state,
        input,
        wf,
        cap,
        now,
        &entropy_for(input.run_id(), seq),
    )
}

#[derive(Debug, Clone)]
struct Delivery {
    input: Input,
    now: DateTime<Utc>,
}

#[derive(Debug, Clone)]
struct Outcome {
    applied: Vec<Delivery>,
    decisions: Vec<Decision>,
    state: Option<RunState>,
}

impl Outcome {
    fn transitions(&self) -> Vec<Transition> {
        transitions(&self.decisions)
    }
}

fn transitions(decisions: &[Decision]) -> Vec<Transition> {
    decisions
        .iter()
        .filter_map(|d| match d {
            Decision::Transition(t) => Some((**t).clone()),
            _ => None,
        })
        .collect()
}

fn result(run_id: &str, tenant: &str, stamp: Uuid, outcome: AttemptOutcome) -> Input {
    Input::Result(AttemptResult {
        run_id: run_id.to_owned(),
        tenant: tenant.to_owned(),
        stamp,
        outcome,
    })
}

fn failure(retryable: bool) -> AttemptOutcome {
    AttemptOutcome::Failed {
        message: "worker failed".to_owned(),
        retryable,
    }
}

/// Runs one scenario to completion, applying each input once. Timers are delivered
/// only once their effect exists (at `not_before`), results only for dispatched stamps.
fn simulate(scn: &Scenario, run_id: &str, tenant: &str, workflow: &str, wf: &Workflows) -> Outcome {
    simulate_capped(scn, run_id, tenant, workflow, wf, STATE_CAP)
}

/// [`simulate`] with a state cap of `cap` bytes.
fn simulate_capped(
    scn: &Scenario,
    run_id: &str,
    tenant: &str,
    workflow: &str,
    wf: &Workflows,
    cap: usize,
) -> Outcome {
    let mut queue: BTreeMap<(i64, u64), Input> = BTreeMap::new();
    let mut n = 0u64;
    let mut push = |queue: &mut BTreeMap<(i64, u64), Input>, ms: i64, input: Input| {
        n += 1;
        queue.insert((ms, n), input);
    };
    push(
        &mut queue,
        0,
        Input::Start(RunStart {
            run_id: run_id.to_owned(),
            tenant: tenant.to_owned(),
            workflow: workflow.to_owned(),
            workflow_version: None,
            pool: "default".to_owned(),
            input: json!({"order": run_id, "items": ITEMS}),
            correlation_id: None,
            parent: None,
        }),
    );
    for &(id, ms) in &scn.signals {
        let signal = Input::Signal(SignalWakeup {
            run_id: run_id.to_owned(),
            tenant: tenant.to_owned(),
            signal_id: format!("sig-{id}"),
            name: "poke".to_owned(),
            // A signal id means one payload: reusing it with another is
            // refused, which `a_reused_key_with_another_meaning_changes_nothing`
            // covers.
            payload: json!({"sig": id}),
        });
        push(&mut queue, ms, signal);
    }
    if let Some(ms) = scn.cancel_at {
        let cancel = Input::Cancel(CancelWakeup {
            run_id: run_id.to_owned(),
            tenant: tenant.to_owned(),
            reason: Some("test".to_owned()),
            action_id: None,
        });
        push(&mut queue, ms, cancel);
    }
    let retry = |id: u8, failed_seq: i64| {
        Input::Retry(RetryWakeup {
            run_id: run_id.to_owned(),
            tenant: tenant.to_owned(),
            action_id: format!("retry-{id}"),
            failed_seq,
            reason: None,
        })
    };
    let mut out = Outcome {
        applied: Vec::new(),
        decisions: Vec::new(),
        state: None,
    };
    let mut dispatched = 0usize;
    while let Some(((ms, _), input)) = queue.pop_first() {
        assert!(out.applied.len() < 10_000, "simulation does not terminate");
        let now = at(ms);
        let decision = deliver_capped(out.state.as_ref(), &input, wf, now, cap);
        if let Decision::Transition(tr) = &decision {
            assert_eq!(tr.effects[0].target, EffectTarget::Events);
            for effect in &tr.effects[1..] {
                match &effect.target {
                    EffectTarget::StepQueue { .. } | EffectTarget::Requests { .. }
                        if effect.kind != EffectKind::ChildCancel =>
                    {
                        let p = &dispatch_of(effect, &tr.state);
                        let stamp = Uuid::parse_str(p["stamp"].as_str().unwrap()).unwrap();
                        let deadline =
                            DateTime::parse_from_rfc3339(p["deadline"].as_str().unwrap()).unwrap();
                        let deadline_ms = ms_of(deadline.with_timezone(&Utc));
                        // A map's first item answers as branch `a`, the others as `b`.
                        let lane = match (p["branch"].as_str(), p["item"].as_u64()) {
                            (Some(branch), _) => Some(branch == "a"),
                            (None, Some(item)) => Some(item == 0),
                            (None, None) => None,
                        };
                        let soon = match (lane, scn.b_first) {
                            (Some(false), true) | (Some(true), false) => ms + 1,
                            (Some(_), _) => deadline_ms - 1,
                            (None, _) => (ms + deadline_ms) / 2,
                        };
                        let output = json!({"step": p["step_index"], "attempt": p["attempt"]});
                        let behaviour = scn
                            .script
                            .get(dispatched)
                            .copied()
                            .unwrap_or(Behaviour::Succeed);
                        dispatched += 1;
                        let answer = match behaviour {
                            Behaviour::Succeed => {
                                Some((soon, AttemptOutcome::Succeeded { output }))
                            }
                            Behaviour::FailRetryable => Some((soon, failure(true))),
                            Behaviour::FailPermanent => Some((soon, failure(false))),
                            Behaviour::NoAnswer => None,
                            Behaviour::LateSucceed => {
                                Some((deadline_ms + 1, AttemptOutcome::Succeeded { output }))
                            }
                            Behaviour::LateFail => Some((deadline_ms + 1, failure(true))),
                        };
                        if let Some((when, outcome)) = answer {
                            push(&mut queue, when, result(run_id, tenant, stamp, outcome));
                        }
                    }
                    EffectTarget::Wakeups => {
                        let timer = decode_value(InputTopic::Wakeups, &effect.payload).unwrap();
                        push(&mut queue, ms_of(effect.not_before.unwrap()), timer);
                    }
                    // A cancelled child is a worker that stops: nothing
                    // comes of it.
                    EffectTarget::StepQueue { .. }
                    | EffectTarget::Requests { .. }
                    | EffectTarget::Output { .. } => {}
                    EffectTarget::AttemptResults { .. } => panic!("no simulated run has a parent"),
                    EffectTarget::Events => panic!("only the first effect goes to events"),
                }
            }
            if tr.record.kind == TransitionKind::RunFailed {
                for &(id, delay) in &scn.retries {
                    push(&mut queue, ms + delay, retry(id, tr.record.seq));
                }
            }
            out.state = Some(tr.state.clone());
        }
        out.applied.push(Delivery { input, now });
        out.decisions.push(decision);
    }
    out
}

/// What a worker learns of an attempt: a task's dispatch as it is; a
/// child run's start as the attempt it answers (its stamp, its deadline,
/// its step index and attempt from the parent's state).
fn dispatch_of(effect: &Effect, state: &RunState) -> Value {
    if effect.kind == EffectKind::StepDispatch {
        return effect.payload.clone();
    }
    let stamp = effect.payload["parent"]["stamp"].as_str().unwrap();
    let attempt = state
        .attempts
        .iter()
        .find(|a| a.stamp.to_string() == stamp)
        .expect("a child's start names an attempt of its parent");
    json!({
        "stamp": stamp,
        "deadline": attempt.deadline.to_rfc3339(),
        "step_index": attempt.step_index,
        "attempt": attempt.attempt,
    })
}

fn solo(scn: &Scenario) -> (Workflows, Outcome) {
    let wf = Workflows::new(vec![definition("wf", scn), kid()]).unwrap();
    let out = simulate(scn, "run-0", "tenant-0", "wf", &wf);
    (wf, out)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---- properties ----------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    /// Every input delivered 1 + (1..=4) times, duplicates anywhere after the first
    /// delivery: same decisions for the first deliveries, every duplicate a NoOp, same
    /// final state.
    #[test]
    fn duplicates_change_nothing(scn in scenario(), seed in any::<u64>()) {
        let (wf, once) = solo(&scn);
        prop_assert!(once.decisions.iter().all(|d| !matches!(d, Decision::Rejection(_))));
        let n = once.applied.len();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut after: Vec<Vec<usize>> = vec![Vec::new(); n];
        for i in 0..n {
            for _ in 0..rng.random_range(1..=4) {
                after[rng.random_range(i..n)].push(i);
            }
        }
        let mut state: Option<RunState> = None;
        let mut decisions = Vec::new();
        for (j, dups) in after.iter_mut().enumerate() {
            let first = &once.applied[j];
            let decision = deliver(state.as_ref(), &first.input, &wf, first.now);
            if let Decision::Transition(tr) = &decision {
                state = Some(tr.state.clone());
            }
            decisions.push(decision);
            dups.shuffle(&mut rng);
            for &i in dups.iter() {
                let dup = deliver(state.as_ref(), &once.applied[i].input, &wf, first.now);
                prop_assert!(matches!(dup, Decision::NoOp(_)), "duplicate of #{} gave {:?}", i, dup);
            }
        }
        prop_assert_eq!(&decisions, &once.decisions);
        prop_assert_eq!(transitions(&decisions), once.transitions());
        prop_assert_eq!(state, once.state);
    }

    /// At every point of a run, a client-chosen start with another request, and a
    /// signal under a recorded id with another payload, are refused as
    /// `idempotency_mismatch` (a rejection writes nothing), while the same
    /// start and signal again stay no-ops.
    #[test]
    fn a_reused_key_with_another_meaning_changes_nothing(scn in scenario()) {
        let (wf, once) = solo(&scn);
        let start = once.applied[0].input.clone();
        let mut other_start = start.clone();
        if let Input::Start(s) = &mut other_start {
            s.input = json!({"order": "another"});
        }
        let mut state: Option<RunState> = None;
        for (delivery, decision) in once.applied.iter().zip(&once.decisions) {
            if let Decision::Transition(tr) = decision {
                state = Some(tr.state.clone());
            }
            let Some(s) = state.as_ref() else { continue };
            let d = deliver(Some(s), &other_start, &wf, delivery.now);
            prop_assert!(matches!(&d, Decision::Rejection(r) if r.class == RejectionClass::IdempotencyMismatch), "another start gave {:?}", d);
            let d = deliver(Some(s), &start, &wf, delivery.now);
            prop_assert!(matches!(d, Decision::NoOp(NoOpReason::DuplicateStart)), "the same start gave {:?}", d);
            for recorded in &s.signals {
                let other_signal = Input::Signal(SignalWakeup {
                    run_id: s.run_id.clone(),
                    tenant: s.tenant.clone(),
                    signal_id: recorded.signal_id.clone(),
                    name: recorded.name.clone(),
                    payload: json!("another payload"),
                });
                let d = deliver(Some(s), &other_signal, &wf, delivery.now);
                prop_assert!(matches!(&d, Decision::Rejection(r) if r.class == RejectionClass::IdempotencyMismatch), "another signal gave {:?}", d);
            }
        }
    }

    /// A result for an attempt abandoned by its timeout, delivered at any later point,
    /// is NoOp(StaleResult).
    #[test]
    fn stale_stamps_never_change_state(scn in scenario()) {
        let (wf, once) = solo(&scn);
        let mut state: Option<RunState> = None;
        let mut checked = 0;
        for (delivery, decision) in once.applied.iter().zip(&once.decisions) {
            if let Decision::Transition(tr) = decision {
                state = Some(tr.state.clone());
            }
            let Some(s) = state.as_ref() else { continue };
            let before = s.clone();
            for a in s.attempts.iter().filter(|a| a.status == AttemptStatus::TimedOut) {
                for outcome in [AttemptOutcome::Succeeded { output: json!("late") }, failure(true), failure(false)] {
                    let late = result(&s.run_id, &s.tenant, a.stamp, outcome);
                    let d = deliver(Some(s), &late, &wf, delivery.now);
                    prop_assert_eq!(d, Decision::NoOp(NoOpReason::StaleResult));
                    checked += 1;
                }
            }
            prop_assert_eq!(s, &before);
        }
        // the script's own late answers were stale too
        for (delivery, decision) in once.applied.iter().zip(&once.decisions) {
            if let Input::Result(r) = &delivery.input {
                let status = once.state.as_ref().unwrap().attempts.iter().find(|a| a.stamp == r.stamp).unwrap().status;
                if status == AttemptStatus::TimedOut {
                    prop_assert_eq!(decision, &Decision::NoOp(NoOpReason::StaleResult));
                }
            }
        }
        // Every attempt the run abandoned to its timeout had its late
        // answers tried, at least against the final state.
        let timed_out = once.state.as_ref().map_or(0, |s| {
            s.attempts.iter().filter(|a| a.status == AttemptStatus::TimedOut).count()
        });
        prop_assert!(
            checked >= 3 * timed_out,
            "{} late answers tried for {} timed-out attempts",
            checked,
            timed_out
        );
    }

    /// Transition seqs are 1, 2, 3, ... and end at `last_transition_seq`; attempts per
    /// step never exceed `max_attempts` and one more for each retry of the run from
    /// that step, numbered 1, 2, 3, ...; a run that succeeded or was cancelled never
    /// transitions again, and a failed one only for a retry (of an action id it has
    /// not applied), a signal or a cancel; every run terminates; every effect is
    /// valid against its type's committed schema.
    #[test]
    fn seqs_are_gap_free_and_bounds_hold(scn in scenario()) {
        let (wf, once) = solo(&scn);
        let trs = once.transitions();
        let seqs: Vec<i64> = trs.iter().map(|t| t.record.seq).collect();
        let expected: Vec<i64> = (1..=trs.len() as i64).collect();
        prop_assert_eq!(&seqs, &expected);
        for t in &trs {
            prop_assert_eq!(t.state.last_transition_seq, t.record.seq);
            prop_assert_eq!(t.state.record_version, 0);
            prop_assert_eq!(t.effects[0].payload["seq"].as_i64(), Some(t.record.seq));
            prop_assert!(t.effects.iter().skip(1).all(|e| e.target != EffectTarget::Events));
            for e in &t.effects {
                prop_assert_eq!(e.payload["type"].as_str(), Some(e.kind.wire_type()));
                prop_assert_eq!(ductor_testkit::schemas::check_message(&e.payload), Ok(()));
            }
        }
        let last = once.state.clone().unwrap();
        prop_assert_eq!(last.last_transition_seq, trs.len() as i64);
        prop_assert!(last.status.is_terminal(), "run did not finish: {:?}", last.status);
        prop_assert!(last.outstanding.is_none() && last.pending_retry.is_none() && last.waiting.is_none());
        prop_assert!(last.lanes.is_empty(), "an ended run keeps no branches");
        let def = wf.get("wf", 1).unwrap();
        for (i, (step, place)) in def.layout().into_iter().enumerate() {
            // A retry of the run from a parallel step starts its branches again.
            let top = place.parallel.map_or(i, |p| p as usize);
            let retried = last.retries.iter().filter(|r| r.step_index as usize == top).count() as u32;
            let mut attempts: Vec<u32> = last.attempts.iter().filter(|a| a.step_index as usize == i).map(|a| a.attempt).collect();
            // Each visit of a step that a loop starts again has its own attempts.
            let visits = last.visits.get(&(i as u32)).map_or(1, |v| v.count.max(1));
            // A retry of the run gives a step of its own one more attempt,
            // and the steps of a parallel step or a map it starts again
            // their whole policy again; a map runs its steps once per item.
            let bound = if let Some(undone) = place.compensates {
                // A compensation runs once for each success of the step it
                // undoes, each with its whole policy, and again after each
                // retry of the run that names it.
                let undone = last.attempts.iter().filter(|a| a.step_index == undone && a.status == AttemptStatus::Succeeded).count() as u32;
                step.retry.max_attempts * undone * (1 + retried)
            } else if place.parallel.is_some() {
                let items = if scn.map { ITEMS.len() as u32 } else { 1 };
                step.retry.max_attempts * visits * (1 + retried) * items
            } else {
                step.retry.max_attempts * visits + retried
            };
            prop_assert!(attempts.len() as u32 <= bound, "step {}: {} attempts over {}", i, attempts.len(), bound);
            attempts.sort_unstable();
            let numbered: Vec<u32> = (1..=attempts.len() as u32).collect();
            prop_assert_eq!(attempts, numbered);
        }
        let mut finished: Option<RunStatus> = None;
        for (delivery, d) in once.applied.iter().zip(&once.decisions) {
            if let (Some(status), Decision::Transition(_)) = (finished, d) {
                let after_failure = matches!(&delivery.input, Input::Retry(_) | Input::Signal(_) | Input::Cancel(_));
                prop_assert!(status == RunStatus::Failed && after_failure, "a {:?} run transitioned on {:?}: {:?}", status, delivery.input, d);
            }
            if let Decision::Transition(t) = d {
                finished = t.state.status.is_terminal().then_some(t.state.status);
            }
        }
        // A caught failure goes on at the rescue; a parallel step or map
        // that catches never fails the run itself.
        for t in &trs {
            if t.record.kind == TransitionKind::StepCaught {
                prop_assert!(scn.catches && !scn.compensates, "caught without a catch: {}", t.record.detail);
                prop_assert_eq!(&t.record.detail["caught"]["step"], &json!("fan"));
            }
            if t.record.kind == TransitionKind::RunCompensating || t.record.detail.get("compensating").is_some() {
                prop_assert!(scn.compensates, "compensating without a compensation: {}", t.record.detail);
            }
            let cause = t.record.detail["cause"].as_str();
            if scn.catches && cause.is_some_and(|c| [BRANCH_FAILED, ITEM_FAILED].contains(&c)) {
                prop_assert!(false, "a caught failure failed the run: {}", t.record.detail);
            }
        }
        // A compensated run undid every step that succeeded and named a
        // compensation, newest first, each once.
        if last.is_compensated() {
            let layout = def.layout();
            let compensations: Vec<u32> = layout.iter().filter_map(|(_, p)| p.compensates).collect();
            let succeeded = |of: &dyn Fn(u32) -> bool| {
                last.attempts.iter().filter(|a| of(a.step_index) && a.status == AttemptStatus::Succeeded).count()
            };
            let undone = succeeded(&|i| compensations.contains(&i));
            let done = succeeded(&|i| layout[i as usize].0.compensate.is_some());
            prop_assert_eq!(undone, done, "every success undone once");
            let keys = trs.iter().filter(|t| t.record.detail.get("compensated_key").is_some()).count();
            prop_assert_eq!(undone, keys);
        }
        // Each action id revives the run once at most.
        let mut ids: Vec<&str> = last.retries.iter().map(|r| r.action_id.as_str()).collect();
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        prop_assert_eq!(ids.len(), n);
        let retried = once.transitions().iter().filter(|t| t.record.input_ref.starts_with("retry:")).count();
        prop_assert_eq!(retried, n);
    }

    /// The state keeps only the newest output (or, in a run that selects
    /// data, the output it selects once it succeeded), and a signal's
    /// payload only while a later step may consume it; the history keeps every step's
    /// output, in step order, and every signal's payload. A waiting step's
    /// output is its input with a member named after it: the time a sleep
    /// ended, the signal an await got, or that it timed out.
    #[test]
    fn outputs_and_payloads_are_kept_in_the_history(scn in scenario()) {
        // Step by step in order: a loop runs its first step again, and
        // branches run at once; so neither, rather than rejecting the case.
        let scn = Scenario { loops: false, parallel: None, ..scn };
        let (wf, once) = solo(&scn);
        let trs = once.transitions();
        let def = wf.get("wf", 1).unwrap();
        let mut completed: Vec<(u64, Value)> = Vec::new();
        for t in &trs {
            let d = &t.record.detail;
            let before = completed.len();
            // (A compensation's success changes no output.)
            if let Some(i) = d["completed_step"].as_u64().filter(|&i| i < def.steps.len() as u64) {
                completed.push((i, d["output"].clone()));
            }
            for passed in d["passed_steps"].as_array().into_iter().flatten() {
                completed.push((passed["step_index"].as_u64().unwrap(), passed["output"].clone()));
            }
            if let Some((_, newest)) = completed.get(before..).and_then(<[_]>::last) {
                // A run that selects its output ends with the first step's result.
                let output = match completed.first() {
                    Some((_, first)) if scn.selects && t.state.status == RunStatus::Succeeded => first,
                    _ => newest,
                };
                prop_assert_eq!(&t.state.output, output);
            }
        }
        for (n, (i, output)) in completed.iter().enumerate() {
            prop_assert_eq!(*i, n as u64, "steps completed out of order");
            let member = &output[format!("step{i}")];
            match scn.steps[n] {
                StepSpec::Task(..) | StepSpec::Child(..) => prop_assert_eq!(&output["step"], &json!(i)),
                StepSpec::Sleep(_) => prop_assert!(member["until"].is_string(), "sleep output {}", output),
                StepSpec::Await(_, go_on) => {
                    if let Some(id) = member["signal_id"].as_str() {
                        let k: u8 = id.trim_start_matches("sig-").parse().unwrap();
                        prop_assert_eq!(&member["payload"], &json!({"sig": k}));
                    } else {
                        prop_assert!(go_on && member == &json!({"timed_out": true}), "await output {}", output);
                    }
                }
            }
        }
        let last = once.state.clone().unwrap();
        let newest = match (completed.first(), completed.last()) {
            (Some((_, first)), _) if scn.selects && last.status == RunStatus::Succeeded => first.clone(),
            (_, newest) => newest.map_or(Value::Null, |(_, o)| o.clone()),
        };
        prop_assert_eq!(&last.output, &newest);
        if last.status == RunStatus::Succeeded {
            prop_assert_eq!(completed.len(), def.steps.len());
        }
        for (delivery, decision) in once.applied.iter().zip(&once.decisions) {
            let (Input::Signal(sig), Decision::Transition(t)) = (&delivery.input, decision) else { continue };
            prop_assert_eq!(&t.record.detail["payload"], &sig.payload);
            prop_assert_eq!(&t.record.detail["signal_id"], &json!(sig.signal_id));
        }
        let encoded = serde_json::to_value(&last).unwrap();
        prop_assert!(encoded.get("outputs").is_none());
        // A failed run keeps signals for the step it failed in too: a retry
        // starts that step again.
        // A cancelled one keeps none.
        let first = match last.status {
            RunStatus::Failed => last.step_index as usize,
            RunStatus::Cancelled => def.steps.len(),
            _ => last.step_index as usize + 1,
        };
        let awaits_left = def.steps.iter().skip(first).filter(|s| s.kind == StepKind::AwaitSignal).count();
        let kept = last.signals.iter().filter(|s| s.kept).count();
        prop_assert!(kept <= awaits_left, "{} signals kept for {} awaits", kept, awaits_left);
        prop_assert!(encoded["signals"].as_array().unwrap().iter().all(|s| s.get("payload").is_none() || s["kept"] == json!(true)));
    }

    /// Under any state cap a run goes exactly as it goes uncapped until the first
    /// transition whose state would be over the cap; that one fails the run with
    /// `state_too_large` instead (a start is refused). What follows changes nothing
    /// or, as for any failed run, records a signal or cancels it, within the cap: an
    /// input to the failed run that would not fit is refused. Every other state stays
    /// within the cap.
    #[test]
    fn a_state_over_the_cap_fails_the_run_there(scn in scenario(), cap in 200usize..6_000) {
        // A retry would start a run failed for its size again.
        let scn = Scenario { retries: Vec::new(), ..scn };
        let (wf, uncapped) = solo(&scn);
        let capped = simulate_capped(&scn, "run-0", "tenant-0", "wf", &wf, cap);
        let size = |d: &Decision| match d {
            Decision::Transition(t) => serde_json::to_string(&t.state).unwrap().len(),
            _ => 0,
        };
        let Some(k) = uncapped.decisions.iter().position(|d| size(d) > cap) else {
            prop_assert_eq!(&capped.decisions, &uncapped.decisions);
            return Ok(());
        };
        prop_assert_eq!(&capped.decisions[..k], &uncapped.decisions[..k]);
        let failed_before = transitions(&capped.decisions[..k]).last().is_some_and(|t| t.state.status == RunStatus::Failed);
        match &capped.decisions[k] {
            Decision::Rejection(r) if k == 0 => {
                prop_assert_eq!(r.class, RejectionClass::StateTooLarge);
                prop_assert!(capped.state.is_none());
                // The signals and the cancel then name a run that does not exist.
                let rest = capped.decisions[1..].iter().all(|d| matches!(d, Decision::Rejection(r) if r.class == RejectionClass::UnknownRun));
                prop_assert!(rest);
                return Ok(());
            }
            Decision::Rejection(r) => {
                // The run had failed: the input to it that did not fit is
                // refused, and the run stays as it failed.
                prop_assert_eq!(r.class, RejectionClass::StateTooLarge);
                prop_assert!(failed_before, "a running run's input was refused for its size");
            }
            Decision::Transition(t) => {
                prop_assert!(!failed_before);
                prop_assert_eq!(t.record.kind, TransitionKind::RunFailed);
                prop_assert_eq!(&t.record.detail["cause"], &json!(STATE_TOO_LARGE));
                prop_assert!(t.state.outstanding.is_none() && t.state.pending_retry.is_none());
                prop_assert!(t.state.error.as_deref().unwrap().starts_with(STATE_TOO_LARGE));
            }
            Decision::NoOp(r) => prop_assert!(false, "the transition over the cap became a no-op ({:?})", r),
        }
        let last = capped.state.as_ref().unwrap();
        prop_assert!(matches!(last.status, RunStatus::Failed | RunStatus::Cancelled), "{:?}", last.status);
        for (delivery, d) in capped.applied[k + 1..].iter().zip(&capped.decisions[k + 1..]) {
            match d {
                Decision::NoOp(_) => {}
                Decision::Rejection(r) => prop_assert_eq!(r.class, RejectionClass::StateTooLarge),
                Decision::Transition(t) => {
                    prop_assert!(matches!(delivery.input, Input::Signal(_) | Input::Cancel(_)), "{:?} after the failure", t.record.kind);
                    prop_assert!(size(d) <= cap);
                }
            }
        }
        prop_assert!(capped.decisions[..k].iter().all(|d| size(d) <= cap));
    }

    /// A parallel step's branches answered in either order end the run
    /// the same: its status, output, document and attempts per step.
    #[test]
    fn branches_in_either_order_end_the_same(scn in scenario()) {
        // Every attempt succeeds, nothing else arrives.
        let scn = Scenario {
            script: Vec::new(),
            signals: Vec::new(),
            cancel_at: None,
            parallel: scn.parallel.or(Some(OnFailure::FailFast)),
            ..scn
        };
        let (wf, a_first) = solo(&scn);
        let b_first = simulate(&Scenario { b_first: true, ..scn.clone() }, "run-0", "tenant-0", "wf", &wf);
        let (x, y) = (a_first.state.unwrap(), b_first.state.unwrap());
        // A sleep's output says when it ended, which the order moves.
        fn untimed(v: &Value) -> Value {
            match v {
                Value::Object(m) => m.iter().filter(|(k, _)| *k != "until").map(|(k, v)| (k.clone(), untimed(v))).collect(),
                Value::Array(a) => a.iter().map(untimed).collect(),
                other => other.clone(),
            }
        }
        let ended = |s: &RunState| {
            let mut steps: Vec<u32> = s.attempts.iter().map(|a| a.step_index).collect();
            steps.sort_unstable();
            let results = s.results.clone().map(|r| untimed(&Value::Object(r)));
            (s.status, untimed(&s.output), results, steps)
        };
        prop_assert_eq!(ended(&x), ended(&y));
        let fan = wf.get("wf", 1).unwrap().steps.len() - 1;
        if x.status == RunStatus::Succeeded && !scn.selects {
            if scn.map {
                prop_assert_eq!(x.output.as_array().map(Vec::len), Some(ITEMS.len()), "output {}", x.output);
            } else {
                prop_assert!(x.output.get("a").is_some() && x.output.get("b").is_some(), "output {}", x.output);
            }
        }
        // The order differed: the other branch's attempt finished first.
        let finished_first = |s: &RunState| {
            s.attempts.iter().filter(|a| a.step_index as usize > fan).min_by_key(|a| a.finished_at).map(|a| (a.step_index, a.attempt))
        };
        if x.status == RunStatus::Succeeded {
            prop_assert_ne!(finished_first(&x), finished_first(&y));
        }
    }

    /// Runs interleaved in a random order each end where they end alone.
    #[test]
    fn interleaving_runs_preserves_each_outcome(scns in prop::collection::vec(scenario(), 2..=3), seed in any::<u64>()) {
        let defs: Vec<_> = scns.iter().enumerate().map(|(k, s)| definition(&format!("wf-{k}"), s)).collect();
        let wf = Workflows::new(defs.into_iter().chain([kid()]).collect()).unwrap();
        let solos: Vec<Outcome> = scns
            .iter()
            .enumerate()
            .map(|(k, s)| simulate(s, &format!("run-{k}"), &format!("tenant-{}", k % 2), &format!("wf-{k}"), &wf))
            .collect();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut cursors = vec![0usize; solos.len()];
        let mut states: HashMap<String, RunState> = HashMap::new();
        let mut decisions: Vec<Vec<Decision>> = vec![Vec::new(); solos.len()];
        loop {
            let live: Vec<usize> = (0..solos.len()).filter(|&k| cursors[k] < solos[k].applied.len()).collect();
            let Some(&k) = live.get(rng.random_range(0..live.len().max(1))) else { break };
            let d = &solos[k].applied[cursors[k]];
            cursors[k] += 1;
            let decision = deliver(states.get(d.input.run_id()), &d.input, &wf, d.now);
            if let Decision::Transition(tr) = &decision {
                states.insert(tr.state.run_id.clone(), tr.state.clone());
            }
            decisions[k].push(decision);
        }
        for (k, s) in solos.iter().enumerate() {
            prop_assert_eq!(&decisions[k], &s.decisions);
            prop_assert_eq!(states.get(&format!("run-{k}")), s.state.as_ref());
        }
    }

    /// Arbitrary, even nonsensical, inputs and entropy against reachable states never
    /// panic; NoOps and Rejections leave the state as it was; transitions keep the
    /// invariants.
    #[test]
    fn fold_is_total(scn in scenario(), seed in any::<u64>()) {
        let (wf, once) = solo(&scn);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut states: Vec<Option<RunState>> = vec![None];
        states.extend(transitions(&once.decisions).into_iter().map(|t| Some(t.state)));
        let mut known: Vec<Uuid> = once.state.as_ref().map(|s| s.attempts.iter().map(|a| a.stamp).collect()).unwrap_or_default();
        known.extend(states.iter().flatten().filter_map(|s| s.waiting.as_ref().map(|w| w.stamp)));
        let empty = Workflows::default();
        for _ in 0..40 {
            let state = states[rng.random_range(0..states.len())].clone();
            let input = nonsense(&mut rng, &known);
            let entropy = Entropy {
                stamp: Uuid::from_u128(rng.random()),
                jitter_unit: [0.0, 0.999, 1.0, -3.0, f64::NAN, f64::INFINITY, rng.random()][rng.random_range(0..7)],
            };
            let now = [at(rng.random_range(-1_000..100_000)), DateTime::<Utc>::MAX_UTC, DateTime::<Utc>::MIN_UTC][rng.random_range(0..3)];
            let registry = if rng.random_bool(0.2) { &empty } else { &wf };
            let before = state.clone();
            let decision = fold(state.as_ref(), &input, registry, STATE_CAP, now, &entropy);
            prop_assert_eq!(&state, &before);
            match decision {
                Decision::Transition(t) => {
                    let old_seq = state.as_ref().map_or(0, |s| s.last_transition_seq);
                    prop_assert_eq!(t.record.seq, old_seq + 1);
                    prop_assert_eq!(t.state.last_transition_seq, old_seq + 1);
                    prop_assert_eq!(t.state.updated_at, now);
                    prop_assert_eq!(&t.effects[0].target, &EffectTarget::Events);
                    prop_assert_eq!(t.state.run_id.as_str(), input.run_id());
                    prop_assert_eq!(t.state.tenant.as_str(), input.tenant());
                    if let Some(s) = &state {
                        let after_failure = s.status == RunStatus::Failed
                            && matches!(input, Input::Retry(_) | Input::Signal(_) | Input::Cancel(_));
                        prop_assert!(!s.status.is_terminal() || after_failure);
                        prop_assert_eq!(t.state.record_version, s.record_version);
                    }
                    prop_assert!(t.record.detail.to_string().len() < 2_048);
                }
                Decision::NoOp(_) => prop_assert!(state.is_some()),
                Decision::Rejection(r) => prop_assert!(r.message.chars().count() <= 512),
            }
        }
    }

    /// decode(encode(x)) == x for every valid input, and its encoding is
    /// valid against its type's committed schema.
    #[test]
    fn decode_inverts_encode(input in valid_input()) {
        let bytes = serde_json::to_vec(&input.to_json()).unwrap();
        prop_assert_eq!(ductor_testkit::schemas::check_message(&input.to_json()), Ok(()));
        prop_assert_eq!(decode_input(input.topic(), &bytes, &InputLimits::sized(usize::MAX)), Ok(input.clone()));
        for topic in [InputTopic::Requests, InputTopic::Wakeups, InputTopic::AttemptResults] {
            // A cancel is read on the requests topic too (a parent's, behind
            // its child's start).
            if matches!(input, Input::Cancel(_)) && topic == InputTopic::Requests {
                prop_assert_eq!(decode_input(topic, &bytes, &InputLimits::sized(usize::MAX)), Ok(input.clone()));
            } else if topic != input.topic() {
                prop_assert_eq!(decode_input(topic, &bytes, &InputLimits::sized(usize::MAX)).unwrap_err().class, InputErrorClass::WrongTopic);
            }
        }
    }

    /// Arbitrary bytes never panic the decoder, and errors stay bounded.
    #[test]
    fn decode_of_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512), topic in topic()) {
        if let Err(e) = decode_input(topic, &bytes, &InputLimits::sized(256)) {
            prop_assert!(e.message.chars().count() <= 512);
        }
    }

    /// Near-miss JSON objects (known types, random field values) never panic.
    #[test]
    fn decode_of_near_miss_objects_never_panics(
        kind in prop_oneof![
            Just("run.start".to_owned()),
            Just("attempt.result".to_owned()),
            Just("wakeup.timer".to_owned()),
            Just("wakeup.signal".to_owned()),
            Just("wakeup.cancel".to_owned()),
            ".{0,20}",
        ],
        fields in prop::collection::btree_map(field_name(), json_value(), 0..10),
        version in json_value(),
        topic in topic(),
    ) {
        let mut obj = serde_json::Map::new();
        obj.insert("type".into(), Value::String(kind));
        obj.insert("schema_version".into(), if fields.len() % 2 == 0 { json!(1) } else { version });
        obj.extend(fields);
        let bytes = serde_json::to_vec(&Value::Object(obj)).unwrap();
        if let Err(e) = decode_input(topic, &bytes, &InputLimits::sized(usize::MAX)) {
            prop_assert!(e.message.chars().count() <= 512);
        }
    }
}

// ---- generators --------------------------------------------------------------------

/// An input that may name the wrong run or tenant, an unknown or known stamp, etc.
fn nonsense(rng: &mut StdRng, known: &[Uuid]) -> Input {
    let run_id = ["run-0", "run-0", "run-0", "run-9"][rng.random_range(0..4)].to_owned();
    let tenant =
        ["tenant-0", "tenant-0", "tenant-0", "tenant-9"][rng.random_range(0..4)].to_owned();
    let stamp = if !known.is_empty() && rng.random_bool(0.7) {
        known[rng.random_range(0..known.len())]
    } else {
        Uuid::from_u128(rng.random())
    };
    match rng.random_range(0..7) {
        0 => Input::Start(RunStart {
            run_id,
            tenant,
            workflow: ["wf", "nope"][rng.random_range(0..2)].to_owned(),
            workflow_version: [None, Some(1), Some(0), Some(u32::MAX)][rng.random_range(0..4)],
            pool: "p".to_owned(),
            input: Value::Null,
            correlation_id: None,
            parent: None,
        }),
        1 => result(
            &run_id,
            &tenant,
            stamp,
            AttemptOutcome::Succeeded {
                output: json!(rng.random::<u32>()),
            },
        ),
        2 => result(&run_id, &tenant, stamp, failure(rng.random())),
        3 => Input::Timer(TimerWakeup {
            run_id,
            tenant,
            timer: [TimerKind::Retry, TimerKind::Timeout, TimerKind::Wake][rng.random_range(0..3)],
            stamp,
        }),
        4 => Input::Signal(SignalWakeup {
            run_id,
            tenant,
            signal_id: format!("sig-{}", rng.random_range(0..6)),
            name: "n".to_owned(),
            payload: Value::Null,
        }),
        5 => Input::Retry(RetryWakeup {
            run_id,
            tenant,
            action_id: format!("retry-{}", rng.random_range(0..3)),
            failed_seq: rng.random_range(1..12),
            reason: None,
        }),
        _ => Input::Cancel(CancelWakeup {
            run_id,
            tenant,
            reason: None,
            action_id: None,
        }),
    }
}

fn topic() -> impl Strategy<Value = InputTopic> {
    prop_oneof![
        Just(InputTopic::Requests),
        Just(InputTopic::Wakeups),
        Just(InputTopic::AttemptResults)
    ]
}

fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("run_id"),
        Just("tenant"),
        Just("workflow"),
        Just("workflow_version"),
        Just("pool"),
        Just("input"),
        Just("correlation_id"),
        Just("stamp"),
        Just("outcome"),
        Just("output"),
        Just("error"),
        Just("timer"),
        Just("signal_id"),
        Just("name"),
        Just("payload"),
        Just("reason"),
    ]
    .prop_map(str::to_owned)
}

/// JSON values whose text form round-trips exactly (floats are halves of integers).
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<i32>().prop_map(|i| Value::from(f64::from(i) + 0.5)),
        "\\PC{0,16}".prop_map(Value::String),
        Just(json!("00000000-0000-0000-0000-000000000001")),
        Just(json!("failed")),
        Just(json!({"message": "m", "retryable": true})),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn id() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_.:-]{1,128}"
}

fn uuid() -> impl Strategy<Value = Uuid> {
    any::<u128>().prop_map(Uuid::from_u128)
}

fn valid_input() -> impl Strategy<Value = Input> {
    let start = (
        id(),
        id(),
        "[A-Za-z0-9_.-]{1,100}",
        prop::option::of(any::<u32>()),
        "[A-Za-z0-9_.-]{1,100}",
        json_value(),
        prop::option::of("\\PC{0,64}"),
        prop::option::of((id(), uuid())),
    )
        .prop_map(
            |(run_id, tenant, workflow, workflow_version, pool, input, correlation_id, parent)| {
                Input::Start(RunStart {
                    run_id,
                    tenant,
                    workflow,
                    workflow_version,
                    pool,
                    input,
                    correlation_id,
                    parent: parent.map(|(run_id, stamp)| Box::new(ParentRef { run_id, stamp })),
                })
            },
        );
    let outcome = prop_oneof![
        json_value().prop_map(|output| AttemptOutcome::Succeeded { output }),
        ("\\PC{0,64}", any::<bool>())
            .prop_map(|(message, retryable)| AttemptOutcome::Failed { message, retryable }),
    ];
    let attempt_result =
        (id(), id(), uuid(), outcome).prop_map(|(run_id, tenant, stamp, outcome)| {
            Input::Result(AttemptResult {
                run_id,
                tenant,
                stamp,
                outcome,
            })
        });
    let kind = prop_oneof![
        Just(TimerKind::Retry),
        Just(TimerKind::Timeout),
        Just(TimerKind::Wake)
    ];
    let timer = (id(), id(), kind, uuid()).prop_map(|(run_id, tenant, timer, stamp)| {
        Input::Timer(TimerWakeup {
            run_id,
            tenant,
            timer,
            stamp,
        })
    });
    let signal = (id(), id(), "\\PC{1,32}", "\\PC{1,32}", json_value()).prop_map(
        |(run_id, tenant, signal_id, name, payload)| {
            Input::Signal(SignalWakeup {
                run_id,
                tenant,
                signal_id,
                name,
                payload,
            })
        },
    );
    let cancel = (
        id(),
        id(),
        prop::option::of("\\PC{0,64}"),
        prop::option::of(id()),
    )
        .prop_map(|(run_id, tenant, reason, action_id)| {
            Input::Cancel(CancelWakeup {
                run_id,
                tenant,
                reason,
                action_id,
            })
        });
    let retry = (
        id(),
        id(),
        id(),
        1..=i64::MAX,
        prop::option::of("\\PC{0,64}"),
    )
        .prop_map(|(run_id, tenant, action_id, failed_seq, reason)| {
            Input::Retry(RetryWakeup {
                run_id,
                tenant,
                action_id,
                failed_seq,
                reason,
            })
        });
    prop_oneof![start, attempt_result, timer, signal, cancel, retry]
}
