//! A batch sorted by what each message is, and settled by what each came
//! to.
//!
//! In: a batch's messages (their values, and the signature, replay id and
//! trace context headers); later, what the apply path made of them
//! ([`IsolatedBatch`]). Out: [`Sorted`]: the inputs to apply, the starts
//! for the routing plane, and the dead letters of messages that do not
//! decode or whose signature does not hold, each beside its message; then
//! every outcome counted (`ductor_inputs_total`, the routing plane's
//! counters, the [`StepReport`]) and the rejected and failed inputs added
//! to the dead letters. Guarantees: each message of an input topic is
//! exactly one of an input, a routed start or a dead letter, and each
//! outcome is counted once; a routed start left out (parked) is neither
//! counted nor dead-lettered, as it is applied again later; only what the
//! coordinator, the routing plane or the database refused is
//! dead-lettered after the apply.

use rdkafka::message::{Message, OwnedMessage};

use super::classify::{Classified, Received, check_signature, classify_keyed, default_key};
use super::dead_letter::{DeadLetter, Stage};
use super::parked::ParkedStart;
use super::{IngressContext, StepReport};
use crate::apply::{InputOutcome, IsolatedBatch, PendingInput};
use crate::contract::{Input, Source, TraceContext};
use crate::coordinator::NoOpReason;
use crate::coordinator::fold::RejectionClass;
use crate::routing::{self, MismatchPath, RouteOutcome};

/// A batch sorted by what each message is: inputs to apply, starts for the
/// routing plane, and dead letters, each input beside its message.
pub(super) struct Sorted<'m> {
    pub(super) pending: Vec<PendingInput>,
    pub(super) pending_msgs: Vec<&'m OwnedMessage>,
    pub(super) routed: Vec<routing::RouteRequest>,
    pub(super) routed_msgs: Vec<&'m OwnedMessage>,
    pub(super) dead: Vec<DeadLetter<'m>>,
}

impl<'m> Sorted<'m> {
    /// Puts parked starts applied again ahead of the batch's own: they were
    /// read first.
    pub(super) fn retry_first(&mut self, retried: &'m [ParkedStart]) {
        self.routed
            .splice(0..0, retried.iter().map(|s| s.request.clone()));
        self.routed_msgs
            .splice(0..0, retried.iter().map(|s| &s.message));
    }

    /// The routed starts `report` left out, to park, with their messages.
    pub(super) fn held(&self, report: &IsolatedBatch) -> Vec<ParkedStart> {
        report
            .held
            .iter()
            .map(|&at| ParkedStart {
                message: self.routed_msgs[at].clone(),
                request: self.routed[at].clone(),
            })
            .collect()
    }
}

/// Classifies every message of the batch read from one of the input topics.
pub(super) fn sort<'m>(ctx: &IngressContext, batch: &'m [OwnedMessage]) -> Sorted<'m> {
    let mut sorted = Sorted {
        pending: Vec::with_capacity(batch.len()),
        pending_msgs: Vec::with_capacity(batch.len()),
        routed: Vec::new(),
        routed_msgs: Vec::new(),
        dead: Vec::new(),
    };
    for msg in batch {
        let Some(kind) = ctx.topic_kind(msg.topic()) else {
            continue;
        };
        let source = Source {
            topic: msg.topic().to_string(),
            partition: msg.partition(),
            offset: msg.offset(),
        };
        let payload = msg.payload().unwrap_or_default();
        let key = default_key(&source, header(msg, crate::contract::headers::REPLAY_ID));
        let received = Received {
            reference_ms: reached_kafka_ms(msg),
            default_key: &key,
        };
        let classified = classify_keyed(kind, payload, key.clone(), &ctx.limits).and_then(|c| {
            check_signature(
                &ctx.signatures,
                &c,
                payload,
                header(msg, crate::contract::signature::SIGNATURE),
                received,
            )?;
            Ok(c)
        });
        match classified {
            Ok(Classified::Routed(mut request)) => {
                request.source = Some(source);
                request.trace = trace_context(msg);
                sorted.routed.push(*request);
                sorted.routed_msgs.push(msg);
            }
            Ok(Classified::Input(input)) => {
                sorted.pending.push(PendingInput {
                    input,
                    source: Some(source),
                    trace: trace_context(msg),
                });
                sorted.pending_msgs.push(msg);
            }
            Err(error) => sorted.dead.push(DeadLetter {
                message: msg,
                stage: Stage::Decode,
                class: error.class.as_str().to_string(),
                error: error.message,
            }),
        }
    }
    sorted
}

/// When `msg` reached Kafka, for its signature's window: the broker's
/// append time where the topic keeps it (a copy produced later gets a
/// later one, a backlog keeps its own), else now.
fn reached_kafka_ms(msg: &OwnedMessage) -> i64 {
    match msg.timestamp() {
        rdkafka::Timestamp::LogAppendTime(ms) => ms,
        _ => chrono::Utc::now().timestamp_millis(),
    }
}

/// The first header `name` of a message, if it has one.
fn header<'m>(msg: &'m OwnedMessage, name: &str) -> Option<&'m [u8]> {
    use rdkafka::message::Headers;
    let headers = msg.headers()?;
    headers.iter().find(|h| h.key == name).and_then(|h| h.value)
}

/// The W3C trace context of a message's `traceparent` and `tracestate`
/// headers; `None` without a valid `traceparent` (the input is applied
/// untraced, never refused for it).
fn trace_context(msg: &OwnedMessage) -> Option<TraceContext> {
    use crate::contract::headers::{TRACEPARENT, TRACESTATE};
    use rdkafka::message::Headers;
    let headers = msg.headers()?;
    let values = |name: &'static str| {
        headers
            .iter()
            .filter(move |h| h.key == name)
            .filter_map(|h| h.value)
    };
    TraceContext::from_values(values(TRACEPARENT), values(TRACESTATE))
}

/// Counts what each input did, and dead-letters the rejected ones.
pub(super) fn settle_inputs<'m>(
    report: &IsolatedBatch,
    sorted: &mut Sorted<'m>,
    step: &mut StepReport,
) {
    let inputs = report.outcomes.iter().zip(&sorted.pending);
    for ((outcome, input), &msg) in inputs.zip(&sorted.pending_msgs) {
        let Some(outcome) = settled(outcome, msg, &mut sorted.dead) else {
            step.failed += 1;
            continue;
        };
        let label = input_label(outcome);
        step.count(label);
        metrics::counter!("ductor_inputs_total", "topic" => msg.topic().to_string(), "outcome" => label)
            .increment(1);
        match outcome {
            InputOutcome::Rejected(rejection) => {
                if rejection.class == RejectionClass::IdempotencyMismatch {
                    routing::count_mismatch(match input.input {
                        Input::Start(_) => MismatchPath::ClientStart,
                        _ => MismatchPath::Signal,
                    });
                }
                sorted.dead.push(DeadLetter {
                    message: msg,
                    stage: Stage::Validate,
                    class: rejection.class.as_str().to_string(),
                    error: rejection.message.clone(),
                });
            }
            InputOutcome::NoOp(reason) => {
                tracing::debug!(
                    run_id = input.input.run_id(),
                    reason = reason.as_str(),
                    "input changed nothing"
                );
            }
            InputOutcome::Applied { .. } => {}
        }
    }
}

/// The `outcome` label of an input's `ductor_inputs_total`.
fn input_label(outcome: &InputOutcome) -> &'static str {
    match outcome {
        InputOutcome::Applied { .. } => "applied",
        InputOutcome::NoOp(NoOpReason::StaleResult) => "stale",
        InputOutcome::NoOp(_) => "deduplicated",
        InputOutcome::Rejected(_) => "rejected",
    }
}

/// Counts what each routed start got, and dead-letters a key reused for
/// another request and a start the routing plane refused.
pub(super) fn settle_routed<'m>(
    report: &IsolatedBatch,
    sorted: &mut Sorted<'m>,
    step: &mut StepReport,
) {
    for (at, (outcome, &msg)) in report.routed.iter().zip(&sorted.routed_msgs).enumerate() {
        if report.held.binary_search(&at).is_ok() {
            continue;
        }
        let Some(outcome) = settled(outcome, msg, &mut sorted.dead) else {
            step.failed += 1;
            continue;
        };
        let (input_label, routing_label) = routed_labels(outcome);
        step.count(input_label);
        metrics::counter!("ductor_inputs_total", "topic" => msg.topic().to_string(), "outcome" => input_label)
            .increment(1);
        routing::count(routing_label);
        match outcome {
            RouteOutcome::Mismatch => sorted.dead.push(DeadLetter {
                message: msg,
                stage: Stage::Route,
                class: "idempotency_mismatch".to_string(),
                error: "the idempotency key was already used for a different request".to_string(),
            }),
            RouteOutcome::Rejected(message) => sorted.dead.push(DeadLetter {
                message: msg,
                stage: Stage::Validate,
                class: "unknown_workflow".to_string(),
                error: message.clone(),
            }),
            _ => {}
        }
    }
}

/// The `outcome` label of a routed start's `ductor_inputs_total` and its
/// routing outcome.
fn routed_labels(outcome: &RouteOutcome) -> (&'static str, &'static str) {
    match outcome {
        RouteOutcome::Decided { kind, .. } => ("applied", kind.as_str()),
        RouteOutcome::Duplicate { .. } => ("deduplicated", "duplicate"),
        RouteOutcome::Mismatch => ("rejected", "mismatch"),
        RouteOutcome::Rejected(_) => ("rejected", "rejected_request"),
        // Not produced inside a transaction that reserves for itself.
        RouteOutcome::ClaimLost => ("rejected", "in_progress"),
    }
}

/// The outcome of one input of an isolated batch, or `None` when it failed
/// on its own and its dead letter was queued in `dead`.
fn settled<'r, 'm, T>(
    outcome: &'r Option<Result<T, crate::apply::ApplyFailure>>,
    msg: &'m OwnedMessage,
    dead: &mut Vec<DeadLetter<'m>>,
) -> Option<&'r T> {
    match outcome {
        Some(Ok(outcome)) => Some(outcome),
        Some(Err(failure)) => {
            dead.push(DeadLetter::isolated(msg, failure));
            None
        }
        None => unreachable!("every input of an isolated batch has an outcome"),
    }
}
