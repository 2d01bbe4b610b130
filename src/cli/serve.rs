//! `ductor serve`: the long-running process. Every task hangs off one root
//! cancellation token and one tracker, so shutdown waits for all of them.
//!
//! In: the [`Config`] and the two bound [`Listeners`]. Out: every stage
//! running (ingress, drainer, API, retention, readiness) until `shutdown`.
//! Guarantees: the ingress consumes nothing before the workflow versions
//! are settled and the input topics are co-partitioned (or that is
//! waived); a vital task that fails stops the process with its error.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::BaseConsumer;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{AuthMode, Config};
use crate::coordinator::Workflows;
use crate::infra::health::{HttpState, Verdict};
use crate::infra::http_server::{CertStore, ServeOptions, TlsFiles, watch_tls};
use crate::outbox::{FastLane, Handoff, Wakeup};

/// Runs until `shutdown` is cancelled, then lets in-flight work finish within
/// `server.shutdown_grace_ms`.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let listeners = Listeners::bind(&config.server).await?;
    run_on(config, listeners, shutdown).await
}

/// The process's two HTTP listeners: the public one (`server.listen`), for
/// the routing API and a bare readiness, and the admin one
/// (`server.admin_listen`), for metrics, detailed readiness and the
/// operator's endpoints.
pub struct Listeners {
    pub public: tokio::net::TcpListener,
    pub admin: tokio::net::TcpListener,
    /// The verdict both `/readyz` answer from, published by the readiness
    /// task once serve runs on these listeners.
    readiness: Verdict,
}

/// Serve's readiness, for a caller that runs serve in its own process.
#[derive(Clone)]
pub struct Ready(Verdict);

impl Ready {
    /// Returns once serve is ready: the verdict `/readyz` answers 200 with.
    pub async fn wait(&self) {
        self.0.until_ready().await;
    }
}

impl Listeners {
    /// Binds both addresses of `server`; an address that cannot be bound
    /// is an error naming it and its key.
    pub async fn bind(server: &crate::config::ServerConfig) -> anyhow::Result<Listeners> {
        let public = tokio::net::TcpListener::bind(server.listen)
            .await
            .with_context(|| {
                format!(
                    "binding the public http listener on {} (server.listen)",
                    server.listen
                )
            })?;
        let admin = tokio::net::TcpListener::bind(server.admin_listen)
            .await
            .with_context(|| {
                format!(
                    "binding the admin http listener on {} (server.admin_listen)",
                    server.admin_listen
                )
            })?;
        Ok(Listeners {
            public,
            admin,
            readiness: Verdict::new(),
        })
    }

    /// What to await for serve running on these listeners to be ready.
    pub fn ready(&self) -> Ready {
        Ready(self.readiness.clone())
    }
}

/// Refuses to start when a topic takes smaller records than Ductor may
/// send, or when the input topics' partition counts differ (no single
/// writer per run). A broker that does not answer in time is no reason to
/// stay down: the limits are then not checked, with a warning, and the
/// ingress waits for the partition counts ([`await_copartitioned`]).
async fn check_topic_limits(config: &Config) -> anyhow::Result<()> {
    let mut kafka = config.kafka.clone();
    kafka.admin_timeout_ms = kafka.admin_timeout_ms.min(TOPIC_CHECK_TIMEOUT_MS);
    match crate::infra::kafka::topics_below_limit(&kafka, &config.all_topics()).await {
        Ok(small) if small.is_empty() => {}
        Ok(small) => return Err(crate::infra::kafka::limits_error(&config.kafka, &small)),
        Err(e) => tracing::warn!(error = format!("{e:#}"), "topic limits not checked"),
    }
    let inputs = config.topic_names().inputs();
    let counts =
        tokio::task::spawn_blocking(move || crate::infra::kafka::partition_counts(&kafka, &inputs))
            .await?;
    match crate::infra::kafka::copartition_verdict(counts, config.kafka.require_copartitioned) {
        crate::infra::kafka::Copartition::Refused(why) => Err(anyhow::anyhow!(why)),
        // Passed or waived: the ingress checks again before it consumes,
        // and says so when it waives. Unknown: it waits for the counts.
        _ => Ok(()),
    }
}

/// How long `serve` waits at start-up for the topics' limits.
const TOPIC_CHECK_TIMEOUT_MS: u64 = 10_000;

/// [`run`] on already bound listeners (tests bind port 0 and read them
/// back).
pub async fn run_on(
    config: Config,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let workflows = load_workflows(&config)?;
    let tls = ListenerTls::load(&config.server)?;
    check_topic_limits(&config).await?;
    let pool = open_database(&config).await?;
    crate::infra::telemetry::metrics_handle();
    crate::infra::telemetry::register_series(&config);
    if !crate::cli::versions::settle(&config, &pool, &workflows, &shutdown).await? {
        pool.close().await;
        return Ok(());
    }

    let tasks = Tasks::new(shutdown);
    let progress = Arc::new(crate::ingress::Progress::new(
        config.coordinator.apply_lanes,
        Duration::from_millis(config.coordinator.stall_after_ms),
    ));
    let ingress_hold = crate::infra::health::Hold::holding("the co-partition check has not run");
    let verdict = listeners.readiness.clone();
    let http_state = spawn_readiness(&tasks, &config, &progress, &ingress_hold, verdict).await?;
    spawn_progress_watch(&tasks, progress.clone());
    let wakeup = Wakeup::default();
    let drainer = if config.drainer.enabled {
        Some(local_drainer(&config, &pool, &tasks, &wakeup)?)
    } else {
        None
    };
    let handoff = drainer.as_ref().map(|local| local.handoff.clone());
    let api_state = api_state(&config, &workflows, handoff.clone(), &wakeup).await?;
    let admin_keys =
        (config.server.admin_auth == crate::config::AdminAuth::Key).then(|| api_state.auth.clone());
    let failures = crate::infra::http_server::AuthFailures {
        gate: Arc::new(crate::auth::rate::FailureGate::new(
            config.server.auth_failures_per_second,
            config.server.auth_failure_burst,
        )),
        rates: api_state.rates.clone(),
    };
    let limit_failures = |router: axum::Router| {
        router.layer(axum::middleware::from_fn_with_state(
            failures.clone(),
            crate::infra::http_server::limit_auth_failures,
        ))
    };
    let routers = Routers {
        public: limit_failures(
            crate::infra::health::public_router(http_state.clone())
                .merge(crate::api::router(api_state.clone())),
        ),
        admin: limit_failures(
            crate::infra::health::admin_router(http_state, admin_keys)
                .merge(crate::api::admin_router(api_state)),
        ),
    };
    spawn_http(&tasks, &config.server, listeners, tls, routers)?;
    spawn_routing_maintenance(&tasks, &pool, &config);
    spawn_retention(&tasks, &pool, &config);
    if let Some(local) = drainer {
        spawn_drainer(&tasks, local, &wakeup);
    }
    let links = IngressLinks {
        wakeup,
        handoff,
        progress,
        hold: ingress_hold,
    };
    spawn_ingress(&tasks, &config, &pool, workflows, links)?;
    wait_for_shutdown(tasks, &config, pool).await
}

/// Reads the workflow definitions the coordinator runs: a directory that
/// does not load keeps the process from starting.
fn load_workflows(config: &Config) -> anyhow::Result<Workflows> {
    let workflows = crate::infra::workflows::load_dir(&config.coordinator.workflows_dir)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let signed = !config.signatures.pools.is_empty() || config.signatures.all_inputs;
    if let Some(def) = workflows.iter().find(|d| !d.children().is_empty())
        && signed
        && config.signatures.timer_key.is_none()
    {
        anyhow::bail!(
            "workflow {:?} version {} has child steps, and starts must be signed \
             (signatures.pools or signatures.all_inputs): a child's start is signed with \
             signatures.timer_key, which is not set",
            def.name,
            def.version
        );
    }
    tracing::info!(
        workflows = workflows.iter().count(),
        dir = %config.coordinator.workflows_dir.display(),
        "workflow definitions loaded"
    );
    Ok(workflows)
}

/// Connects to Postgres as the application role after, when configured
/// to, bringing the schema up to date as the migrator; without that, the
/// schema must already be current. Before any stage touches it.
async fn open_database(config: &Config) -> anyhow::Result<PgPool> {
    if config.database.migrate_on_start {
        crate::infra::db::migrate_database(&config.database).await?;
        tracing::info!("database migrations applied");
    }
    let pool = crate::infra::db::connect(&config.database).await?;
    if !config.database.migrate_on_start {
        crate::infra::db::check_migrated(&pool).await?;
    }
    Ok(pool)
}

/// The tasks of one serve process: one tracker, so that shutdown waits for
/// all of them, and one root token, so that one stop reaches all of them.
struct Tasks {
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// The first failure of a vital task, returned when the process stops.
    failed: Arc<Mutex<Option<anyhow::Error>>>,
}

impl Tasks {
    /// No tasks yet, all to be stopped by `shutdown`.
    fn new(shutdown: CancellationToken) -> Self {
        Tasks {
            tracker: TaskTracker::new(),
            shutdown,
            failed: Arc::new(Mutex::new(None)),
        }
    }

    /// Runs a task the process cannot do without. A task that fails
    /// cancels everything: the process should stop rather than run
    /// without, say, its ingress. Its error, labelled with `what`, is the
    /// one the process stops with.
    fn spawn_vital<F>(&self, what: &'static str, task: F)
    where
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let (shutdown, failed) = (self.shutdown.clone(), self.failed.clone());
        self.tracker.spawn(async move {
            if let Err(e) = task.await {
                record_failure(&failed, e.context(what));
                shutdown.cancel();
            }
        });
    }
}

/// Starts the task that checks readiness every
/// `server.readiness_interval_ms` on its own connection and metadata
/// client, and returns what the health endpoints read: its latest verdict
/// and the configuration's warnings.
async fn spawn_readiness(
    tasks: &Tasks,
    config: &Config,
    progress: &Arc<crate::ingress::Progress>,
    ingress_hold: &crate::infra::health::Hold,
    verdict: Verdict,
) -> anyhow::Result<HttpState> {
    let kafka_probe: BaseConsumer = crate::infra::kafka::consumer_config(
        &config.kafka,
        &format!("{}-probe", config.kafka.group_id),
        "probe",
    )
    .create()
    .context("creating kafka probe client")?;
    let probes = crate::infra::health::Probes {
        pool: crate::infra::db::connect_readiness(&config.database).await?,
        kafka_probe: Arc::new(kafka_probe),
        timeout: Duration::from_millis(config.server.readiness_timeout_ms),
        ingress: Some(progress.clone() as Arc<dyn crate::infra::health::LaneWatch>),
        ingress_hold: ingress_hold.clone(),
    };
    let interval = Duration::from_millis(config.server.readiness_interval_ms);
    let watch = crate::infra::health::watch_readiness(
        probes,
        verdict.clone(),
        interval,
        tasks.shutdown.clone(),
    );
    tasks.tracker.spawn(watch);
    let warnings = config.security_warnings();
    for warning in &warnings {
        tracing::warn!(
            warning = warning.as_str(),
            "the configuration leaves a door open"
        );
    }
    Ok(HttpState {
        verdict,
        warnings: warnings.into(),
    })
}

/// Once a second, notes the ingress lanes' progress (so that readiness sees
/// a stalled lane) and the process's own gauges.
fn spawn_progress_watch(tasks: &Tasks, progress: Arc<crate::ingress::Progress>) {
    let shutdown = tasks.shutdown.clone();
    tasks.tracker.spawn(async move {
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

/// The outbox drainer of this process, with the fast lane through which
/// the apply layer hands it the intents it may publish at once.
struct LocalDrainer {
    drainer: crate::outbox::Drainer,
    /// This process's end of the lane, cloned for the ingress and the API.
    handoff: Handoff,
    lane: FastLane,
}

/// Builds the in-process drainer: its producers, the results frontier its
/// timeout timers wait on, and its fast lane.
fn local_drainer(
    config: &Config,
    pool: &PgPool,
    tasks: &Tasks,
    wakeup: &Wakeup,
) -> anyhow::Result<LocalDrainer> {
    let producer = crate::infra::kafka::producer(&config.kafka, "drainer")?;
    let drainer = crate::outbox::Drainer::new(
        pool.clone(),
        producer,
        config.drainer.clone(),
        Duration::from_millis(config.kafka.delivery_timeout_ms),
    )
    .with_solo_producer(crate::infra::kafka::LazyProducer::new(
        crate::infra::kafka::producer_config(&config.kafka, "drainer-solo"),
    )?)
    .with_prompt_producer(crate::infra::prompt_producer::PromptProducer::new(
        crate::infra::kafka::producer_config(&config.kafka, "drainer-prompt"),
        config.kafka.prompt_max_in_flight,
        Duration::from_millis(config.kafka.prompt_after_ms),
    )?)
    .with_instance(config.kafka.group_instance_id.clone())
    .with_results_frontier(results_frontier(
        config,
        &tasks.tracker,
        wakeup,
        &tasks.shutdown,
    ))
    .with_parked_notices(config.topic_names().events())
    .with_timer_key(config.signatures.timer_key.clone());
    let (handoff, lane) = drainer.fast_lane(wakeup);
    Ok(LocalDrainer {
        drainer,
        handoff,
        lane,
    })
}

/// The routing API's state. With an in-process drainer, its decisions hand
/// their effects to the fast lane; without one, they only wake the drainer.
/// Its pool is its own (`database.api_max_connections`), so that its
/// callers cannot take the connections the ingress and the drainer need.
async fn api_state(
    config: &Config,
    workflows: &Workflows,
    handoff: Option<Handoff>,
    wakeup: &Wakeup,
) -> anyhow::Result<crate::api::ApiState> {
    let pool = crate::infra::db::connect_api(&config.database).await?;
    let mut api_applier = crate::apply::Applier::new(config, pool.clone(), workflows.clone());
    api_applier.handoff = handoff.clone();
    api_applier.writer = Arc::new(crate::apply::Writer::new("api"));
    if config.server.auth == AuthMode::Disabled {
        tracing::warn!(
            "server.auth = \"disabled\": the public API takes every request's word for its \
             tenant. Anyone who reaches {} can act as any tenant. For local development only.",
            config.server.listen
        );
    }
    let letters = crate::ingress::dead_letters::DeadLetters::new(config, pool.clone())?;
    Ok(crate::api::ApiState {
        decider: Arc::new(api_applier),
        routing: config.routing.clone(),
        limits: config.input_limits(),
        wakeup: handoff.is_none().then(|| wakeup.clone()),
        auth: crate::auth::Authenticator::new(
            config.server.auth,
            pool,
            Duration::from_millis(config.server.unknown_key_cache_ms),
        ),
        rates: Arc::new(crate::auth::rate::RateLimiter::new(
            config.server.requests_per_second,
            config.server.request_burst,
        )),
        body_read_timeout: Duration::from_millis(config.server.body_read_timeout_ms),
        guard: crate::api::guard::Guard::new(&config.server),
        dead_letters: Some(letters),
        operator: crate::api::operator::OperatorLimits {
            max_page_runs: config.server.max_page_runs,
            count_scan_limit: config.server.count_scan_limit,
            runs_retention_ms: config.runs.retention_ms,
            tombstone_retention_ms: config.runs.tombstone_retention_ms,
        },
        inputs: crate::api::InputSink {
            producer: crate::infra::kafka::LazyProducer::new(
                crate::infra::kafka::producer_config(&config.kafka, "api"),
            )?,
            topic: config.topic_names().wakeups(),
            timeout: Duration::from_millis(config.kafka.delivery_timeout_ms),
            signatures: config.signatures.clone(),
        },
    })
}

/// The listeners' TLS, each `None` for plain HTTP. Loaded before
/// anything else starts: a pair that does not load keeps `serve` from
/// starting, with an error naming the key and the path.
struct ListenerTls {
    public: Option<Arc<CertStore>>,
    admin: Option<Arc<CertStore>>,
}

impl ListenerTls {
    fn load(server: &crate::config::ServerConfig) -> anyhow::Result<ListenerTls> {
        let store = |files: Option<TlsFiles>, listener| {
            files
                .map(|files| CertStore::load(files, listener))
                .transpose()
        };
        Ok(ListenerTls {
            public: store(TlsFiles::public(server), "public")?,
            admin: store(TlsFiles::admin(server), "admin")?,
        })
    }
}

/// What each listener serves: the routing API with the public health
/// endpoints, and the admin endpoints.
struct Routers {
    public: axum::Router,
    admin: axum::Router,
}

/// Serves the public and the admin routers on their listeners until
/// shutdown.
fn spawn_http(
    tasks: &Tasks,
    server: &crate::config::ServerConfig,
    listeners: Listeners,
    tls: ListenerTls,
    routers: Routers,
) -> anyhow::Result<()> {
    let http = |store, name| HttpListener {
        header_read_timeout: Duration::from_millis(server.header_read_timeout_ms),
        tls_check_interval: Duration::from_millis(server.tls_check_interval_ms),
        tls: store,
        max_connections: server.max_connections,
        name,
    };
    let public = (listeners.public, routers.public);
    serve_http(
        tasks,
        "public http server",
        public,
        http(tls.public, "public"),
    )?;
    serve_http(
        tasks,
        "admin http server",
        (listeners.admin, routers.admin),
        http(tls.admin, "admin"),
    )
}

/// How one listener serves: its bounds on a request's head and on its
/// open connections, and its TLS.
struct HttpListener {
    header_read_timeout: Duration,
    tls_check_interval: Duration,
    tls: Option<Arc<CertStore>>,
    max_connections: usize,
    /// `public` or `admin`.
    name: &'static str,
}

/// Serves `app` on `listener` until shutdown, as a vital task named `what`,
/// with a task that reloads its certificate when it has TLS.
fn serve_http(
    tasks: &Tasks,
    what: &'static str,
    (listener, app): (tokio::net::TcpListener, axum::Router),
    http: HttpListener,
) -> anyhow::Result<()> {
    let addr = listener
        .local_addr()
        .with_context(|| format!("reading the {what}'s address"))?;
    let tls = http.tls.as_ref().map(CertStore::acceptor).transpose()?;
    tracing::info!(%addr, server = what, tls = tls.is_some(), "http listening");
    if let Some(store) = http.tls {
        let watch = watch_tls(store, http.tls_check_interval, tasks.shutdown.clone())?;
        tasks.spawn_vital("tls certificate reload", watch);
    }
    let options = ServeOptions {
        header_read_timeout: http.header_read_timeout,
        tls,
        max_connections: http.max_connections,
        listener: http.name,
    };
    let serve = crate::infra::http_server::serve(listener, app, options, tasks.shutdown.clone());
    tasks.spawn_vital(what, serve);
    Ok(())
}

/// Runs the routing plane's sweeper and retention until shutdown.
fn spawn_routing_maintenance(tasks: &Tasks, pool: &PgPool, config: &Config) {
    let pool = pool.clone();
    let routing = config.routing.clone();
    let shutdown = tasks.shutdown.clone();
    let maintenance = crate::routing::retention::run(pool, routing, shutdown);
    tasks.tracker.spawn(maintenance);
}

/// Runs the retention of finished runs and of recorded dead letters until
/// shutdown.
fn spawn_retention(tasks: &Tasks, pool: &PgPool, config: &Config) {
    let shutdown = tasks.shutdown.clone();
    let runs = crate::apply::retention::run(pool.clone(), config.runs.clone(), shutdown.clone());
    tasks.tracker.spawn(runs);
    let letters = config.dead_letters.clone();
    let letters = crate::ingress::dead_letters::retention::run(pool.clone(), letters, shutdown);
    tasks.tracker.spawn(letters);
}

/// Starts publishing the outbox. The lane ends when the last handoff (the
/// ingress's, the API's) is gone, so that batches committed during
/// shutdown are published.
fn spawn_drainer(tasks: &Tasks, local: LocalDrainer, wakeup: &Wakeup) {
    let LocalDrainer {
        drainer,
        handoff,
        lane,
    } = local;
    drop(handoff);
    tracing::info!(drainer_id = %drainer.drainer_id, "outbox drainer starting");
    let run = crate::outbox::run_with_fast_lane(
        drainer,
        wakeup.clone(),
        Some(lane),
        tasks.shutdown.clone(),
    );
    tasks.spawn_vital("outbox drainer", run);
}

/// How the ingress reaches the rest of the process: the drainer it wakes
/// or hands effects to, and the lanes' progress readiness reads.
struct IngressLinks {
    wakeup: Wakeup,
    handoff: Option<Handoff>,
    progress: Arc<crate::ingress::Progress>,
    /// Held until the input topics are known to be co-partitioned.
    hold: crate::infra::health::Hold,
}

/// Starts the coordinator's ingress: it consumes requests and results and
/// applies them, once the input topics are known to be co-partitioned.
fn spawn_ingress(
    tasks: &Tasks,
    config: &Config,
    pool: &PgPool,
    workflows: Workflows,
    links: IngressLinks,
) -> anyhow::Result<()> {
    let mut ctx = crate::ingress::IngressContext::new(config, pool.clone(), workflows)?;
    ctx.wakeup = Some(links.wakeup);
    ctx.applier.handoff = links.handoff;
    ctx.progress = links.progress;
    let (kafka, inputs) = (config.kafka.clone(), config.topic_names().inputs());
    let shutdown = tasks.shutdown.clone();
    let hold = links.hold;
    let run = async move {
        if !await_copartitioned(&kafka, &inputs, &hold, &shutdown).await? {
            return Ok(());
        }
        hold.release();
        crate::ingress::run(ctx, shutdown).await
    };
    tasks.spawn_vital("coordinator ingress", run);
    Ok(())
}

/// Waits until the partition counts of the input topics have been read
/// and found equal (or unequal, with `kafka.require_copartitioned =
/// false`, which warns); until then the ingress does not consume, since
/// only co-partitioned topics give a run one writer. Counts that cannot
/// be read are asked for again, after a pause that grows to
/// [`COPARTITION_RETRY_MAX`]. `Ok(false)` when shutdown came first; an
/// error when the counts differ and that is refused.
async fn await_copartitioned(
    kafka: &crate::config::KafkaConfig,
    inputs: &[String],
    hold: &crate::infra::health::Hold,
    shutdown: &CancellationToken,
) -> anyhow::Result<bool> {
    let mut pause = Duration::from_millis(100);
    loop {
        let (client, topics) = (kafka.clone(), inputs.to_vec());
        let counts = tokio::task::spawn_blocking(move || {
            crate::infra::kafka::partition_counts(&client, &topics)
        })
        .await?;
        match crate::infra::kafka::copartition_verdict(counts, kafka.require_copartitioned) {
            crate::infra::kafka::Copartition::Passed => return Ok(true),
            crate::infra::kafka::Copartition::Waived(why) => {
                tracing::warn!(
                    reason = why,
                    "kafka.require_copartitioned = false: runs may have two writers"
                );
                return Ok(true);
            }
            crate::infra::kafka::Copartition::Refused(why) => anyhow::bail!(why),
            crate::infra::kafka::Copartition::Unknown(why) => {
                tracing::warn!(
                    error = why.as_str(),
                    retry_ms = pause.as_millis() as u64,
                    "partition counts of the input topics not read: the ingress waits for them"
                );
                hold.hold(format!(
                    "the partition counts of the input topics were not read ({why})"
                ));
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(false),
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(COPARTITION_RETRY_MAX);
    }
}

/// Longest pause between two reads of the input topics' partition counts
/// while they cannot be read.
const COPARTITION_RETRY_MAX: Duration = Duration::from_secs(5);

/// Waits for shutdown, then gives in-flight work `server.shutdown_grace_ms`
/// to finish. Returns the first vital task's failure, if one stopped the
/// process.
async fn wait_for_shutdown(tasks: Tasks, config: &Config, pool: PgPool) -> anyhow::Result<()> {
    tasks.tracker.close();
    tasks.shutdown.cancelled().await;
    tracing::info!(
        grace_ms = config.server.shutdown_grace_ms,
        "shutting down, waiting for in-flight work"
    );
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    if tokio::time::timeout(grace, tasks.tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("in-flight work did not finish within the grace period");
    }
    pool.close().await;
    let failure = tasks.failed.lock().ok().and_then(|mut f| f.take());
    match failure {
        Some(e) => Err(e),
        None => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

fn record_failure(slot: &Mutex<Option<anyhow::Error>>, error: anyhow::Error) {
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
        topic: config.topic_names().attempt_results(),
        interval: Duration::from_millis(config.drainer.results_frontier_interval_ms),
        lag: Duration::from_millis(config.drainer.results_frontier_lag_ms),
    };
    let (f, wakeup, shutdown) = (frontier.clone(), wakeup.clone(), shutdown.clone());
    tracker.spawn(async move {
        crate::outbox::frontier::run(options, f, move || wakeup.wake(), shutdown).await;
    });
    frontier
}
