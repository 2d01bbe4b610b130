//! Which recorded letters an operation takes: a filter, a status, a page,
//! and the SQL they make.
//!
//! In: the caller's tenant scope (`None`: every tenant), a
//! [`LetterFilter`], and a [`Page`]. Out: the statement's text with its
//! bound values (a [`sqlx::QueryBuilder`]). Guarantees: pure, no
//! database; every value is bound, never spliced; a tenant scope always
//! becomes `tenant_scope = $n`, so a tenant never sees a letter of another
//! tenant, nor one whose tenant could not be read; a page holds at most
//! `dead_letters.max_page_rows` letters and continues strictly past its
//! cursor, so keyset pages neither repeat nor skip a letter.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sqlx::{Postgres, QueryBuilder};

use crate::contract::formats::Timestamp;

/// Where a letter stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LetterStatus {
    /// Neither replayed nor discarded.
    Pending,
    /// A replay claimed it, and has not recorded where its record landed:
    /// a replay in flight, or one cut short (replaying it again finishes
    /// it, with the same replay id).
    Replaying,
    /// Produced again to its topic, once.
    Replayed,
    /// Set aside with a reason; never replayed.
    Discarded,
}

impl LetterStatus {
    pub const ALL: [LetterStatus; 4] = [
        LetterStatus::Pending,
        LetterStatus::Replaying,
        LetterStatus::Replayed,
        LetterStatus::Discarded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LetterStatus::Pending => "pending",
            LetterStatus::Replaying => "replaying",
            LetterStatus::Replayed => "replayed",
            LetterStatus::Discarded => "discarded",
        }
    }

    /// The status of a row with (or without) a replay claimed, a replay
    /// recorded and a discard.
    pub fn of(claimed: bool, replayed: bool, discarded: bool) -> LetterStatus {
        match (discarded, replayed, claimed) {
            (true, _, _) => LetterStatus::Discarded,
            (false, true, _) => LetterStatus::Replayed,
            (false, false, true) => LetterStatus::Replaying,
            (false, false, false) => LetterStatus::Pending,
        }
    }

    /// The rows of this status, in SQL over `dead_letters`' columns.
    fn predicate(self) -> &'static str {
        match self {
            LetterStatus::Pending => "replay_id IS NULL AND discarded_at IS NULL",
            LetterStatus::Replaying => "replay_id IS NOT NULL AND replayed_at IS NULL",
            LetterStatus::Replayed => "replayed_at IS NOT NULL",
            LetterStatus::Discarded => "discarded_at IS NOT NULL",
        }
    }
}

/// Which letters: every field left out matches all. The tenant is not
/// here: it is the caller's scope, passed beside the filter.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LetterFilter {
    /// The error class (`malformed`, `unknown_run`, ...).
    pub class: Option<String>,
    /// The stage that refused the input (`decode`, `validate`, `route`,
    /// `apply`).
    pub stage: Option<String>,
    /// The topic the input was read from.
    pub source_topic: Option<String>,
    pub status: Option<LetterStatus>,
    /// Dead-lettered at or after this time.
    #[schemars(with = "Option<Timestamp>")]
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before this time.
    #[schemars(with = "Option<Timestamp>")]
    pub until: Option<DateTime<Utc>>,
}

/// A page of letters by id: newest first for a listing, from `before`
/// (exclusive) down; oldest first for a replay of a set, from `after`
/// (exclusive) up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Page {
    /// The cursor: the `next` of the page before.
    pub cursor: Option<i64>,
    /// At most this many; 0 or more than `dead_letters.max_page_rows`
    /// means `max_page_rows`.
    pub limit: usize,
}

impl Page {
    /// The page's size under `max_rows`.
    pub fn rows(self, max_rows: usize) -> usize {
        if self.limit == 0 {
            max_rows
        } else {
            self.limit.min(max_rows)
        }
    }
}

/// The order a page walks the letters in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Newest first: a listing.
    NewestFirst,
    /// Oldest first: a replay, in the order the inputs were refused.
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))]
    OldestFirst,
}

/// What every listing reads of a letter: all but its key, headers and
/// value.
pub const SUMMARY_COLUMNS: &str = "id, source_topic, source_partition, source_offset, stage, \
     class, error, value IS NULL AS no_value, coalesce(length(value), 0) AS value_kept, \
     value_bytes, key_dropped, headers_dropped, input_type, tenant_scope, run_id, \
     dead_lettered_at, replay_id, replay_claimed_at, replayed_at, replayed_partition, \
     replayed_offset, replay_signed, discarded_at, discard_reason";

/// `SELECT <columns> FROM dead_letters` with the scope and the filter, so
/// far without order or limit.
pub fn select<'a>(
    columns: &str,
    tenant: Option<&'a str>,
    filter: &'a LetterFilter,
) -> QueryBuilder<'a, Postgres> {
    let mut q = QueryBuilder::new(format!("SELECT {columns} FROM dead_letters WHERE true"));
    push_filter(&mut q, tenant, filter);
    q
}

/// [`select`] of one page in `order`, `rows` long.
pub fn page<'a>(
    columns: &str,
    tenant: Option<&'a str>,
    filter: &'a LetterFilter,
    cursor: Option<i64>,
    order: Order,
    rows: usize,
) -> QueryBuilder<'a, Postgres> {
    let mut q = select(columns, tenant, filter);
    let (past, direction) = match order {
        Order::NewestFirst => (" AND id < ", " ORDER BY id DESC LIMIT "),
        Order::OldestFirst => (" AND id > ", " ORDER BY id ASC LIMIT "),
    };
    if let Some(cursor) = cursor {
        q.push(past).push_bind(cursor);
    }
    q.push(direction).push_bind(rows as i64);
    q
}

/// The letters of the scope and the filter, counted by stage and class.
pub fn counts<'a>(tenant: Option<&'a str>, filter: &'a LetterFilter) -> QueryBuilder<'a, Postgres> {
    let mut q = select("stage, class, count(*) AS letters", tenant, filter);
    q.push(" GROUP BY stage, class ORDER BY letters DESC, stage, class");
    q
}

/// Appends the scope's and the filter's conditions to a statement that
/// ends in a `WHERE` clause.
fn push_filter<'a>(
    q: &mut QueryBuilder<'a, Postgres>,
    tenant: Option<&'a str>,
    filter: &'a LetterFilter,
) {
    let text = [
        ("tenant_scope", tenant),
        ("class", filter.class.as_deref()),
        ("stage", filter.stage.as_deref()),
        ("source_topic", filter.source_topic.as_deref()),
    ];
    for (column, value) in text {
        if let Some(value) = value {
            q.push(format!(" AND {column} = ")).push_bind(value);
        }
    }
    if let Some(status) = filter.status {
        q.push(format!(" AND ({})", status.predicate()));
    }
    if let Some(since) = filter.since {
        q.push(" AND dead_lettered_at >= ").push_bind(since);
    }
    if let Some(until) = filter.until {
        q.push(" AND dead_lettered_at < ").push_bind(until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_filter_scoped_to_no_tenant_reads_every_letter() {
        let filter = LetterFilter::default();
        let q = page("id", None, &filter, None, Order::NewestFirst, 50);
        assert_eq!(
            q.sql(),
            "SELECT id FROM dead_letters WHERE true ORDER BY id DESC LIMIT $1"
        );
    }

    #[test]
    fn every_field_binds_a_value_and_the_tenant_always_narrows() {
        let filter = LetterFilter {
            class: Some("unknown_run".into()),
            stage: Some("validate".into()),
            source_topic: Some("ductor.wakeups".into()),
            status: Some(LetterStatus::Pending),
            since: Some(DateTime::from_timestamp(1, 0).unwrap()),
            until: Some(DateTime::from_timestamp(2, 0).unwrap()),
        };
        let q = page(
            "id",
            Some("acme"),
            &filter,
            Some(99),
            Order::OldestFirst,
            10,
        );
        assert_eq!(
            q.sql(),
            "SELECT id FROM dead_letters WHERE true AND tenant_scope = $1 AND class = $2 \
             AND stage = $3 AND source_topic = $4 \
             AND (replay_id IS NULL AND discarded_at IS NULL) AND dead_lettered_at >= $5 \
             AND dead_lettered_at < $6 AND id > $7 ORDER BY id ASC LIMIT $8"
        );
        let none = LetterFilter::default();
        let q = counts(Some("acme"), &none);
        assert!(
            q.sql()
                .contains("WHERE true AND tenant_scope = $1 GROUP BY")
        );
    }

    #[test]
    fn a_status_is_one_of_four_whatever_the_columns_say() {
        let mut seen = std::collections::HashSet::new();
        for claimed in [false, true] {
            for replayed in [false, true] {
                for discarded in [false, true] {
                    seen.insert(LetterStatus::of(claimed, replayed, discarded));
                }
            }
        }
        assert_eq!(seen.len(), LetterStatus::ALL.len());
        assert_eq!(
            LetterStatus::of(true, false, false),
            LetterStatus::Replaying
        );
    }

    #[test]
    fn a_page_is_never_empty_nor_over_the_bound() {
        let page = |limit| Page {
            cursor: None,
            limit,
        };
        assert_eq!(page(0).rows(500), 500);
        assert_eq!(page(10).rows(500), 10);
        assert_eq!(page(10_000).rows(500), 500);
    }
}
