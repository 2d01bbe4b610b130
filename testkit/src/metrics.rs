//! Reading Ductor's metrics as a scraper would: the value of a series in a
//! Prometheus text exposition.
//!
//! In: the exposition's text. Out: a number. Guarantees: pure; comment
//! lines (`# HELP`, `# TYPE`) never match, and a series that is absent reads
//! as `None` (or 0 in a sum), as Prometheus treats a counter not yet counted.

/// The value of the series named exactly `series` (a name, with its labels
/// if it has any: `ductor_x_total{reason="y"}`).
pub fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The sum of every series of the metric `name` whose line contains
/// `label` (`""`: all of them); 0 when there is none.
pub fn sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
        })
        .filter(|line| line.contains(label))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
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
}
