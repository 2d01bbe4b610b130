//! The checker's tally: violations by kind, with a few examples each. The
//! per-run checks of [`super::history`] and the checks across runs, topics
//! and the log of [`super::check`] all count into it.

use std::collections::BTreeMap;

/// Examples kept per violation kind.
const MAX_EXAMPLES: usize = 3;
/// Longest example text.
const MAX_EXAMPLE_LEN: usize = 300;

/// Violations by kind, with a few examples each.
#[derive(Debug, Default, Clone)]
pub struct Violations {
    pub counts: BTreeMap<String, u64>,
    pub examples: BTreeMap<String, Vec<String>>,
}

impl Violations {
    /// Counts one violation; `example` is only built for the first few.
    pub fn add(&mut self, kind: &str, example: impl FnOnce() -> String) {
        *self.counts.entry(kind.to_string()).or_default() += 1;
        let examples = self.examples.entry(kind.to_string()).or_default();
        if examples.len() < MAX_EXAMPLES {
            let mut e = example();
            if let Some((i, _)) = e.char_indices().nth(MAX_EXAMPLE_LEN) {
                e.truncate(i);
            }
            examples.push(e);
        }
    }

    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }
}
