//! Classifying a message read from an input topic: pure, total, and apart
//! from the loop that reads it. What it refuses goes to the dead-letter
//! topic with the error's class.
//!
//! In: a message's value, the kind of topic it was read from, its position
//! and signature header, the input bounds and the signature policy. Out: a
//! [`Classified`] input or routed start, or an [`InputError`] with its
//! class. Guarantees: it never panics, whatever the bytes; what it passes
//! keeps the size and shape bounds; a start that names neither its run nor
//! a key is keyed by its Kafka position (an operator's replay by its replay
//! id), so a redelivery is never a second run; an input the policy wants
//! signed passes only if its tenant's key verifies it within the window.

use crate::config::SignaturesConfig;
use crate::contract::signature;
use crate::contract::{
    Input, InputError, InputErrorClass, InputLimits, InputTopic, Source, bound_payload,
    bound_start, decode_value, parse_value,
};
use crate::routing;

/// What a message on an input topic is.
#[derive(Debug)]
pub enum Classified {
    /// A start without `run_id`: the routing plane decides its run.
    Routed(Box<routing::RouteRequest>),
    Input(Input),
}

/// Decodes one message read from an input topic of `kind`: pure, and
/// never panics. A start without `run_id` and without a key of its own is
/// keyed by its position in Kafka, so a redelivery is never a second run.
#[cfg(any(test, feature = "internals"))]
pub fn classify(
    kind: InputTopic,
    payload: &[u8],
    source: &Source,
    limits: &InputLimits,
) -> Result<Classified, InputError> {
    classify_keyed(kind, payload, default_key(source, None), limits)
}

/// [`classify`], a start that names no key of its own keyed by
/// `default_key` ([`default_key`]).
pub fn classify_keyed(
    kind: InputTopic,
    payload: &[u8],
    default_key: String,
    limits: &InputLimits,
) -> Result<Classified, InputError> {
    let value = parse_value(payload, limits)?;
    if kind == InputTopic::Requests
        && let Some(request) = routing::decode_route_request(&value, Some(default_key))?
    {
        bound_start(&request.start, payload.len(), limits)?;
        return Ok(Classified::Routed(Box::new(request)));
    }
    let input = decode_value(kind, &value)?;
    bound_payload(input, payload.len(), limits).map(Classified::Input)
}

/// Where a message's signature is checked against: when it reached
/// Kafka (`reference_ms`, Unix ms), and the key a start that names none
/// gets ([`default_key`]).
#[derive(Debug, Clone, Copy)]
pub struct Received<'a> {
    pub reference_ms: i64,
    pub default_key: &'a str,
}

/// Checks the signature of a classified input where `policy` requires one:
/// a start of a listed pool, or any input from outside Ductor with
/// `all_inputs`; and, once serve has a timer key, every timer. A signed
/// start must name its run or carry an idempotency key, so that a replay
/// within the window finds its decision instead of making another run.
pub fn check_signature(
    policy: &SignaturesConfig,
    classified: &Classified,
    payload: &[u8],
    header: Option<&[u8]>,
    received: Received<'_>,
) -> Result<(), InputError> {
    let refuse = |why: &str| Err(InputError::new(InputErrorClass::Unauthenticated, why));
    if let Some(verdict) = own_input(policy, classified, payload, header) {
        return verdict;
    }
    let (tenant, start_pool) = match classified {
        Classified::Routed(request) => (&request.start.tenant, Some(request.start.pool.as_str())),
        Classified::Input(Input::Start(start)) => (&start.tenant, Some(start.pool.as_str())),
        Classified::Input(Input::Timer(_)) => {
            return match (policy.timer_key(), header) {
                (None, _) => Ok(()),
                (Some(key), Some(header)) if signature::verify_timer(key, payload, header) => {
                    Ok(())
                }
                (Some(_), _) => refuse(
                    "a timer must carry serve's own signature (signatures.timer_key): only serve \
                     writes timers",
                ),
            };
        }
        Classified::Input(Input::Result(r)) => (&r.tenant, None),
        Classified::Input(Input::Signal(s)) => (&s.tenant, None),
        Classified::Input(Input::Cancel(c)) => (&c.tenant, None),
        Classified::Input(Input::Retry(r)) => (&r.tenant, None),
    };
    if !policy.required(start_pool) {
        return Ok(());
    }
    let Some(key) = policy.key(tenant) else {
        return refuse("the input's tenant has no signing key");
    };
    let Some(header) = header else {
        return refuse("the input is not signed (ductor-signature)");
    };
    signature::verify(
        key,
        payload,
        header,
        received.reference_ms,
        policy.max_age_ms,
    )
    .map_err(|why| InputError::new(InputErrorClass::Unauthenticated, why.message()))?;
    if let Classified::Routed(request) = classified
        && request
            .key
            .as_deref()
            .is_none_or(|key| key == received.default_key)
    {
        return refuse(
            "a signed run.start must carry an idempotency_key or a run_id: without one, each \
             copy of it would start another run",
        );
    }
    Ok(())
}

/// The verdict on what only serve sends, where it has a timer key: a
/// child run's start passes with serve's signature alone; a result or a
/// cancel with it passes (a child's answer, a parent's cancel), and
/// without it is judged as any other. `None`: judged as any other.
fn own_input(
    policy: &SignaturesConfig,
    classified: &Classified,
    payload: &[u8],
    header: Option<&[u8]>,
) -> Option<Result<(), InputError>> {
    let key = policy.timer_key()?;
    let own = header.is_some_and(|header| signature::verify_timer(key, payload, header));
    let child_start = match classified {
        Classified::Routed(request) => request.start.parent.is_some(),
        Classified::Input(Input::Start(start)) => start.parent.is_some(),
        _ => false,
    };
    if child_start {
        return Some(if own {
            Ok(())
        } else {
            Err(InputError::new(
                InputErrorClass::Unauthenticated,
                "a run.start naming a parent must carry serve's own signature \
                 (signatures.timer_key): only serve starts child runs",
            ))
        });
    }
    let answer = matches!(
        classified,
        Classified::Input(Input::Result(_) | Input::Cancel(_))
    );
    (answer && own).then_some(Ok(()))
}

/// The idempotency key of a Kafka start that names none: its position;
/// or, for an operator's replay (`replay_id`, the [`REPLAY_ID`] header, a
/// UUID), the replay's id, which every copy of that replay shares, so that
/// a replay produced twice (a crash before it was recorded, two operators
/// at once) still makes one run. A header that is no UUID is ignored.
///
/// [`REPLAY_ID`]: crate::contract::headers::REPLAY_ID
pub fn default_key(source: &Source, replay_id: Option<&[u8]>) -> String {
    let replay = replay_id
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| uuid::Uuid::parse_str(v).ok());
    match replay {
        Some(id) => format!("replay:{id}"),
        None => format!(
            "kafka:{}:{}:{}",
            source.topic, source.partition, source.offset
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SigningKey;

    const START: &[u8] = br#"{"type":"run.start","schema_version":1,"run_id":"r1","tenant":"acme","workflow":"example","pool":"payments"}"#;
    const ROUTED: &[u8] = br#"{"type":"run.start","schema_version":1,"tenant":"acme","workflow":"example","pool":"payments"}"#;
    const KEYED: &[u8] = br#"{"type":"run.start","schema_version":1,"idempotency_key":"order-7","tenant":"acme","workflow":"example","pool":"payments"}"#;
    const OPTED_OUT: &[u8] = br#"{"type":"run.start","schema_version":1,"idempotency_key":"","tenant":"acme","workflow":"example","pool":"payments"}"#;
    const SIGNAL: &[u8] = br#"{"type":"wakeup.signal","schema_version":1,"run_id":"r1","tenant":"acme","signal_id":"s1","name":"poke","payload":null}"#;
    const TIMER: &[u8] = br#"{"type":"wakeup.timer","schema_version":1,"run_id":"r1","tenant":"acme","timer":"timeout","stamp":"6f1d9a1c-7a43-4c5e-9a55-0d1f1c1b2a3e"}"#;
    const KEY: &[u8] = b"acme-key-0123456789";
    const AT: i64 = 1_800_000_000_000;

    fn policy(pools: &[&str], all_inputs: bool) -> SignaturesConfig {
        SignaturesConfig {
            pools: pools.iter().map(|p| p.to_string()).collect(),
            all_inputs,
            tenant_keys: [("acme".to_string(), SigningKey("acme-key-0123456789".into()))].into(),
            max_age_ms: 300_000,
            timer_key: None,
        }
    }

    fn source() -> Source {
        Source {
            topic: "t".into(),
            partition: 0,
            offset: 0,
        }
    }

    fn classified(kind: InputTopic, payload: &[u8]) -> Classified {
        classify(kind, payload, &source(), &InputLimits::sized(1 << 20)).expect("a valid input")
    }

    /// The verdict on `payload` with `header`, read at `AT`.
    fn check(
        policy: &SignaturesConfig,
        kind: InputTopic,
        payload: &[u8],
        header: Option<&str>,
    ) -> Option<&'static str> {
        let key = default_key(&source(), None);
        let received = Received {
            reference_ms: AT,
            default_key: &key,
        };
        let input = classified(kind, payload);
        check_signature(policy, &input, payload, header.map(str::as_bytes), received)
            .err()
            .map(|e| e.class.as_str())
    }

    #[test]
    fn a_start_of_a_listed_pool_needs_its_tenants_signature() {
        let good = signature::sign(KEY, START, AT);
        let wrong = signature::sign(b"someone-elses-key", START, AT);
        let untimed = signature::sign_timer(KEY, START);
        let payments = policy(&["payments"], false);
        let requests = InputTopic::Requests;
        assert_eq!(check(&payments, requests, START, Some(&good)), None);
        for header in [
            None,
            Some(wrong.as_str()),
            Some(untimed.as_str()),
            Some("v1=00"),
        ] {
            assert_eq!(
                check(&payments, requests, START, header),
                Some("unauthenticated"),
                "{header:?}"
            );
        }
        assert_eq!(
            check(&policy(&["other"], false), requests, START, None),
            None
        );
    }

    #[test]
    fn a_signature_older_than_the_window_is_refused() {
        let payments = policy(&["payments"], false);
        let fresh = signature::sign(KEY, START, AT - 299_000);
        let stale = signature::sign(KEY, START, AT - 301_000);
        let ahead = signature::sign(KEY, START, AT + 301_000);
        let requests = InputTopic::Requests;
        assert_eq!(check(&payments, requests, START, Some(&fresh)), None);
        assert_eq!(
            check(&payments, requests, START, Some(&stale)),
            Some("unauthenticated")
        );
        assert_eq!(
            check(&payments, requests, START, Some(&ahead)),
            Some("unauthenticated")
        );
    }

    #[test]
    fn a_signed_start_must_name_its_run_or_its_idempotency_key() {
        let payments = policy(&["payments"], false);
        let requests = InputTopic::Requests;
        let sign = |payload: &[u8]| signature::sign(KEY, payload, AT);
        assert_eq!(
            check(&payments, requests, ROUTED, Some(&sign(ROUTED))),
            Some("unauthenticated"),
            "keyed by its offset, each copy would be another run"
        );
        assert_eq!(
            check(&payments, requests, OPTED_OUT, Some(&sign(OPTED_OUT))),
            Some("unauthenticated"),
            "an empty key opts out of deduplication"
        );
        assert_eq!(check(&payments, requests, KEYED, Some(&sign(KEYED))), None);
        assert_eq!(check(&payments, requests, START, Some(&sign(START))), None);
        // Unsigned where no signature is required: today's rules.
        assert_eq!(check(&policy(&[], false), requests, ROUTED, None), None);
    }

    #[test]
    fn with_all_inputs_every_input_from_outside_needs_one() {
        let all = policy(&[], true);
        let wakeups = InputTopic::Wakeups;
        assert_eq!(check(&all, wakeups, SIGNAL, None), Some("unauthenticated"));
        let good = signature::sign(KEY, SIGNAL, AT);
        assert_eq!(check(&all, wakeups, SIGNAL, Some(&good)), None);
        // Signed for another payload: the signature covers the value.
        let other = signature::sign(KEY, START, AT);
        assert_eq!(
            check(&all, wakeups, SIGNAL, Some(&other)),
            Some("unauthenticated")
        );
        assert_eq!(check(&policy(&[], false), wakeups, SIGNAL, None), None);
    }

    #[test]
    fn with_a_timer_key_a_timer_needs_serve_s_signature() {
        let wakeups = InputTopic::Wakeups;
        assert_eq!(check(&policy(&[], false), wakeups, TIMER, None), None);
        let mut serve = policy(&[], true);
        serve.timer_key = Some(SigningKey("serve-timer-key-0123456789".into()));
        let signed = signature::sign_timer(b"serve-timer-key-0123456789", TIMER);
        assert_eq!(check(&serve, wakeups, TIMER, Some(&signed)), None);
        // A writer of signals holds a tenant's key, not serve's.
        let forged = signature::sign_timer(KEY, TIMER);
        let tenant_signed = signature::sign(KEY, TIMER, AT);
        for header in [None, Some(forged.as_str()), Some(tenant_signed.as_str())] {
            assert_eq!(
                check(&serve, wakeups, TIMER, header),
                Some("unauthenticated"),
                "{header:?}"
            );
        }
    }

    const CHILD: &[u8] = br#"{"type":"run.start","schema_version":1,"idempotency_key":"r1/step/1/child/1","tenant":"acme","workflow":"example","pool":"payments","parent":{"run_id":"r1","stamp":"6f1d9a1c-7a43-4c5e-9a55-0d1f1c1b2a3e"}}"#;
    const RESULT: &[u8] = br#"{"type":"attempt.result","schema_version":1,"run_id":"r1","tenant":"acme","stamp":"6f1d9a1c-7a43-4c5e-9a55-0d1f1c1b2a3e","outcome":"succeeded","output":1}"#;
    const CANCEL: &[u8] = br#"{"type":"wakeup.cancel","schema_version":1,"run_id":"6f1d9a1c-7a43-4c5e-9a55-0d1f1c1b2a3e","tenant":"acme"}"#;

    #[test]
    fn with_a_timer_key_only_serve_starts_child_runs_and_answers_for_them() {
        const SERVE_KEY: &[u8] = b"serve-timer-key-0123456789";
        let (requests, results) = (InputTopic::Requests, InputTopic::AttemptResults);
        // Without a timer key, a child's start is any start.
        assert_eq!(check(&policy(&[], false), requests, CHILD, None), None);
        let mut serve = policy(&["payments"], true);
        serve.timer_key = Some(SigningKey("serve-timer-key-0123456789".into()));
        let own = |payload: &[u8]| signature::sign_timer(SERVE_KEY, payload);
        assert_eq!(check(&serve, requests, CHILD, Some(&own(CHILD))), None);
        // A tenant cannot start a run that answers another run's attempt.
        let tenant_signed = signature::sign(KEY, CHILD, AT);
        for header in [None, Some(tenant_signed.as_str())] {
            assert_eq!(
                check(&serve, requests, CHILD, header),
                Some("unauthenticated"),
                "{header:?}"
            );
        }
        // A child's answer and a parent's cancel pass with serve's
        // signature, and with the tenant's as before.
        assert_eq!(check(&serve, results, RESULT, Some(&own(RESULT))), None);
        assert_eq!(check(&serve, requests, CANCEL, Some(&own(CANCEL))), None);
        let tenant_result = signature::sign(KEY, RESULT, AT);
        assert_eq!(check(&serve, results, RESULT, Some(&tenant_result)), None);
        assert_eq!(
            check(&serve, results, RESULT, None),
            Some("unauthenticated")
        );
        let forged = signature::sign_timer(KEY, RESULT);
        assert_eq!(
            check(&serve, results, RESULT, Some(&forged)),
            Some("unauthenticated")
        );
    }

    #[test]
    fn a_replayed_start_is_keyed_by_its_replay_id_and_still_refused_signed() {
        let replay = b"0b7f1f5e-51c4-4c8e-9d3a-6a1f0f2b9c11";
        let at = source();
        assert_eq!(
            default_key(&at, Some(replay)),
            "replay:0b7f1f5e-51c4-4c8e-9d3a-6a1f0f2b9c11"
        );
        for garbage in [&b"not-a-uuid"[..], b"", b"\xff"] {
            assert_eq!(default_key(&at, Some(garbage)), "kafka:t:0:0");
        }
        let key = default_key(&at, Some(replay));
        let limits = InputLimits::sized(1 << 20);
        let Ok(Classified::Routed(request)) =
            classify_keyed(InputTopic::Requests, ROUTED, key.clone(), &limits)
        else {
            panic!("a routed start");
        };
        assert_eq!(request.key.as_deref(), Some(key.as_str()));
        // Signed, a start keyed by no key of its own is refused, replay or
        // not: the header is not signed, so each copy could name another.
        let received = Received {
            reference_ms: AT,
            default_key: &key,
        };
        let classified = Classified::Routed(request);
        let signed = signature::sign(KEY, ROUTED, AT);
        let verdict = check_signature(
            &policy(&["payments"], false),
            &classified,
            ROUTED,
            Some(signed.as_bytes()),
            received,
        );
        assert_eq!(verdict.unwrap_err().class, InputErrorClass::Unauthenticated);
    }

    #[test]
    fn a_tenant_without_a_key_cannot_sign() {
        let mut all = policy(&[], true);
        all.tenant_keys.clear();
        let signed = signature::sign(KEY, SIGNAL, AT);
        assert_eq!(
            check(&all, InputTopic::Wakeups, SIGNAL, Some(&signed)),
            Some("unauthenticated")
        );
    }
}
