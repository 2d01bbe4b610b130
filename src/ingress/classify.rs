//! Classifying a message read from an input topic: pure, total, and apart
//! from the loop that reads it. What it refuses goes to the dead-letter
//! topic with the error's class.

use crate::contract::{
    Input, InputError, InputLimits, InputTopic, Source, bound_payload, bound_start, decode_value,
    parse_value,
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
