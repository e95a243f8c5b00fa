use super::*;
use crate::metrics::ratelimit_names::ResponseTime;

fn stats(counters: &[(&str, u64)], buckets: &[(f64, u64)]) -> RatelimitStats {
    RatelimitStats {
        counters: counters
            .iter()
            .map(|(name, value)| ((*name).to_owned(), *value))
            .collect(),
        response_time: ResponseTime {
            buckets: buckets.to_vec(),
            count: buckets.last().map_or(0, |it| it.1),
            sum_ms: 0.0,
        },
    }
}

#[test]
fn each_flush_sends_what_changed_since_the_last() {
    let mut flushed = Flushed::default();
    let first = flushed.lines_since(
        &stats(
            &[("a.total_hits", 3), ("a.over_limit", 0)],
            &[(1.0, 1), (5.0, 4), (f64::INFINITY, 5)],
        ),
        "",
        TagFormat::Name,
    );
    assert_eq!(
        first.text,
        "a.total_hits:3|c\n\
         ratelimit_server.ShouldRateLimit.response_time:1|ms\n\
         ratelimit_server.ShouldRateLimit.response_time:5|ms|@0.3333333333333333\n\
         ratelimit_server.ShouldRateLimit.response_time:5|ms\n"
    );
    assert_eq!(first.lines, 4);
    let second = flushed.lines_since(
        &stats(
            &[("a.total_hits", 3), ("a.over_limit", 2)],
            &[(1.0, 1), (5.0, 4), (f64::INFINITY, 5)],
        ),
        "",
        TagFormat::Name,
    );
    assert_eq!(second.text, "a.over_limit:2|c\n");
    let third = flushed.lines_since(
        &stats(
            &[("a.total_hits", 3), ("a.over_limit", 2)],
            &[(1.0, 1), (5.0, 4), (f64::INFINITY, 5)],
        ),
        "",
        TagFormat::Name,
    );
    assert_eq!(third.lines, 0);
    assert!(third.text.is_empty());
}

#[test]
fn tags_in_the_name_or_as_dogstatsd_tags() {
    let tags = vec![
        ("zone".to_owned(), "eu.west:1".to_owned()),
        ("app".to_owned(), "rl".to_owned()),
    ];
    let name = tag_text(&tags, TagFormat::Name);
    assert_eq!(name, ".__app=rl.__zone=eu_west_1");
    let dog = tag_text(&tags, TagFormat::DogStatsd);
    assert_eq!(dog, "|#app:rl,zone:eu.west_1");
    let mut out = String::new();
    line(&mut out, "x.y", "2", "c", None, &name, TagFormat::Name);
    line(
        &mut out,
        "x.y",
        "2",
        "ms",
        Some(0.5),
        &dog,
        TagFormat::DogStatsd,
    );
    assert_eq!(
        out,
        "x.y.__app=rl.__zone=eu_west_1:2|c\nx.y:2|ms|@0.5|#app:rl,zone:eu.west_1\n"
    );
}

#[test]
fn datagrams_cut_at_line_ends() {
    let text = "aaaa\nbbbb\ncc\n";
    assert_eq!(datagrams(text, 10), vec!["aaaa\nbbbb\n", "cc\n"]);
    assert_eq!(datagrams(text, 4), vec!["aaaa\n", "bbbb\n", "cc\n"]);
    assert_eq!(datagrams(text, 100), vec![text]);
    assert!(datagrams("", 10).is_empty());
}
