//! `ductor-bench`: measures capacity, latency and the machine's baselines in
//! one run (see the `ductor_bench` library for the phases and the report).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "ductor-bench",
    about = "Measure Ductor's capacity and latency against the machine's baselines"
)]
struct Cli {
    /// Ductor's configuration file; `DUCTOR__SECTION__KEY` environment
    /// variables override it.
    #[arg(long, short, global = true, env = "DUCTOR_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    args: ductor_bench::BenchArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ductor::cli::run_binary(cli.config.as_deref(), |config| async move {
        match ductor_bench::main(cli.args, config).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    })
}
