//! `ductor serve`: the long-running process. Every task hangs off one root
//! cancellation token and one tracker, so shutdown waits for all of them.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::BaseConsumer;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::infra::health::{HttpState, router};

/// Runs until `shutdown` is cancelled, then lets in-flight work finish within
/// `server.shutdown_grace_ms`.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .with_context(|| format!("binding http listener on {}", config.server.listen))?;
    run_on(config, listener, shutdown).await
}

/// Refuses to start when a topic takes smaller records than Ductor may
/// send. A broker that does not answer in time is no reason to stay down
/// (the ingress waits for it like any client): the check is then skipped,
/// with a warning.
async fn check_topic_limits(config: &Config) -> anyhow::Result<()> {
    let mut kafka = config.kafka.clone();
    kafka.admin_timeout_ms = kafka.admin_timeout_ms.min(TOPIC_CHECK_TIMEOUT_MS);
    match crate::infra::kafka::topics_below_limit(&kafka, &config.all_topics()).await {
        Ok(small) if small.is_empty() => Ok(()),
        Ok(small) => Err(crate::infra::kafka::limits_error(&config.kafka, &small)),
        Err(e) => {
            tracing::warn!(error = format!("{e:#}"), "topic limits not checked");
            Ok(())
        }
    }
}

/// How long `serve` waits at start-up for the topics' limits.
const TOPIC_CHECK_TIMEOUT_MS: u64 = 10_000;

/// [`run`] on an already bound listener (tests bind port 0 and read it back).
pub async fn run_on(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let workflows = crate::infra::workflows::load_dir(&config.coordinator.workflows_dir)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    tracing::info!(
        workflows = workflows.iter().count(),
        dir = %config.coordinator.workflows_dir.display(),
        "workflow definitions loaded"
    );
    check_topic_limits(&config).await?;
    let pool = crate::infra::db::connect(&config.database).await?;
    if config.database.migrate_on_start {
        crate::infra::db::migrate(&pool).await?;
        tracing::info!("database migrations applied");
    }
    crate::infra::telemetry::metrics_handle();

    let tracker = TaskTracker::new();
    // A task that fails cancels everything: the process should stop rather
    // than run without, say, its ingress.
    let failed = Arc::new(std::sync::Mutex::new(None::<anyhow::Error>));

    let kafka_probe: BaseConsumer = crate::infra::kafka::consumer_config(
        &config.kafka,
        &format!("{}-probe", config.kafka.group_id),
        "probe",
    )
    .create()
    .context("creating kafka probe client")?;
    let progress = Arc::new(crate::ingress::Progress::new(
        config.coordinator.apply_lanes,
        Duration::from_millis(config.coordinator.stall_after_ms),
    ));
    let http_state = HttpState {
        pool: pool.clone(),
        kafka_probe: Arc::new(kafka_probe),
        readiness_timeout: Duration::from_millis(config.server.readiness_timeout_ms),
        ingress: Some(progress.clone()),
    };
    {
        let (progress, shutdown) = (progress.clone(), shutdown.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => {
                        progress.observe();
                        crate::infra::telemetry::observe_process();
                    }
                }
            }
        });
    }
    let wakeup = crate::outbox::Wakeup::default();
    // The drainer runs in this process: the apply layer hands it the
    // intents it may publish at once (its fast lane).
    let drainer = if config.drainer.enabled {
        let producer = crate::infra::kafka::producer(&config.kafka, "drainer")?;
        let drainer = crate::outbox::Drainer::new(
            pool.clone(),
            producer,
            config.drainer.clone(),
            Duration::from_millis(config.kafka.delivery_timeout_ms),
        )
        .with_solo_producer(crate::infra::kafka::producer(
            &config.kafka,
            "drainer-solo",
        )?)
        .with_results_frontier(results_frontier(&config, &tracker, &wakeup, &shutdown))
        .with_parked_notices(config.events_topic());
        let (handoff, lane) = drainer.fast_lane(&wakeup);
        Some((drainer, handoff, lane))
    } else {
        None
    };
    let handoff = drainer.as_ref().map(|(_, handoff, _)| handoff.clone());
    let mut api_applier = crate::apply::Applier::new(&config, pool.clone(), workflows.clone());
    api_applier.handoff = handoff.clone();
    let api_state = crate::routing::http::ApiState {
        applier: Arc::new(api_applier),
        routing: config.routing.clone(),
        limits: config.input_limits(),
        wakeup: handoff.is_none().then(|| wakeup.clone()),
    };
    let addr = listener
        .local_addr()
        .context("reading the http listener's address")?;
    tracing::info!(%addr, "http listening");
    {
        let shutdown = shutdown.clone();
        let failed = failed.clone();
        tracker.spawn(async move {
            let app = router(http_state).merge(crate::routing::http::router(api_state));
            let result = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.clone().cancelled_owned())
                .await;
            if let Err(e) = result {
                record_failure(&failed, anyhow::Error::new(e).context("http server"));
                shutdown.cancel();
            }
        });
    }

    {
        let pool = pool.clone();
        let routing = config.routing.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move { routing_maintenance(pool, routing, shutdown).await });
    }

    if let Some((drainer, own_handoff, lane)) = drainer {
        // The lane ends when the last handoff (the ingress's, the API's) is
        // gone, so that batches committed during shutdown are published.
        drop(own_handoff);
        tracing::info!(drainer_id = %drainer.drainer_id, "outbox drainer starting");
        let shutdown = shutdown.clone();
        let failed = failed.clone();
        let wakeup = wakeup.clone();
        tracker.spawn(async move {
            let result =
                crate::outbox::run_with_fast_lane(drainer, wakeup, Some(lane), shutdown.clone())
                    .await;
            if let Err(e) = result {
                record_failure(&failed, e.context("outbox drainer"));
                shutdown.cancel();
            }
        });
    }

    {
        let mut ctx = crate::ingress::IngressContext::new(&config, pool.clone(), workflows)?;
        ctx.wakeup = Some(wakeup.clone());
        ctx.applier.handoff = handoff;
        ctx.progress = progress;
        let shutdown = shutdown.clone();
        let failed = failed.clone();
        tracker.spawn(async move {
            if let Err(e) = crate::ingress::run(ctx, shutdown.clone()).await {
                record_failure(&failed, e.context("coordinator ingress"));
                shutdown.cancel();
            }
        });
    }

    tracker.close();
    shutdown.cancelled().await;
    tracing::info!(
        grace_ms = config.server.shutdown_grace_ms,
        "shutting down, waiting for in-flight work"
    );
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        tracing::warn!("in-flight work did not finish within the grace period");
    }
    pool.close().await;
    let failure = failed.lock().ok().and_then(|mut f| f.take());
    match failure {
        Some(e) => Err(e),
        None => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

/// The routing plane's sweeper and retention, each bounded per round.
async fn routing_maintenance(
    pool: sqlx::PgPool,
    config: crate::config::RoutingConfig,
    shutdown: CancellationToken,
) {
    let mut sweep = tokio::time::interval(Duration::from_millis(config.sweep_interval_ms));
    let mut purge = tokio::time::interval(Duration::from_millis(config.purge_interval_ms));
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    purge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = sweep.tick() => {
                if let Err(e) = crate::routing::sweep(&pool, config.sweep_batch).await {
                    tracing::warn!(error = %e, "routing sweep failed");
                }
            }
            _ = purge.tick() => {
                let retention = Duration::from_millis(config.retention_ms);
                if let Err(e) = crate::routing::purge(&pool, retention, config.purge_batch, config.purge_max_rounds).await {
                    tracing::warn!(error = %e, "routing retention failed");
                }
            }
        }
    }
}

fn record_failure(slot: &std::sync::Mutex<Option<anyhow::Error>>, error: anyhow::Error) {
    if let Ok(mut slot) = slot.lock() {
        slot.get_or_insert(error);
    }
}

/// Cancels `token` on SIGINT or SIGTERM.
pub fn cancel_on_signals(token: CancellationToken) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!(signal = "SIGTERM", "shutdown requested"),
            _ = int.recv() => tracing::info!(signal = "SIGINT", "shutdown requested"),
            _ = token.cancelled() => return,
        }
        token.cancel();
    });
    Ok(())
}

/// Starts probing the results frontier (see `ductor::outbox::frontier`) for the
/// drainer's timeout timers; each step forward wakes the drainer.
fn results_frontier(
    config: &Config,
    tracker: &TaskTracker,
    wakeup: &crate::outbox::Wakeup,
    shutdown: &CancellationToken,
) -> crate::outbox::frontier::Frontier {
    let frontier = crate::outbox::frontier::Frontier::tracked();
    let options = crate::outbox::frontier::FrontierOptions {
        kafka: config.kafka.clone(),
        group_id: config.kafka.group_id.clone(),
        topic: config.attempt_results_topic(),
        interval: Duration::from_millis(config.drainer.results_frontier_interval_ms),
        lag: Duration::from_millis(config.drainer.results_frontier_lag_ms),
    };
    let (f, wakeup, shutdown) = (frontier.clone(), wakeup.clone(), shutdown.clone());
    tracker.spawn(async move {
        crate::outbox::frontier::run(options, f, move || wakeup.wake(), shutdown).await;
    });
    frontier
}
