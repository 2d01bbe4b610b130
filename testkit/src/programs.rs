//! Where the workspace and its built programs are, for the harnesses that
//! run `ductor` or an example as a process of its own.
//!
//! In: the running program's path, and this crate's place in the workspace.
//! Out: paths. Guarantees: a program that is not built is an error that says
//! how to build it, never a path to nothing.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The workspace's root (where `config/` is).
pub fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|dir| dir.join("config/workflows").is_dir())
        .expect("the testkit is a package below the workspace's config/workflows")
        .to_path_buf()
}

/// A program installed beside the one running (a harness's binary and
/// `ductor` share cargo's `<target>/<profile>/`).
pub fn beside_this_program(name: &str) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("finding this program")?;
    let path = me.with_file_name(name);
    anyhow::ensure!(
        path.exists(),
        "{} does not exist: build it, or name it with --serve-bin",
        path.display()
    );
    Ok(path)
}

/// The `ductor` binary of this build, for a test that runs it as a child
/// process: cargo puts a workspace's binaries in the directory above the
/// test executables (`<target>/<profile>/deps/`), and `cargo test
/// --workspace` builds them before any test runs.
pub fn ductor_bin() -> PathBuf {
    built("ductor", "cargo build --bin ductor")
}

/// An example of the `ductor` package, built beside the test executables
/// (`<target>/<profile>/examples/`) by `cargo build --examples`.
pub fn example_bin(name: &str) -> PathBuf {
    built(
        &format!("examples/{name}"),
        &format!("cargo build --example {name}"),
    )
}

/// `relative` under the profile directory of the running test executable.
fn built(relative: &str, build: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test executable is in <target>/<profile>/deps")
        .join(relative);
    assert!(
        bin.is_file(),
        "{} is missing: build it with `{build}` (scripts/test does)",
        bin.display()
    );
    bin
}
