//! The spans of a run's trace, and the context each hop hands on.
//!
//! Every span Ductor makes for a trace has the target [`TARGET`]: the
//! ingress's batch, an apply, the fold of each input, the publish of each
//! effect, an API request and a worker's handler. Only the OTLP exporter
//! listens to that target ([`super::telemetry`]); the log never does. With
//! the exporter off nothing does, so such a span is a disabled callsite
//! that costs a load and a branch, and the context of a hop is its
//! parent's with a fresh random span id.
//!
//! In: a span of [`TARGET`] and the context it continues (an input's, a
//! run's). Out: the context its effects carry ([`hop`]). Guarantees: a hop
//! keeps its parent's trace id; without a parent it starts a trace only
//! when the exporter records the span, so that an untraced run stays
//! untraced (and its effects without trace headers) while nothing would
//! record its spans.

use opentelemetry::trace::{SpanContext, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::contract::TraceContext;
use crate::contract::trace::FLAG_SAMPLED;

/// The target of every span of a run's trace.
pub const TARGET: &str = "ductor::traces";

/// The context the next hop of `span` carries on: `span`, continuing
/// `parent`. With the exporter recording `span`, its parent is set to
/// `parent` (a root without one) and the context is the span's own;
/// otherwise it is `parent`'s with a random span id, or `None`.
pub fn hop(span: &tracing::Span, parent: Option<&TraceContext>) -> Option<TraceContext> {
    if span.is_disabled() {
        return parent.map(|p| p.child(random_span_id()));
    }
    // Without a parent of its own the span is a root, whatever span
    // encloses it in this process: a run's trace is the run's.
    let cx = parent.map_or_else(opentelemetry::Context::new, remote);
    let _ = span.set_parent(cx);
    let otel = span.context();
    let own = otel.span().span_context().clone();
    if !own.is_valid() {
        return parent.map(|p| p.child(random_span_id()));
    }
    Some(TraceContext {
        trace_id: own.trace_id().to_bytes(),
        span_id: own.span_id().to_bytes(),
        flags: own.trace_flags().to_u8(),
        tracestate: parent.and_then(|p| p.tracestate.clone()),
    })
}

/// Makes `parent` the parent of `span` when the exporter records it; the
/// span then belongs to `parent`'s trace. Nothing without one.
pub fn continue_from(span: &tracing::Span, parent: Option<&TraceContext>) {
    if let Some(parent) = parent
        && !span.is_disabled()
    {
        let _ = span.set_parent(remote(parent));
    }
}

/// Links `span` to `other`, a trace it does not belong to (an input of a
/// run that came with a trace of its own).
pub fn link(span: &tracing::Span, other: &TraceContext) {
    if !span.is_disabled() {
        span.add_link(span_context(other));
    }
}

/// `parent` as a remote OpenTelemetry context.
fn remote(parent: &TraceContext) -> opentelemetry::Context {
    opentelemetry::Context::new().with_remote_span_context(span_context(parent))
}

fn span_context(cx: &TraceContext) -> SpanContext {
    let state = cx
        .tracestate
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    SpanContext::new(
        TraceId::from_bytes(cx.trace_id),
        opentelemetry::trace::SpanId::from_bytes(cx.span_id),
        TraceFlags::new(cx.flags & FLAG_SAMPLED),
        true,
        state,
    )
}

/// A span id for a hop no exporter records: random, never zero.
pub fn random_span_id() -> [u8; 8] {
    loop {
        let id: u64 = rand::random();
        if id != 0 {
            return id.to_be_bytes();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_exporter_a_hop_keeps_the_trace_and_changes_the_span() {
        let parent = TraceContext::from_values(
            [&b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"[..]],
            [&b"a=1"[..]],
        )
        .unwrap();
        let span = tracing::info_span!(target: TARGET, "fold");
        let child = hop(&span, Some(&parent)).expect("a traced parent has a traced hop");
        assert_eq!(child.trace_id, parent.trace_id);
        assert_ne!(child.span_id, parent.span_id);
        assert_eq!(child.flags, parent.flags);
        assert_eq!(child.tracestate, parent.tracestate);
        assert_eq!(hop(&span, None), None, "untraced stays untraced");
    }
}
