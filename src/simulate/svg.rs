//! The picture of a simulation: one lane per algorithm, hand-written SVG.
//!
//! Each lane draws the remaining quota over time as a step line (after
//! every request, and read between requests) over a band of ticks
//! (allowed above, denied below) at the requests' times, with the window
//! boundaries dashed. Lanes carry their counts as
//! `data-*` attributes, and the `<desc>` repeats them, so a reader (or a
//! test) can check the picture against the text summary.

use std::fmt::Write as _;

use super::{Lane, Report, seconds};

const WIDTH: f64 = 900.0;
const PLOT_LEFT: f64 = 205.0;
const PLOT_RIGHT: f64 = 880.0;
const TOP: f64 = 70.0;
const LANE_HEIGHT: f64 = 112.0;
/// Height of the quota line's area in a lane.
const QUOTA_HEIGHT: f64 = 56.0;
const ALLOWED: &str = "#2e9e44";
const DENIED: &str = "#d62f2f";
const QUOTA: &str = "#2f5fd6";
/// Window boundaries are drawn only when there are few enough to read.
const MAX_BOUNDARIES: u64 = 60;

/// The SVG document of `report`.
pub fn render(report: &Report) -> String {
    let height = TOP + LANE_HEIGHT * report.lanes.len() as f64 + 40.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, "<title>{}</title>", escape(&title(report)));
    let _ = writeln!(out, "<desc>{}</desc>", escape(&report.to_string()));
    let _ = writeln!(
        out,
        r##"<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text x="10" y="20" font-size="14" font-weight="bold">{}</text>"#,
        escape(&report.rule)
    );
    let _ = writeln!(
        out,
        r#"<text x="10" y="38">pattern {}, {} s, {} requests</text>"#,
        escape(&report.pattern),
        seconds(report.duration_us),
        report.requests
    );
    legend(&mut out);
    for (idx, lane) in report.lanes.iter().enumerate() {
        lane_group(&mut out, report, lane, TOP + LANE_HEIGHT * idx as f64);
    }
    axis(
        &mut out,
        report,
        TOP + LANE_HEIGHT * report.lanes.len() as f64,
    );
    out.push_str("</svg>\n");
    out
}

fn title(report: &Report) -> String {
    format!("{}; pattern {}", report.rule, report.pattern)
}

fn legend(out: &mut String) {
    let (top, bottom) = (48.0, 58.0);
    let _ = writeln!(
        out,
        r##"<g class="legend"><path d="M10 {top} V{bottom}" stroke="{ALLOWED}" stroke-width="2"/><text x="16" y="{bottom}">allowed</text><path d="M80 {top} V{bottom}" stroke="{DENIED}" stroke-width="2"/><text x="86" y="{bottom}">denied</text><path d="M146 54 H166" stroke="{QUOTA}" stroke-width="1.5"/><text x="170" y="{bottom}">remaining quota (0 to capacity)</text><path d="M370 {top} V{bottom}" stroke="#999999" stroke-dasharray="2,3"/><text x="376" y="{bottom}">window boundary</text></g>"##
    );
}

/// X of a time in microseconds from the start.
fn x_of(report: &Report, at_us: u64) -> f64 {
    let share = at_us as f64 / report.duration_us.max(1) as f64;
    PLOT_LEFT + share * (PLOT_RIGHT - PLOT_LEFT)
}

fn lane_group(out: &mut String, report: &Report, lane: &Lane, top: f64) {
    let _ = writeln!(
        out,
        r#"<g class="lane" data-algorithm="{}" data-allowed="{}" data-denied="{}" data-most-in-window="{}" data-capacity="{}">"#,
        escape(&lane.label),
        lane.allowed,
        lane.denied,
        lane.most_in_window,
        lane.capacity
    );
    let quota_bottom = top + 8.0 + QUOTA_HEIGHT;
    let _ = writeln!(
        out,
        r##"<rect x="{PLOT_LEFT}" y="{}" width="{}" height="{}" fill="#f4f6fb" stroke="#dddddd"/>"##,
        top + 4.0,
        PLOT_RIGHT - PLOT_LEFT,
        LANE_HEIGHT - 12.0
    );
    boundaries(out, report, top);
    let _ = writeln!(
        out,
        r#"<text x="10" y="{}" font-weight="bold">{}</text>"#,
        top + 22.0,
        escape(&lane.label)
    );
    let _ = writeln!(
        out,
        r#"<text x="10" y="{}">allowed {} / denied {}</text>"#,
        top + 40.0,
        lane.allowed,
        lane.denied
    );
    let _ = writeln!(
        out,
        r#"<text x="10" y="{}">most in any {} s: {}</text>"#,
        top + 58.0,
        seconds(report.window_us),
        lane.most_in_window
    );
    let _ = writeln!(
        out,
        r##"<text x="{}" y="{}" text-anchor="end" fill="#555555">{}</text><text x="{}" y="{quota_bottom}" text-anchor="end" fill="#555555">0</text>"##,
        PLOT_LEFT - 4.0,
        top + 16.0,
        lane.capacity,
        PLOT_LEFT - 4.0
    );
    ticks(out, report, lane, true, quota_bottom + 8.0);
    ticks(out, report, lane, false, quota_bottom + 24.0);
    quota_line(out, report, lane, top + 8.0);
    out.push_str("</g>\n");
}

/// Dashed lines at every window boundary after the start.
fn boundaries(out: &mut String, report: &Report, top: f64) {
    let window_us = report.window_us.max(1);
    let count = report.duration_us.saturating_sub(1) / window_us;
    if count == 0 || count > MAX_BOUNDARIES {
        return;
    }
    let mut path = String::new();
    for idx in 1..=count {
        let _ = write!(
            path,
            "M{:.1} {:.1} V{:.1} ",
            x_of(report, idx * window_us),
            top + 4.0,
            top + LANE_HEIGHT - 8.0
        );
    }
    let _ = writeln!(
        out,
        r##"<path d="{}" stroke="#999999" stroke-dasharray="2,3"/>"##,
        path.trim_end()
    );
}

/// A tick per request (`allowed` or not) from `y` down 12 pixels; ticks
/// closer than half a pixel are drawn once.
fn ticks(out: &mut String, report: &Report, lane: &Lane, allowed: bool, y: f64) {
    let mut path = String::new();
    let mut last_x = f64::NEG_INFINITY;
    for event in lane.events.iter().filter(|it| it.allowed == allowed) {
        let x = x_of(report, event.at_us);
        if x - last_x < 0.5 {
            continue;
        }
        last_x = x;
        let _ = write!(path, "M{x:.1} {y:.1} v12 ");
    }
    if path.is_empty() {
        return;
    }
    let (class, color) = if allowed {
        ("allowed", ALLOWED)
    } else {
        ("denied", DENIED)
    };
    let _ = writeln!(
        out,
        r#"<path class="{class}" d="{}" stroke="{color}" stroke-width="1"/>"#,
        path.trim_end()
    );
}

/// A step line of the remaining quota over time, from `top` (the
/// capacity) to `top + QUOTA_HEIGHT` (0). Within one pixel column only the
/// lowest, highest and last values are drawn, which is what a column can
/// show.
fn quota_line(out: &mut String, report: &Report, lane: &Lane, top: f64) {
    let Some(first) = lane.quota.first() else {
        return;
    };
    let capacity = lane.capacity.max(1) as f64;
    let y_of = |remaining: u64| top + QUOTA_HEIGHT * (1.0 - (remaining as f64 / capacity).min(1.0));
    let mut pen = Pen::start(x_of(report, first.0), y_of(first.1));
    // The pixel column being drawn: its x, lowest, highest and last y.
    let mut column = (f64::NEG_INFINITY, 0.0, 0.0, 0.0);
    for (at_us, remaining) in &lane.quota[1..] {
        let x = x_of(report, *at_us);
        let y = y_of(*remaining);
        if x.floor() != column.0 {
            pen.column(column);
            let _ = write!(pen.path, " H{x:.1}");
            column = (x.floor(), y, y, y);
        } else {
            column = (column.0, column.1.min(y), column.2.max(y), y);
        }
    }
    pen.column(column);
    let _ = write!(pen.path, " H{PLOT_RIGHT:.1}");
    let _ = writeln!(
        out,
        r#"<path class="quota" d="{}" fill="none" stroke="{QUOTA}" stroke-width="1.5"/>"#,
        pen.path
    );
}

/// A path being drawn, and where its pen is.
struct Pen {
    path: String,
    y: f64,
}

impl Pen {
    fn start(x: f64, y: f64) -> Pen {
        Pen {
            path: format!("M{x:.1} {y:.1}"),
            y,
        }
    }

    /// The vertical moves of one pixel column: lowest, highest, last
    /// (none before the first column).
    fn column(&mut self, (x, low, high, last): (f64, f64, f64, f64)) {
        if !x.is_finite() {
            return;
        }
        for y in [low, high, last] {
            if (y - self.y).abs() >= 0.05 {
                let _ = write!(self.path, " V{y:.1}");
                self.y = y;
            }
        }
    }
}

/// The time axis under the lanes, in seconds.
fn axis(out: &mut String, report: &Report, y: f64) {
    let step_us = tick_step_us(report.duration_us);
    let mut labels = String::new();
    let mut at_us = 0;
    while at_us <= report.duration_us {
        let x = x_of(report, at_us);
        let _ = write!(
            labels,
            r##"<path d="M{x:.1} {y:.1} v5" stroke="#333333"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            y + 18.0,
            seconds(at_us)
        );
        at_us += step_us;
    }
    let _ = writeln!(
        out,
        r##"<g class="axis"><path d="M{PLOT_LEFT} {y:.1} H{PLOT_RIGHT}" stroke="#333333"/>{labels}<text x="{}" y="{:.1}" text-anchor="end">time (s)</text></g>"##,
        PLOT_LEFT - 16.0,
        y + 18.0
    );
}

/// A step of 1, 2 or 5 times a power of ten (in µs) giving at most ten
/// ticks over `duration_us`.
fn tick_step_us(duration_us: u64) -> u64 {
    let mut power = 1u64;
    loop {
        for factor in [1, 2, 5] {
            let step = factor * power;
            if duration_us / step <= 10 {
                return step;
            }
        }
        power = power.saturating_mul(10);
    }
}

/// Text safe inside an element or a double-quoted attribute.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for it in text.chars() {
        match it {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 allows no other control characters.
            '\t' | '\n' | '\r' => out.push(it),
            it if it.is_control() => out.push('\u{fffd}'),
            it => out.push(it),
        }
    }
    out
}

#[cfg(test)]
mod tests;
