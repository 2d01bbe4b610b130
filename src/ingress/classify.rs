//! Classifying a message read from an input topic: pure, total, and apart
//! from the loop that reads it. What it refuses goes to the dead-letter
//! topic with the error's class.

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
pub fn classify(
    kind: InputTopic,
    payload: &[u8],
    source: &Source,
    limits: &InputLimits,
) -> Result<Classified, InputError> {
    let value = parse_value(payload, limits)?;
    if kind == InputTopic::Requests {
        let default_key = format!(
            "kafka:{}:{}:{}",
            source.topic, source.partition, source.offset
        );
        if let Some(request) = routing::decode_route_request(&value, Some(default_key))? {
            bound_start(&request.start, payload.len(), limits)?;
            return Ok(Classified::Routed(Box::new(request)));
        }
    }
    let input = decode_value(kind, &value)?;
    bound_payload(input, payload.len(), limits).map(Classified::Input)
}

/// Checks the signature of a classified input where `policy` requires one:
/// a start of a listed pool, or any input from outside Ductor with
/// `all_inputs`. Ductor's own timers carry none and need none.
pub fn check_signature(
    policy: &SignaturesConfig,
    classified: &Classified,
    payload: &[u8],
    header: Option<&[u8]>,
) -> Result<(), InputError> {
    let (tenant, start_pool) = match classified {
        Classified::Routed(request) => (&request.start.tenant, Some(request.start.pool.as_str())),
        Classified::Input(Input::Start(start)) => (&start.tenant, Some(start.pool.as_str())),
        Classified::Input(Input::Timer(_)) => return Ok(()),
        Classified::Input(Input::Result(r)) => (&r.tenant, None),
        Classified::Input(Input::Signal(s)) => (&s.tenant, None),
        Classified::Input(Input::Cancel(c)) => (&c.tenant, None),
    };
    if !policy.required(start_pool) {
        return Ok(());
    }
    let refuse = |why: &str| Err(InputError::new(InputErrorClass::Unauthenticated, why));
    let Some(key) = policy.key(tenant) else {
        return refuse("the input's tenant has no signing key");
    };
    let Some(header) = header else {
        return refuse("the input is not signed (ductor-signature)");
    };
    if !signature::verify(key, payload, header) {
        return refuse("ductor-signature does not match the input and its tenant's key");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SigningKey;

    const START: &[u8] = br#"{"type":"run.start","schema_version":1,"run_id":"r1","tenant":"acme","workflow":"example","pool":"payments"}"#;
    const SIGNAL: &[u8] = br#"{"type":"wakeup.signal","schema_version":1,"run_id":"r1","tenant":"acme","signal_id":"s1","name":"poke","payload":null}"#;
    const TIMER: &[u8] = br#"{"type":"wakeup.timer","schema_version":1,"run_id":"r1","tenant":"acme","timer":"timeout","stamp":"6f1d9a1c-7a43-4c5e-9a55-0d1f1c1b2a3e"}"#;

    fn policy(pools: &[&str], all_inputs: bool) -> SignaturesConfig {
        SignaturesConfig {
            pools: pools.iter().map(|p| p.to_string()).collect(),
            all_inputs,
            tenant_keys: [("acme".to_string(), SigningKey("acme-key-0123456789".into()))].into(),
        }
    }

    fn classified(kind: InputTopic, payload: &[u8]) -> Classified {
        let source = Source {
            topic: "t".into(),
            partition: 0,
            offset: 0,
        };
        classify(kind, payload, &source, &InputLimits::sized(1 << 20)).expect("a valid input")
    }

    fn class(result: Result<(), InputError>) -> Option<&'static str> {
        result.err().map(|e| e.class.as_str())
    }

    #[test]
    fn a_start_of_a_listed_pool_needs_its_tenants_signature() {
        let start = classified(InputTopic::Requests, START);
        let good = signature::sign(b"acme-key-0123456789", START);
        let wrong = signature::sign(b"someone-elses-key", START);
        let payments = policy(&["payments"], false);
        assert_eq!(
            class(check_signature(
                &payments,
                &start,
                START,
                Some(good.as_bytes())
            )),
            None
        );
        for header in [None, Some(wrong.as_bytes()), Some(&b"v1=00"[..])] {
            assert_eq!(
                class(check_signature(&payments, &start, START, header)),
                Some("unauthenticated")
            );
        }
        assert_eq!(
            class(check_signature(
                &policy(&["other"], false),
                &start,
                START,
                None
            )),
            None
        );
    }

    #[test]
    fn with_all_inputs_every_input_from_outside_needs_one_and_timers_none() {
        let all = policy(&[], true);
        let signal = classified(InputTopic::Wakeups, SIGNAL);
        assert_eq!(
            class(check_signature(&all, &signal, SIGNAL, None)),
            Some("unauthenticated")
        );
        let good = signature::sign(b"acme-key-0123456789", SIGNAL);
        assert_eq!(
            class(check_signature(
                &all,
                &signal,
                SIGNAL,
                Some(good.as_bytes())
            )),
            None
        );
        // Signed for another payload: the signature covers the value.
        assert_eq!(
            class(check_signature(
                &all,
                &signal,
                SIGNAL,
                Some(signature::sign(b"acme-key-0123456789", START).as_bytes())
            )),
            Some("unauthenticated")
        );
        let timer = classified(InputTopic::Wakeups, TIMER);
        assert_eq!(class(check_signature(&all, &timer, TIMER, None)), None);
        assert_eq!(
            class(check_signature(&policy(&[], false), &signal, SIGNAL, None)),
            None
        );
    }

    #[test]
    fn a_tenant_without_a_key_cannot_sign() {
        let mut all = policy(&[], true);
        all.tenant_keys.clear();
        let signal = classified(InputTopic::Wakeups, SIGNAL);
        let signed = signature::sign(b"acme-key-0123456789", SIGNAL);
        assert_eq!(
            class(check_signature(
                &all,
                &signal,
                SIGNAL,
                Some(signed.as_bytes())
            )),
            Some("unauthenticated")
        );
    }
}
