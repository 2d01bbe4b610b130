//! `ductor-idle`: a running `ductor serve` and its worker timed from
//! outside (see the `ductor_bench::outside` module).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "ductor-idle",
    about = "Time a running Ductor from outside: its idle CPU and runs one at a time"
)]
struct Cli {
    /// Ductor's configuration file; `DUCTOR__SECTION__KEY` environment
    /// variables override it.
    #[arg(long, short, global = true, env = "DUCTOR_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    args: ductor_bench::outside::OutsideArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ductor::cli::run_binary(cli.config.as_deref(), |config| async move {
        match ductor_bench::outside::main(cli.args, config).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    })
}
