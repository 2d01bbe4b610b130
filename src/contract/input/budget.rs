//! The size budget of what an input carries into effects.
//!
//! In: a decoded input, the length it was sent with, and the
//! [`InputLimits`]. Out: the input, or a step output too large turned into a
//! failure of its attempt, or a refusal (`payload_too_large`). Guarantees: no
//! effect is committed that could never be published, since what Ductor
//! writes back of a value (a run's input, a step's output, a signal's
//! payload) fits `max_payload_bytes`. Pure: no broker, no clock; the checker
//! applies it as the ingress does.

use super::{AttemptOutcome, Input, InputError, InputErrorClass, InputLimits, RunStart};

/// How much longer a value can get when it is written back than it was
/// sent: only numbers grow (`9e15` is written `9000000000000000.0`), by at
/// most this factor. A value sent shorter than the payload limit divided by
/// it cannot outgrow the limit, and is not measured.
const MAX_REENCODING_GROWTH: usize = 5;

/// Applies the size budget to what an input carries into effects, so
/// that no effect is committed that could never be published. `sent` is
/// the length of the message. A start whose input, or a signal whose
/// payload, would be too large is refused (`payload_too_large`); a step
/// output that would be too large becomes a failure of the attempt, for
/// good, that says so: the step fails instead of its run stalling behind
/// an effect nobody can publish. Pure: the checker applies it as the
/// ingress does.
pub fn bound_payload(input: Input, sent: usize, limits: &InputLimits) -> Result<Input, InputError> {
    let max = limits.max_payload_bytes;
    if sent.saturating_mul(MAX_REENCODING_GROWTH) <= max {
        return Ok(input);
    }
    let too_large = |what: &str, len: usize| {
        format!("{what} is {len} bytes once written back, over the limit of {max}")
    };
    match input {
        Input::Start(ref start) => bound_start(start, sent, limits).map(|()| input),
        Input::Signal(ref signal) if encoded_len(&signal.payload) > max => Err(InputError::new(
            InputErrorClass::PayloadTooLarge,
            too_large("payload", encoded_len(&signal.payload)),
        )),
        Input::Result(mut result) => {
            if let AttemptOutcome::Succeeded { output } = &result.outcome {
                let len = encoded_len(output);
                if len > max {
                    result.outcome = AttemptOutcome::Failed {
                        message: format!(
                            "payload_too_large: the step's output is {len} bytes once written \
                             back, over the limit of {max}"
                        ),
                        retryable: false,
                    };
                }
            }
            Ok(Input::Result(result))
        }
        other => Ok(other),
    }
}

/// [`bound_payload`] for a start: `Err` when its input would not fit the
/// dispatch that carries it.
pub fn bound_start(start: &RunStart, sent: usize, limits: &InputLimits) -> Result<(), InputError> {
    let max = limits.max_payload_bytes;
    if sent.saturating_mul(MAX_REENCODING_GROWTH) <= max {
        return Ok(());
    }
    let len = encoded_len(&start.input);
    if len > max {
        return Err(InputError::new(
            InputErrorClass::PayloadTooLarge,
            format!("input is {len} bytes once written back, over the limit of {max}"),
        ));
    }
    Ok(())
}

/// The length of `value` as `serde_json` writes it, without writing it.
pub(crate) fn encoded_len<T: serde::Serialize + ?Sized>(value: &T) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a Value, or a run state, to a sink that never fails cannot
    // fail: neither has a map with keys that are not strings.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}
