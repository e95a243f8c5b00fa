#!/usr/bin/env python3
"""Throughput and p99 latency against concurrency, as an SVG drawn by hand.

    bench/plot.py RESULTS [-o docs/img/concurrency.svg] [--case base] [--title T]

RESULTS holds bench/compare.sh summary lines (JSON lines). Each system and
backend (throttlegate memory, throttlegate Redis, ...) is one line in both
panels; concurrency (connections x streams) is on a log-2 axis, and each
point is the median over the rounds, with a bar from the lowest to the
highest round. Python 3 standard library only.
"""

import argparse
import json
import math
import statistics
from pathlib import Path
from xml.sax.saxutils import escape

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
PANEL_W, PANEL_H = 380, 260
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 70, 20, 58, 50
LEGEND_H = 28


def series(paths, case):
    """{(system, backend): {concurrency: [(rate, p99_ms), ...]}}."""
    found = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            s = json.loads(line)
            labels = s.get("labels", {})
            if case is not None and labels.get("case", "base") != case:
                continue
            name = (labels.get("system", "?"), labels.get("backend", "?"))
            points = found.setdefault(name, {}).setdefault(s["concurrency"], [])
            points.append((s["rate"], s["p99_us"] / 1000))
    return found


def nice_ticks(top):
    """About five round ticks from 0 to at least `top`."""
    if top <= 0:
        return [0, 1]
    raw = top / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    count = math.ceil(top / step)
    return [i * step for i in range(count + 1)]


def label(value):
    if value >= 1000 and value % 1000 == 0:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def panel(x0, title, ylabel, data, index, xs):
    """One panel's SVG elements; `index` picks rate (0) or p99 (1)."""
    out = []
    left, top = x0 + MARGIN_L, MARGIN_T
    width, height = PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B
    highest = max((v[index] for pts in data.values() for vs in pts.values() for v in vs),
                  default=1)
    yticks = nice_ticks(highest * 1.05)
    lo, hi = math.log2(min(xs)), math.log2(max(xs))

    def px(c):
        return left + (0.5 if hi == lo else (math.log2(c) - lo) / (hi - lo)) * width

    def py(v):
        return top + height - v / yticks[-1] * height

    out.append(f'<text x="{left + width / 2}" y="{top - 16}" text-anchor="middle" '
               f'font-weight="bold">{escape(title)}</text>')
    for tick in yticks:
        y = py(tick)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + width}" y2="{y:.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label(tick)}</text>')
    for c in xs:
        out.append(f'<text x="{px(c):.1f}" y="{top + height + 18}" '
                   f'text-anchor="middle">{c}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{width}" height="{height}" '
               f'fill="none" stroke="#444"/>')
    out.append(f'<text x="{left + width / 2}" y="{top + height + 38}" text-anchor="middle">'
               f'requests in flight (connections × streams)</text>')
    out.append(f'<text transform="translate({x0 + 16},{top + height / 2}) rotate(-90)" '
               f'text-anchor="middle">{escape(ylabel)}</text>')
    for colour, (name, points) in zip(COLOURS, sorted(data.items())):
        coords = []
        for c in sorted(points):
            values = [v[index] for v in points[c]]
            x, y = px(c), py(statistics.median(values))
            coords.append(f"{x:.1f},{y:.1f}")
            out.append(f'<line x1="{x:.1f}" y1="{py(min(values)):.1f}" x2="{x:.1f}" '
                       f'y2="{py(max(values)):.1f}" stroke="{colour}"/>')
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')
        out.append(f'<polyline points="{" ".join(coords)}" fill="none" stroke="{colour}" '
                   f'stroke-width="2"/>')
    return out


def legend(data, y):
    out, x = [], MARGIN_L
    for colour, name in zip(COLOURS, sorted(data)):
        text = " ".join(name)
        out.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{colour}" '
                   f'stroke-width="2"/>')
        out.append(f'<text x="{x + 26}" y="{y + 4}">{escape(text)}</text>')
        x += 40 + 8 * len(text)
    return out


def svg(data, title):
    xs = sorted({c for points in data.values() for c in points})
    width, height = 2 * PANEL_W, PANEL_H + LEGEND_H + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">'
             f'{escape(title)}</text>']
    parts += panel(0, "Throughput", "decisions/s", data, 0, xs)
    parts += panel(PANEL_W, "p99 latency", "ms", data, 1, xs)
    parts += legend(data, PANEL_H + 16)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("-o", "--output", default="docs/img/concurrency.svg")
    parser.add_argument("--case", default="base",
                        help="the compare.sh case to plot (default base; 'all' for every one)")
    parser.add_argument("--title", default="throttlegate: decisions/s and p99 by concurrency")
    args = parser.parse_args()
    data = series(args.results, None if args.case == "all" else args.case)
    if not data:
        raise SystemExit(f"no results for case {args.case!r} in {args.results}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(svg(data, args.title))
    print(f"wrote {args.output}: {', '.join(' '.join(n) for n in sorted(data))}")


if __name__ == "__main__":
    main()
