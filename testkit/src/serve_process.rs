//! A `ductor serve` in a process of its own, for the harnesses: its peak
//! RSS is its own, a crash of it is seen as one, and it can be killed and
//! started again on the same configuration.
//!
//! In: the `ductor` binary and the configuration to run it on. Out: its
//! listeners' addresses, its log file and its peak RSS. Guarantees: it is
//! ready (its `/readyz` answers 200: another process's verdict can only be
//! asked) when `start` returns, it inherits no setting that would override
//! the configuration file written for it, and it is killed when dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;

use ductor::config::Config;

/// Environment the serve must not inherit: it would override the
/// configuration file the harness writes for it.
fn overrides_configuration(name: &str) -> bool {
    name.starts_with("DUCTOR__")
        || name == "DUCTOR_CONFIG"
        || name == "DATABASE_URL"
        || name == "DATABASE_MIGRATE_URL"
        || name == "KAFKA_BOOTSTRAP_SERVERS"
}

/// A `ductor serve` in a process of its own.
pub struct ServeProcess {
    child: tokio::process::Child,
    bin: PathBuf,
    /// The public listener: the API and the bare readiness.
    pub addr: SocketAddr,
    /// The admin listener: metrics and the detailed readiness.
    pub admin_addr: SocketAddr,
    config_file: PathBuf,
    pub log_file: PathBuf,
}

impl ServeProcess {
    /// Starts it on `config` with two free ports, and waits until it is
    /// ready.
    pub async fn start(bin: &Path, config: &Config) -> anyhow::Result<ServeProcess> {
        // Both found before either is given up, so that they differ.
        let (public, admin) = (free_port()?, free_port()?);
        let (addr, admin_addr) = (public.local_addr()?, admin.local_addr()?);
        drop((public, admin));
        let mut config = config.clone();
        config.server.listen = addr;
        config.server.admin_listen = admin_addr;
        let stem = format!("ductor-serve-{}", uuid::Uuid::new_v4().simple());
        let config_file = std::env::temp_dir().join(format!("{stem}.toml"));
        let log_file = std::env::temp_dir().join(format!("{stem}.log"));
        let text = toml::to_string(&config).context("writing the serve's configuration")?;
        std::fs::write(&config_file, text)
            .with_context(|| format!("writing {}", config_file.display()))?;
        let child = spawn(bin, &config_file, &log_file)?;
        let mut serve = ServeProcess {
            child,
            bin: bin.to_path_buf(),
            addr,
            admin_addr,
            config_file,
            log_file,
        };
        serve.await_ready(Duration::from_secs(60)).await?;
        Ok(serve)
    }

    /// SIGKILLs it and starts it again at once on the same configuration
    /// (its ports, its `group.instance.id`), as a supervisor would; returns
    /// once the new process is ready.
    pub async fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        self.child.kill().await.context("killing the serve")?;
        self.child = spawn(&self.bin, &self.config_file, &self.log_file)?;
        self.await_ready(Duration::from_secs(60)).await
    }

    async fn await_ready(&mut self, bound: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            if let Some(status) = self.exited() {
                anyhow::bail!(
                    "the serve exited ({status}) before it was ready; its log is {}",
                    self.log_file.display()
                );
            }
            let ready = crate::http::request(
                self.addr,
                "GET",
                "/readyz",
                &[],
                b"",
                Duration::from_secs(5),
            )
            .await;
            if matches!(ready, Ok((200, _))) {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the serve was not ready within {} s; its log is {}",
                bound.as_secs(),
                self.log_file.display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// How it ended, if it has.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Its resident set's high-water mark, from `/proc`.
    pub fn peak_rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()?)).ok()?;
        ductor::infra::telemetry::parse_peak_rss(&status)
    }

    /// Asks it to stop (SIGTERM), and kills it if it has not within its
    /// grace. Its configuration file goes; its log stays.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = tokio::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
        let _ = std::fs::remove_file(&self.config_file);
    }
}

/// A loopback port nothing listens on, held until the listener is dropped.
fn free_port() -> anyhow::Result<std::net::TcpListener> {
    std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")
}

/// Starts `bin serve` on `config_file`, appending to `log_file`.
fn spawn(bin: &Path, config_file: &Path, log_file: &Path) -> anyhow::Result<tokio::process::Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_file)
        .with_context(|| format!("opening {}", log_file.display()))?;
    let mut command = on_config_file(bin, config_file);
    command
        .arg("serve")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true);
    command
        .spawn()
        .with_context(|| format!("starting {} serve", bin.display()))
}

/// `bin --config <config_file>`, for any of Ductor's programs (`ductor`, a
/// worker, a driver), without the environment that would override the
/// file; the caller adds the rest.
pub fn on_config_file(bin: &Path, config_file: &Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(bin);
    command.arg("--config").arg(config_file);
    for (name, _) in std::env::vars_os() {
        if overrides_configuration(&name.to_string_lossy()) {
            command.env_remove(name);
        }
    }
    command
}
