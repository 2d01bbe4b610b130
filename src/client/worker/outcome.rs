//! What a handler made of an attempt, and the `attempt.result` it becomes.
//!
//! In: a [`StepOutcome`] and the dispatch it answers. Out: the JSON of the
//! `attempt.result`, exactly as the coordinator decodes it. Guarantees: a
//! failure's message is cut to what the contract allows; a result the
//! coordinator would refuse (too large, a shape it does not accept) is never
//! published: a non-retryable failure that names why is, so the step fails at
//! once instead of timing out behind a dead letter. No broker, no clock: what
//! it decides is tested without either.

use serde_json::Value;
use uuid::Uuid;

use super::StepDispatch;
use crate::contract::input::{MAX_ERROR_MESSAGE_LEN, truncate};
use crate::contract::{AttemptOutcome, AttemptResult, Input, InputLimits};

/// What a handler made of one attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    /// The step's output: the next step's input, or the run's output after
    /// the last step.
    Succeeded(Value),
    /// `retryable: true` lets the step's retry policy schedule another
    /// attempt; `false` fails the run. Messages longer than 4096 characters
    /// are cut.
    Failed { message: String, retryable: bool },
}

impl StepOutcome {
    /// The `attempt.result` input answering `step`, exactly as the
    /// coordinator decodes it from the attempt-results topic.
    pub fn to_result_json(&self, step: &StepDispatch) -> Value {
        self.result_for(&step.run_id, &step.tenant, step.stamp)
    }

    fn result_for(&self, run_id: &str, tenant: &str, stamp: Uuid) -> Value {
        let outcome = match self {
            StepOutcome::Succeeded(output) => AttemptOutcome::Succeeded {
                output: output.clone(),
            },
            StepOutcome::Failed { message, retryable } => AttemptOutcome::Failed {
                message: truncate(message.clone(), MAX_ERROR_MESSAGE_LEN),
                retryable: *retryable,
            },
        };
        Input::Result(AttemptResult {
            run_id: run_id.to_owned(),
            tenant: tenant.to_owned(),
            stamp,
            outcome,
        })
        .to_json()
    }

    /// The `attempt.result` to publish for this outcome: its own, or, when
    /// the coordinator would refuse that one, a non-retryable failure that
    /// says why.
    pub(super) fn result_payload(
        &self,
        run_id: &str,
        tenant: &str,
        stamp: Uuid,
        limits: &InputLimits,
    ) -> String {
        let payload = self.result_for(run_id, tenant, stamp).to_string();
        let Err(refused) = crate::contract::parse_value(payload.as_bytes(), limits) else {
            return payload;
        };
        // The coordinator would dead-letter it and the step would time out:
        // fail it now, for good, saying why.
        tracing::warn!(
            bytes = payload.len(),
            class = refused.class.as_str(),
            error = %refused.message,
            "step result cannot be accepted, reporting a failure instead"
        );
        let failure = StepOutcome::Failed {
            message: format!(
                "the step's result cannot be accepted ({}): {}",
                refused.class.as_str(),
                refused.message
            ),
            retryable: false,
        };
        failure.result_for(run_id, tenant, stamp).to_string()
    }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};
    use serde_json::Value;
    use uuid::Uuid;

    use super::*;
    use crate::contract::{EffectTarget, InputTopic, RunStart, decode_input};
    use crate::coordinator::{
        Decision, Entropy, StepDefinition, WorkflowDefinition, Workflows, fold,
    };
    use serde_json::json;

    fn workflows() -> Workflows {
        let step = |name: &str| StepDefinition::task(name, "default", 5_000);
        Workflows::new(vec![WorkflowDefinition {
            name: "wf".into(),
            version: 3,
            steps: vec![step("reserve"), step("charge")],
            output_topic: None,
            output: None,
        }])
        .unwrap()
    }

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_700_000_000_123).unwrap()
    }

    /// The dispatch the real fold emits for a fresh run.
    fn dispatch_from_fold() -> (crate::coordinator::RunState, Value) {
        let start = Input::Start(RunStart {
            run_id: "run-1".into(),
            tenant: "acme".into(),
            workflow: "wf".into(),
            workflow_version: None,
            pool: "default".into(),
            input: json!({"order": 7}),
            correlation_id: None,
            parent: None,
        });
        let entropy = Entropy {
            stamp: Uuid::from_u128(42),
            jitter_unit: 0.5,
        };
        let Decision::Transition(t) = fold(None, &start, &workflows(), usize::MAX, now(), &entropy)
        else {
            panic!("start is a transition");
        };
        let effect = t
            .effects
            .iter()
            .find(|e| matches!(e.target, EffectTarget::StepQueue { .. }))
            .expect("a dispatch effect");
        (t.state, effect.payload.clone())
    }

    #[test]
    fn decodes_the_dispatch_the_fold_emits() {
        let (_, payload) = dispatch_from_fold();
        let step = StepDispatch::decode(payload.to_string().as_bytes()).unwrap();
        assert_eq!(
            step,
            StepDispatch {
                schema_version: 1,
                run_id: "run-1".into(),
                tenant: "acme".into(),
                workflow: "wf".into(),
                workflow_version: 3,
                step: "reserve".into(),
                step_index: 0,
                attempt: 1,
                step_key: "run-1/step/0".into(),
                stamp: Uuid::from_u128(42),
                deadline: now() + chrono::TimeDelta::milliseconds(5_000),
                input: json!({"order": 7}),
                branch: None,
                item: None,
            }
        );
        assert!(!step.is_expired(now()));
        assert!(step.is_expired(step.deadline));
    }

    #[test]
    fn a_result_built_from_a_dispatch_is_accepted_by_the_coordinator() {
        let (state, payload) = dispatch_from_fold();
        let step = StepDispatch::decode(payload.to_string().as_bytes()).unwrap();
        let result = StepOutcome::Succeeded(json!({"reserved": true})).to_result_json(&step);
        let input = decode_input(
            InputTopic::AttemptResults,
            result.to_string().as_bytes(),
            &InputLimits::sized(1 << 20),
        )
        .unwrap();
        assert_eq!(
            input,
            Input::Result(AttemptResult {
                run_id: "run-1".into(),
                tenant: "acme".into(),
                stamp: Uuid::from_u128(42),
                outcome: AttemptOutcome::Succeeded {
                    output: json!({"reserved": true})
                },
            })
        );
        let entropy = Entropy {
            stamp: Uuid::from_u128(43),
            jitter_unit: 0.5,
        };
        let decision = fold(
            Some(&state),
            &input,
            &workflows(),
            usize::MAX,
            now(),
            &entropy,
        );
        let Decision::Transition(t) = decision else {
            panic!("the result advances the run: {decision:?}");
        };
        assert_eq!(t.state.step_index, 1);
    }

    #[test]
    fn failures_round_trip_with_their_retryable_flag_and_a_bounded_message() {
        let (_, payload) = dispatch_from_fold();
        let step = StepDispatch::decode(payload.to_string().as_bytes()).unwrap();
        for retryable in [true, false] {
            let outcome = StepOutcome::Failed {
                message: "x".repeat(MAX_ERROR_MESSAGE_LEN + 10),
                retryable,
            };
            let json = outcome.to_result_json(&step);
            assert_eq!(json["type"], "attempt.result");
            assert_eq!(json["schema_version"], 1);
            assert_eq!(json["outcome"], "failed");
            let Ok(Input::Result(r)) = decode_input(
                InputTopic::AttemptResults,
                json.to_string().as_bytes(),
                &InputLimits::sized(1 << 20),
            ) else {
                panic!("decodes");
            };
            assert_eq!(
                r.outcome,
                AttemptOutcome::Failed {
                    message: "x".repeat(MAX_ERROR_MESSAGE_LEN),
                    retryable
                }
            );
        }
    }

    #[test]
    fn undecodable_dispatches_name_the_field() {
        let (_, good) = dispatch_from_fold();
        let cases: Vec<(Value, &str)> = vec![
            (json!("nope"), "not a JSON object"),
            (json!({"type": "attempt.result"}), "type"),
            (
                {
                    let mut v = good.clone();
                    v["schema_version"] = json!(2);
                    v
                },
                "schema_version 2",
            ),
            (
                {
                    let mut v = good.clone();
                    v["stamp"] = json!("x");
                    v
                },
                "stamp",
            ),
            (
                {
                    let mut v = good.clone();
                    v["deadline"] = json!("soon");
                    v
                },
                "deadline",
            ),
            (
                {
                    let mut v = good.clone();
                    v["attempt"] = json!(-1);
                    v
                },
                "attempt",
            ),
            (
                {
                    let mut v = good.clone();
                    v["run_id"] = json!("a b");
                    v
                },
                "run_id",
            ),
            (
                {
                    let mut v = good.clone();
                    v.as_object_mut().unwrap().remove("tenant");
                    v
                },
                "tenant: missing",
            ),
        ];
        for (value, needle) in cases {
            let err = StepDispatch::decode(value.to_string().as_bytes()).unwrap_err();
            assert!(err.message.contains(needle), "{needle}: {err}");
        }
        assert!(StepDispatch::decode(b"\xff\x00").is_err());
        assert!(StepDispatch::decode(b"").is_err());
        // Unknown extra fields are tolerated.
        let mut extra = good;
        extra["added_later"] = json!(1);
        assert!(StepDispatch::decode(extra.to_string().as_bytes()).is_ok());
    }
}
