//! An operator's search of runs, as its query string says it: which runs,
//! and which page of them.
//!
//! In: the query string of `GET /v1/runs` or `GET /v1/runs/counts`. Out: a
//! [`RunQuery`], or a message naming the parameter that is wrong.
//! Guarantees: pure; every value is bounded (ids and names as the contract
//! bounds them, a page to `server.max_page_runs`); an unknown parameter is
//! an error rather than a filter silently dropped; the cursor is the
//! (created_at, run_id) of the last run of a page, and a page after it
//! holds only older runs (or, at the same instant, smaller ids).

use chrono::{DateTime, Utc};

use crate::contract::input::{MAX_CORRELATION_ID_LEN, MAX_ID_LEN};
use crate::coordinator::state::RunStatus;

/// Runs a page holds when the query names no `limit`.
pub const DEFAULT_PAGE_RUNS: usize = 50;

/// Where a page starts: after the run with this creation time and id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub created_at: DateTime<Utc>,
    pub run_id: String,
}

impl Cursor {
    /// The cursor's text: the creation time in microseconds since the
    /// epoch, a dot, and the run id.
    pub fn encode(&self) -> String {
        format!("{}.{}", self.created_at.timestamp_micros(), self.run_id)
    }

    pub fn decode(text: &str) -> Result<Cursor, String> {
        let bad = || format!("`after` is not a cursor this server made: {:?}", clip(text));
        let (micros, run_id) = text.split_once('.').ok_or_else(bad)?;
        let micros: i64 = micros.parse().map_err(|_| bad())?;
        let created_at = DateTime::from_timestamp_micros(micros).ok_or_else(bad)?;
        if run_id.is_empty() || run_id.chars().count() > MAX_ID_LEN {
            return Err(bad());
        }
        Ok(Cursor {
            created_at,
            run_id: run_id.to_owned(),
        })
    }
}

/// Which runs, newest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunFilter {
    pub tenant: Option<String>,
    pub workflow: Option<String>,
    pub version: Option<i32>,
    pub status: Option<RunStatus>,
    /// The current step's index (the last one, for a run that succeeded).
    pub step: Option<i32>,
    pub correlation_id: Option<String>,
    /// Created at or after.
    pub created_after: Option<DateTime<Utc>>,
    /// Created before.
    pub created_before: Option<DateTime<Utc>>,
}

impl RunFilter {
    /// Whether the counts kept by tenant, workflow, version and status
    /// answer this filter, or the runs must be counted.
    pub fn counted_exactly(&self) -> bool {
        self.step.is_none()
            && self.correlation_id.is_none()
            && self.created_after.is_none()
            && self.created_before.is_none()
    }
}

/// A search: the filter, the page's size and where it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunQuery {
    pub filter: RunFilter,
    pub limit: usize,
    pub after: Option<Cursor>,
}

impl RunQuery {
    /// The query of `query_string` (`None`: no query), with pages of at
    /// most `max_page` runs.
    pub fn parse(query_string: Option<&str>, max_page: usize) -> Result<RunQuery, String> {
        let mut query = RunQuery {
            filter: RunFilter::default(),
            limit: DEFAULT_PAGE_RUNS.min(max_page),
            after: None,
        };
        let pairs = url::form_urlencoded::parse(query_string.unwrap_or("").as_bytes());
        for (name, value) in pairs {
            query.set(&name, &value, max_page)?;
        }
        if query.filter.version.is_some() && query.filter.workflow.is_none() {
            return Err("`version` needs `workflow`".into());
        }
        Ok(query)
    }

    fn set(&mut self, name: &str, value: &str, max_page: usize) -> Result<(), String> {
        let f = &mut self.filter;
        match name {
            "tenant" => once(&mut f.tenant, name, id(name, value, MAX_ID_LEN)?),
            "workflow" => once(&mut f.workflow, name, id(name, value, MAX_ID_LEN)?),
            "version" => once(&mut f.version, name, number(name, value, 1)?),
            "status" => once(&mut f.status, name, status(value)?),
            "step" => once(&mut f.step, name, number(name, value, 0)?),
            "correlation_id" => once(
                &mut f.correlation_id,
                name,
                id(name, value, MAX_CORRELATION_ID_LEN)?,
            ),
            "created_after" => once(&mut f.created_after, name, time(name, value)?),
            "created_before" => once(&mut f.created_before, name, time(name, value)?),
            "after" => once(&mut self.after, name, Cursor::decode(value)?),
            "limit" => {
                let limit: usize = value
                    .parse()
                    .map_err(|_| format!("`limit` is not a number: {:?}", clip(value)))?;
                if limit == 0 || limit > max_page {
                    return Err(format!("`limit` is between 1 and {max_page}"));
                }
                self.limit = limit;
                Ok(())
            }
            other => Err(format!(
                "unknown parameter {:?} (known: tenant, workflow, version, status, step, \
                 correlation_id, created_after, created_before, limit, after)",
                clip(other)
            )),
        }
    }
}

fn once<T>(slot: &mut Option<T>, name: &str, value: T) -> Result<(), String> {
    if slot.is_some() {
        return Err(format!("`{name}` is given twice"));
    }
    *slot = Some(value);
    Ok(())
}

fn id(name: &str, value: &str, max: usize) -> Result<String, String> {
    let chars = value.chars().count();
    if chars == 0 || chars > max || value.chars().any(char::is_control) {
        return Err(format!(
            "`{name}` is 1 to {max} characters, none of them a control character"
        ));
    }
    Ok(value.to_owned())
}

fn number(name: &str, value: &str, min: i32) -> Result<i32, String> {
    value
        .parse::<i32>()
        .ok()
        .filter(|n| *n >= min)
        .ok_or_else(|| format!("`{name}` is a whole number of at least {min}"))
}

fn status(value: &str) -> Result<RunStatus, String> {
    RunStatus::ALL
        .into_iter()
        .find(|s| s.as_str() == value)
        .ok_or_else(|| {
            let names: Vec<_> = RunStatus::ALL.iter().map(|s| s.as_str()).collect();
            format!("`status` is one of {}", names.join(", "))
        })
}

fn time(name: &str, value: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(value)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| format!("`{name}` is an RFC 3339 time, such as 2026-12-05T10:00:00Z"))
}

/// A value echoed in an error, cut short.
fn clip(value: &str) -> String {
    value.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_query_is_the_newest_page_of_everything() {
        let q = RunQuery::parse(None, 500).unwrap();
        assert_eq!(q.filter, RunFilter::default());
        assert_eq!((q.limit, q.after), (DEFAULT_PAGE_RUNS, None));
        assert!(q.filter.counted_exactly());
        assert_eq!(RunQuery::parse(Some(""), 10).unwrap().limit, 10);
    }

    #[test]
    fn every_filter_is_read_and_bounded() {
        let q = RunQuery::parse(
            Some(
                "tenant=acme&workflow=pay&version=2&status=failed&step=1&correlation_id=o%2F1\
                 &created_after=2026-12-01T00:00:00Z&created_before=2026-12-02T00:00:00%2B01:00\
                 &limit=7",
            ),
            500,
        )
        .unwrap();
        let f = &q.filter;
        assert_eq!(f.tenant.as_deref(), Some("acme"));
        assert_eq!((f.workflow.as_deref(), f.version), (Some("pay"), Some(2)));
        assert_eq!((f.status, f.step), (Some(RunStatus::Failed), Some(1)));
        assert_eq!(f.correlation_id.as_deref(), Some("o/1"));
        assert_eq!(
            f.created_before.unwrap().to_rfc3339(),
            "2026-12-01T23:00:00+00:00"
        );
        assert_eq!(q.limit, 7);
        assert!(!f.counted_exactly());
    }

    #[test]
    fn a_wrong_parameter_is_named() {
        for (query, says) in [
            ("status=done", "`status` is one of"),
            ("version=2", "`version` needs `workflow`"),
            ("workflow=a&version=0", "`version` is a whole number"),
            ("step=-1", "`step` is a whole number"),
            ("limit=0", "`limit` is between 1 and 500"),
            ("limit=501", "`limit` is between 1 and 500"),
            ("created_after=yesterday", "RFC 3339"),
            ("tenant=", "`tenant` is 1 to 128"),
            ("tenant=a%00b", "control character"),
            ("tenant=a&tenant=b", "given twice"),
            ("sort=asc", "unknown parameter \"sort\""),
            ("after=xyz", "not a cursor"),
            ("after=12.", "not a cursor"),
        ] {
            let e = RunQuery::parse(Some(query), 500).unwrap_err();
            assert!(e.contains(says), "{query}: {e}");
        }
        let long = "t".repeat(MAX_ID_LEN + 1);
        assert!(RunQuery::parse(Some(&format!("workflow={long}")), 500).is_err());
    }

    #[test]
    fn a_cursor_reads_back_as_it_was_written() {
        let cursor = Cursor {
            created_at: DateTime::from_timestamp_micros(1_764_950_000_123_456).unwrap(),
            run_id: "run.with.dots-1".into(),
        };
        assert_eq!(Cursor::decode(&cursor.encode()), Ok(cursor.clone()));
        let q = RunQuery::parse(Some(&format!("after={}", cursor.encode())), 500).unwrap();
        assert_eq!(q.after, Some(cursor));
    }
}
