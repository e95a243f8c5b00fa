//! Samples read from the metrics text exposition.

/// The value of the sample `series` (name and labels as exposed).
pub(crate) fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map(|value| value.parse().unwrap())
}

/// Asserts the value of each `(series, value)` in `text`.
pub(crate) fn assert_samples(text: &str, expected: &[(&str, f64)]) {
    for (series, value) in expected {
        assert_eq!(sample(text, series), Some(*value), "{series}: {text}");
    }
}

/// Decisions counted under `domain`, `rule` and `result`.
pub(crate) fn decisions(text: &str, domain: &str, rule: &str, result: &str) -> Option<f64> {
    let series = format!(
        "throttlegate_decisions_total{{domain=\"{domain}\",rule=\"{rule}\",result=\"{result}\"}}"
    );
    sample(text, &series)
}

/// Asserts the decisions counted under `domain` and `rule` for each
/// `(result, count)`.
pub(crate) fn assert_decisions(text: &str, domain: &str, rule: &str, expected: &[(&str, f64)]) {
    for (result, count) in expected {
        assert_eq!(
            decisions(text, domain, rule, result),
            Some(*count),
            "{rule} {result}: {text}"
        );
    }
}

/// Lines of the series of `metric` whose labels contain `needle`.
pub(crate) fn series_with<'t>(text: &'t str, metric: &str, needle: &str) -> Vec<&'t str> {
    text.lines()
        .filter(|line| line.starts_with(metric) && line.contains(needle))
        .collect()
}
