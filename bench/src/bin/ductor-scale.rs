//! `ductor-scale`: the same runs on one, two, three ... serve processes of
//! one consumer group (see the `ductor_bench::scale` module).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "ductor-scale",
    about = "Measure the same runs on one, two, three ... serve processes of one consumer group"
)]
struct Cli {
    /// Ductor's configuration file; `DUCTOR__SECTION__KEY` environment
    /// variables override it.
    #[arg(long, short, global = true, env = "DUCTOR_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    args: ductor_bench::scale::ScaleArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ductor::cli::run_binary(cli.config.as_deref(), |config| async move {
        match ductor_bench::scale::main(cli.args, config).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    })
}
