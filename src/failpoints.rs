//! Fault injection for `scripts/chaos`.
//!
//! Crash points are `fail` crate failpoints, compiled in only with the cargo
//! feature `failpoints` and configured at start-up from the `FAILPOINTS`
//! environment variable (`name=action;...`, e.g.
//! `FAILPOINTS='apply.after_update=1%return'`). At a crash point the `return`
//! action ends the process on the spot, as a SIGKILL would: no destructor,
//! no flush, no offset commit. Without the feature every point compiles to
//! nothing.
//!
//! The points: `apply.after_update`, `apply.mid_batch`, `apply.after_intents`
//! (inside the apply transaction), `apply.commit_reply_lost` (committed, but
//! the caller sees an error and retries; no crash), `ingress.before_offset_store`,
//! `ingress.rebalance`, `drainer.after_publish`, `routing.after_reserve`,
//! `api.after_decision`.

/// Ends the process immediately, like SIGKILL.
pub fn crash(point: &str) -> ! {
    eprintln!("failpoint {point}: crashing");
    std::process::abort()
}

/// Defines a crash point: with the `failpoints` feature and an action set
/// for `$name`, the process dies here.
#[macro_export]
macro_rules! crash_point {
    ($name:expr) => {
        fail::fail_point!($name, |_| { $crate::failpoints::crash($name) })
    };
}
