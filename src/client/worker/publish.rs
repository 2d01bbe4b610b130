//! Publishing a result: one `attempt.result` to the coordinator's input topic.
//!
//! In: the result's bytes, its run and tenant, and the trace context it
//! continues. Out: `Ok` once the broker has acknowledged the record, or an
//! error once shutdown has begun. Guarantees: the record is keyed by
//! `run_id` (one run's results keep their order on one partition), signed
//! when the tenant has a signing key, and carries the trace context of the
//! attempt's handler when its dispatch had one; it goes out without linger
//! when no other result of the worker is in flight (see
//! [`PromptProducer`](crate::infra::prompt_producer::PromptProducer)); retries back off between
//! [`PUBLISH_RETRY_MIN`] and [`PUBLISH_RETRY_MAX`] and stop at shutdown,
//! never sooner.

use std::time::Duration;

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;

use super::Shared;
use crate::contract::TraceContext;

/// Backoff bounds of result publishing.
const PUBLISH_RETRY_MIN: Duration = Duration::from_millis(100);
const PUBLISH_RETRY_MAX: Duration = Duration::from_secs(5);

/// Publishes keyed by `run_id` and waits for the broker's acknowledgement;
/// retries with capped backoff until it succeeds or shutdown begins.
pub(super) async fn publish<F>(
    shared: &Shared<F>,
    run_id: &str,
    tenant: &str,
    payload: &[u8],
    trace: Option<&TraceContext>,
) -> anyhow::Result<()> {
    let mut headers = OwnedHeaders::new().insert(Header {
        key: crate::contract::headers::CONTENT_TYPE,
        value: Some("application/json"),
    });
    for (key, value) in trace.into_iter().flat_map(TraceContext::headers) {
        headers = headers.insert(Header {
            key,
            value: Some(value.as_str()),
        });
    }
    if let Some(key) = shared.signatures.key(tenant) {
        // Signed once: a retry of the same record carries the same time,
        // well within the window (retries stop at the publish timeout).
        let signed_at_ms = chrono::Utc::now().timestamp_millis();
        let signature = crate::contract::signature::sign(key, payload, signed_at_ms);
        headers = headers.insert(Header {
            key: crate::contract::signature::SIGNATURE,
            value: Some(signature.as_str()),
        });
    }
    let send = || async {
        let turn = shared.prompt.as_ref().map(|p| p.enter(1));
        if let Some(prompt) =
            (shared.prompt.as_ref()).filter(|_| turn.as_ref().is_some_and(|t| t.prompt))
        {
            return prompt
                .send(
                    &shared.results_topic,
                    run_id.as_bytes(),
                    payload,
                    headers.clone(),
                )
                .await;
        }
        let record = FutureRecord::to(&shared.results_topic)
            .key(run_id)
            .payload(payload)
            .headers(headers.clone());
        shared
            .producer
            .send(record, Timeout::After(shared.publish_timeout))
            .await
            .map_err(|(e, _)| e)
    };
    send.retry(
        ExponentialBuilder::default()
            .with_min_delay(PUBLISH_RETRY_MIN)
            .with_max_delay(PUBLISH_RETRY_MAX)
            .without_max_times(),
    )
    .when(|_| !shared.shutdown.is_cancelled())
    .notify(|e, after| {
        tracing::warn!(error = %e, retry_in_ms = after.as_millis() as u64, "publishing step result failed, retrying")
    })
    .await
    .context("publishing step result")?;
    Ok(())
}
