//! `ductor-views`: the operator's list, search and count statements over a
//! database seeded with many runs (see the `ductor_bench::views` module).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "ductor-views",
    about = "Time the operator's list, search and count statements over many seeded runs"
)]
struct Cli {
    /// Ductor's configuration file; `DUCTOR__SECTION__KEY` environment
    /// variables override it.
    #[arg(long, short, global = true, env = "DUCTOR_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    args: ductor_bench::views::ViewsArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ductor::cli::run_binary(cli.config.as_deref(), |config| async move {
        match ductor_bench::views::main(cli.args, config).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    })
}
