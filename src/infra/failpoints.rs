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
//! The points: `apply.after_update` (a batch folded, nothing of it sent),
//! `apply.mid_batch` (its write statement sent, the process dies before the
//! reply: committed or not, as the database decides), `apply.after_intents`
//! (written: before the commit of a batch with a transaction, right after
//! the commit of one written by its single statement, before the fast lane
//! and the offset store hear of it), `apply.commit_reply_lost` (committed,
//! but the caller sees an error and retries; no crash), `ingress.before_offset_store`,
//! `ingress.rebalance`, `drainer.after_publish`, `routing.after_reserve`,
//! `api.after_decision`.
//!
//! In: `FAILPOINTS`, read by the `ductor` binary as it starts. Out: a
//! process that aborts at the named point. Guarantees: without the
//! `failpoints` feature no point exists in the build; with it, none fires
//! unless `FAILPOINTS` names it.

/// Ends the process immediately, like SIGKILL.
#[cfg(feature = "failpoints")]
pub fn crash(point: &str) -> ! {
    eprintln!("failpoint {point}: crashing");
    std::process::abort()
}

/// A crash point in flight: when `point` fires, polls `request` once, which
/// sends it, and ends the process before its reply can arrive.
#[cfg(feature = "failpoints")]
pub async fn send_then_crash<'a, F: std::future::Future>(
    point: &str,
    mut request: std::pin::Pin<&'a mut F>,
) -> std::pin::Pin<&'a mut F> {
    if fail::eval(point, |_| ()).is_some() {
        let _ = futures::poll!(request.as_mut());
        crash(point)
    }
    request
}

/// Defines a crash point: with the `failpoints` feature and an action set
/// for `$name`, the process dies here.
#[macro_export]
macro_rules! crash_point {
    ($name:expr) => {
        fail::fail_point!($name, |_| { $crate::infra::failpoints::crash($name) })
    };
}
