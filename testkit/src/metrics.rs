//! Reading Ductor's metrics as a scraper would: the value of a series in a
//! Prometheus text exposition.
//!
//! In: the exposition's text. Out: a number. Guarantees: pure; comment
//! lines (`# HELP`, `# TYPE`) never match, and a series that is absent reads
//! as `None` (or 0 in a sum), as Prometheus treats a counter not yet counted.

/// Every sample of the exposition: its series (the name with its labels,
/// `ductor_x_total{reason="y"}`) and its value. Comment lines and lines
/// whose value is no number are skipped.
pub fn samples(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.trim_end(), value.trim().parse().ok()?))
        })
}

/// The value of the series named exactly `series` (a name, with its labels
/// if it has any).
pub fn value(text: &str, series: &str) -> Option<f64> {
    samples(text).find_map(|(s, v)| (s == series).then_some(v))
}

/// The sum of every series of the metric `name` whose labels contain
/// `label` (`""`: all of them); 0 when there is none.
pub fn sum(text: &str, name: &str, label: &str) -> f64 {
    samples(text)
        .filter(|(series, _)| {
            series
                .strip_prefix(name)
                .is_some_and(|labels| labels.is_empty() || labels.starts_with('{'))
        })
        .filter(|(series, _)| series.contains(label))
        .map(|(_, v)| v)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# HELP ductor_api_refused_total requests refused
# TYPE ductor_api_refused_total counter
ductor_api_refused_total{reason=\"overloaded\"} 3
ductor_api_refused_total{reason=\"timeout\"} 2
ductor_api_refused_total_extra 100
ductor_ingress_stalled_lanes 1
";

    #[test]
    fn a_series_is_read_by_its_whole_name() {
        assert_eq!(value(TEXT, "ductor_ingress_stalled_lanes"), Some(1.0));
        let timeout = "ductor_api_refused_total{reason=\"timeout\"}";
        assert_eq!(value(TEXT, timeout), Some(2.0));
        assert_eq!(value(TEXT, "ductor_ingress_stalled"), None);
        assert_eq!(value(TEXT, "ductor_absent_total"), None);
    }

    #[test]
    fn a_sum_takes_the_series_of_one_metric_that_carry_the_label() {
        assert_eq!(sum(TEXT, "ductor_api_refused_total", ""), 5.0);
        assert_eq!(sum(TEXT, "ductor_api_refused_total", "overloaded"), 3.0);
        assert_eq!(sum(TEXT, "ductor_absent_total", ""), 0.0);
    }

    #[test]
    fn samples_skip_comments_and_what_is_no_number() {
        let text = "# TYPE x counter\nx 1\ny{a=\"b c\"} 2.5\nbroken\nz NaNx\n";
        let all: Vec<(&str, f64)> = samples(text).collect();
        assert_eq!(all, vec![("x", 1.0), ("y{a=\"b c\"}", 2.5)]);
    }
}
