//! `serve` in the harness's own process, on listeners it bound itself:
//! for the tests that talk to serve's listeners or watch what its loops do.
//!
//! In: a configuration (its database migrated, its topics made). Out: the
//! public and admin addresses, and a way to stop it. Guarantees:
//! [`Running::start`] returns once serve's readiness verdict is ready (the
//! one its `/readyz` answers 200 with), awaited on
//! `Listeners::ready()`, not asked over HTTP; a serve that stops before
//! that, or is not ready within a minute, fails the caller with its error.

use std::time::Duration;

use ductor::config::Config;

/// `serve` in this process on its own bound listeners: started by
/// [`Running::start`], which returns once serve says it is ready.
pub struct Running {
    /// The public listener.
    pub addr: std::net::SocketAddr,
    /// The admin listener.
    pub admin: std::net::SocketAddr,
    pub shutdown: tokio_util::sync::CancellationToken,
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Binds `config`'s listeners, starts serve on them and returns once
    /// its readiness verdict is ready (what `/readyz` answers 200 with).
    /// Panics with serve's own error if it stops first, or after a minute.
    pub async fn start(config: &Config) -> Running {
        let listeners = ductor::cli::serve::Listeners::bind(&config.server)
            .await
            .expect("binding serve's listeners");
        let addr = listeners.public.local_addr().unwrap();
        let admin = listeners.admin.local_addr().unwrap();
        let ready = listeners.ready();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let mut task = tokio::spawn(ductor::cli::serve::run_on(
            config.clone(),
            listeners,
            shutdown.clone(),
        ));
        tokio::select! {
            () = ready.wait() => {}
            ended = &mut task => panic!("serve stopped before it was ready: {ended:?}"),
            () = tokio::time::sleep(Duration::from_secs(60)) => panic!("serve was not ready within 60 s"),
        }
        Running {
            addr,
            admin,
            shutdown,
            task,
        }
    }

    /// Stops it, expecting a clean stop within a minute.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("serve stops within a minute")
            .expect("serve panicked")
            .expect("serve failed");
    }
}
