//! The `ductor` binary's entry points: [`serve`] composes every stage into
//! one process (once `versions` has checked that the workflow versions the
//! running runs need are defined); [`inspect`] reads durable state for an
//! operator; [`commands`] are the operator's one-shot commands.
//!
//! In: the [`Config`] and what the binary parsed of its arguments. Out:
//! what each command prints, or an error. Guarantees: a configuration that
//! does not load, or a runtime that does not start, ends the binary with
//! status 2 before any command runs ([`run_binary`]).

pub mod client;
pub mod commands;
pub mod inspect;
pub mod keys;
pub mod operator;
pub mod serve;
mod versions;

use std::future::Future;
use std::path::Path;
use std::process::ExitCode;

use crate::config::Config;

/// The frame of every Ductor binary: loads the configuration (`path` over
/// the built-in defaults, `DUCTOR__*` over both), starts logging (and the
/// span exporter, when configured) and a multi-threaded runtime, and runs
/// `main` on it; the exporter sends its last spans once `main` returns. A configuration that does
/// not load, or a runtime that does not start, exits with status 2.
pub fn run_binary<F, Fut>(path: Option<&Path>, main: F) -> ExitCode
where
    F: FnOnce(Config) -> Fut,
    Fut: Future<Output = ExitCode>,
{
    let config = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let telemetry = crate::infra::telemetry::init(&config.log, &config.telemetry);
    let code = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(main(config)),
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            ExitCode::from(2)
        }
    };
    // The last spans go out before the process does.
    telemetry.shutdown();
    code
}
