//! Crash hooks: where an in-process test stops one component as a crash
//! would.
//!
//! In: the points a test arms on one component (the ingress, a drainer, a
//! worker's options), before it runs. Out: [`CrashHooks::fires`], which the
//! component asks at each [`CrashPoint`]; where one fires, the component
//! returns an error and leaves undone what a crash would have left undone
//! (offsets unstored, intents uncompleted, a result unpublished).
//! Guarantees: absent from what a user can set; a build without the
//! `internals` feature can arm no point, so there every hook answers no.
//!
//! The crash points of [`super::failpoints`] are a different tool: named,
//! process-wide, configured from the environment and compiled in only with
//! the `failpoints` feature, they end the whole process, for the chaos runs
//! that kill serves from outside. A hook here belongs to one instance and
//! stops only it, so a test can crash one ingress and go on with a second
//! in the same process.

/// A place where a component can be stopped as a crash would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// The ingress, right after a batch commits and before its offsets are
    /// stored.
    IngressAfterCommit,
    /// The drainer, after a round's publishes were acknowledged and before
    /// they are marked completed.
    DrainerAfterPublish,
    /// A worker, as soon as a handler has returned, before its result is
    /// published and without storing its offset.
    WorkerBeforePublish,
}

impl CrashPoint {
    /// The point's bit in [`CrashHooks`].
    const fn bit(self) -> u8 {
        match self {
            CrashPoint::IngressAfterCommit => 1,
            CrashPoint::DrainerAfterPublish => 1 << 1,
            CrashPoint::WorkerBeforePublish => 1 << 2,
        }
    }
}

/// The points armed on one component; none by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrashHooks {
    armed: u8,
}

impl CrashHooks {
    /// Arms `point`: from now on it fires every time it is reached.
    #[cfg(any(test, feature = "internals"))]
    pub fn arm(&mut self, point: CrashPoint) {
        self.armed |= point.bit();
    }

    /// Whether the component stops at `point`.
    pub fn fires(&self, point: CrashPoint) -> bool {
        self.armed & point.bit() != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [CrashPoint; 3] = [
        CrashPoint::IngressAfterCommit,
        CrashPoint::DrainerAfterPublish,
        CrashPoint::WorkerBeforePublish,
    ];

    #[test]
    fn nothing_fires_unless_armed() {
        let hooks = CrashHooks::default();
        assert!(ALL.iter().all(|p| !hooks.fires(*p)));
    }

    #[test]
    fn an_armed_point_fires_and_no_other() {
        for armed in ALL {
            let mut hooks = CrashHooks::default();
            hooks.arm(armed);
            for point in ALL {
                assert_eq!(hooks.fires(point), point == armed, "{armed:?} armed");
            }
        }
    }
}
