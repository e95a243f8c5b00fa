#!/usr/bin/env python3
"""Markdown table rows from bench/compare.sh results (JSON lines).

    bench/table.py [RESULTS...]      # default bench/results.jsonl

One row per case, load and system (in the order first seen), each cell the
range over the rounds (min-max): decisions/s, latency percentiles, CPU per
decision of the service, of redis-server (Redis runs) and of the load
generator, and the errors summed. Python 3 standard library only.
"""

import json
import sys
from pathlib import Path

COLUMNS = [
    "case", "load", "system", "backend", "algorithm", "rounds", "decisions/s",
    "p50 ms", "p99 ms", "p99.9 ms", "service µs/decision", "redis µs/decision",
    "generator µs/decision", "errors",
]


def read(paths):
    """Every summary in the files, skipping blank lines."""
    for path in paths:
        for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    sys.exit(f"{path}:{line_no}: not JSON: {err}")


def group(summaries):
    """Summaries by (case, load, system, backend, algorithm), in order."""
    groups = {}
    for s in summaries:
        labels = s.get("labels", {})
        load = labels.get("load") or f"{s['connections']}x{s['streams']}"
        key = (labels.get("case", "-"), load, labels.get("system", "-"),
               labels.get("backend", "-"), labels.get("algorithm", "-"))
        groups.setdefault(key, []).append(s)
    return groups


def span(values, fmt):
    """`min–max` (or one value) of the values that are not None."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}–{high}"


def cpu(summary, label):
    return next((c["us_per_decision"] for c in summary.get("cpu", [])
                 if c["label"] == label), None)


def ms(us):
    return f"{us / 1000:.2f}"


def row(key, runs):
    rate = span([s["rate"] for s in runs], lambda v: f"{v:,.0f}")
    cells = list(key) + [
        str(len(runs)),
        rate,
        span([s["p50_us"] for s in runs], ms),
        span([s["p99_us"] for s in runs], ms),
        span([s["p99_9_us"] for s in runs], ms),
        span([cpu(s, "service") for s in runs], lambda v: f"{v:.1f}"),
        span([cpu(s, "redis") for s in runs], lambda v: f"{v:.1f}"),
        span([s.get("generator_us_per_decision") for s in runs], lambda v: f"{v:.1f}"),
        str(sum(s["errors"] for s in runs)),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv):
    paths = argv[1:] or [Path(__file__).parent / "results.jsonl"]
    groups = group(read(paths))
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for key, runs in groups.items():
        print(row(key, runs))


if __name__ == "__main__":
    main(sys.argv)
