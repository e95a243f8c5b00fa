#!/usr/bin/env python3
"""The soak's config and its watch, for bench/soak.sh (run it, not this).

    soak.py config RATE VARIANT PATH
        writes the soak's rules for RATE requests/s (VARIANT 0 or 1
        alternates one limit) to PATH, by a rename over it;
    soak.py watch ...
        runs throttlegate-load paced for the soak, and at each of its
        interval lines samples the service (RSS, descriptors), Redis
        (used_memory, DBSIZE) and the reload count; rewrites the config
        every --reload-every seconds; prints a report line per interval,
        then a table and a verdict; exit 1 when the verdict fails.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

HOT_KEYS = 8
HOT_SHARE = 0.5


def hot_per_minute(rate):
    """Requests per minute on each hot value at RATE requests/s."""
    return max(1, round(rate * HOT_SHARE / HOT_KEYS * 60))


def config_text(rate, variant):
    """Rules of domain `soak` under `client`: every hot value a rule of its
    own, each with another algorithm; values 0 and 1 get less than their
    traffic (over limit, value 0's limit alternating between a quarter
    and a half of it with VARIANT), the others ten times their traffic;
    the fresh tail falls to the key-only rule, a sliding log of a minute
    (one request each: allowed, and expiring a minute later)."""
    per_minute = hot_per_minute(rate)
    zero = per_minute // 4 if variant == 0 else per_minute // 2
    algorithms = ["sliding_window_counter", "gcra", "fixed_window", "token_bucket"]
    lines = ["domain: soak", "descriptors:"]
    for value in range(HOT_KEYS):
        if value == 0:
            limit = zero
        elif value == 1:
            limit = per_minute // 2
        else:
            limit = per_minute * 10
        algorithm = algorithms[value % len(algorithms)]
        lines += [
            "  - key: client",
            f'    value: "{value}"',
            f"    rate_limit: {{unit: minute, requests_per_unit: {max(1, limit)}, algorithm: {algorithm}}}",
        ]
    lines += [
        "  - key: client",
        "    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: sliding_window_log}",
    ]
    return "\n".join(lines) + "\n"


def write_config(path, rate, variant):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        out.write(config_text(rate, variant))
    os.replace(tmp, path)


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def redis(port, *command):
    return subprocess.run(
        ["redis-cli", "-p", str(port), *command],
        capture_output=True, text=True, check=True,
    ).stdout


def redis_memory_and_keys(port):
    info = redis(port, "info", "memory")
    used = next(
        int(line.split(":")[1]) for line in info.splitlines()
        if line.startswith("used_memory:")
    )
    return used, int(redis(port, "dbsize").strip())


def reloads(http):
    """(ok, error) from throttlegate_config_reloads_total."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=5) as res:
        text = res.read().decode()
    counts = {"ok": 0, "error": 0}
    for line in text.splitlines():
        for result in counts:
            prefix = f'throttlegate_config_reloads_total{{result="{result}"}} '
            if line.startswith(prefix):
                counts[result] = int(float(line[len(prefix):]))
    return counts["ok"], counts["error"]


COLUMNS = [
    # name, header, width, format
    ("elapsed", "elapsed_s", 9, "{:.0f}"),
    ("rate", "decisions/s", 11, "{:.0f}"),
    ("ok", "ok", 9, "{}"),
    ("over_limit", "over_limit", 10, "{}"),
    ("errors", "errors", 6, "{}"),
    ("late", "late", 7, "{}"),
    ("p50_us", "p50_µs", 7, "{}"),
    ("p99_us", "p99_µs", 7, "{}"),
    ("p99_9_us", "p99.9_µs", 8, "{}"),
    ("rss_mb", "rss_MB", 7, "{:.1f}"),
    ("fds", "fds", 4, "{}"),
    ("cpu_pct", "cpu_%", 6, "{:.1f}"),
    ("redis_cpu_pct", "redis_%", 7, "{:.1f}"),
    ("redis_mb", "redis_MB", 8, "{:.1f}"),
    ("dbsize", "dbsize", 8, "{}"),
    ("reloads", "reloads", 7, "{}"),
]


def header():
    return " ".join(f"{title:>{width}}" for _, title, width, _ in COLUMNS)


def row(report):
    cells = []
    for name, _, width, fmt in COLUMNS:
        value = report.get(name)
        cells.append(f"{'-' if value is None else fmt.format(value):>{width}}")
    return " ".join(cells)


def markdown(reports):
    lines = ["| " + " | ".join(title for _, title, _, _ in COLUMNS) + " |",
             "|" + "---:|" * len(COLUMNS)]
    for report in reports:
        cells = []
        for name, _, _, fmt in COLUMNS:
            value = report.get(name)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_share(interval, label):
    for cpu in interval.get("cpu", []):
        if cpu["label"] == label and cpu["seconds"] is not None and interval["seconds"] > 0:
            return cpu["seconds"] * 100 / interval["seconds"]
    return None


def watch(args):
    command = [
        args.load, "--addr", f"http://{args.grpc}", "--domain", "soak", "--key", "client",
        "--distribution", "hot-and-fresh", "--hot-keys", str(HOT_KEYS),
        "--hot-share", str(HOT_SHARE), "--rate", str(args.rate),
        "--duration", f"{args.duration}s", "--report-every", f"{args.report_every}s",
        "--connections", str(args.connections), "--streams", str(args.streams),
        "--pid", f"service={args.service_pid}", "--pid", f"redis={args.redis_pid}",
        "--label", "run=soak",
    ]
    print("load:", " ".join(command), flush=True)
    load = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1)
    started = time.monotonic()
    variant = 0
    next_reload = started + args.reload_every
    reload_checks = []  # (written at elapsed, ok count before, ok count after)
    ok_before, errors_before = reloads(args.http)
    pending = None  # (elapsed written, ok count before) awaiting its check
    reports, summary = [], None
    print(header(), flush=True)
    raw = open(args.raw, "w") if args.raw else None
    for line in load.stdout:
        if raw:
            raw.write(line)
        now = time.monotonic()
        if line.startswith("summary "):
            summary = json.loads(line[len("summary "):])
            continue
        if not line.startswith("interval "):
            continue
        interval = json.loads(line[len("interval "):])
        if interval["seconds"] < args.report_every / 2:
            # The rest drained after the last tick: the answers of the
            # requests still in flight, a few milliseconds' worth (they
            # count in the whole-run summary).
            continue
        ok_count, error_count = reloads(args.http)
        if pending and now - started >= pending[0] + args.reload_settle:
            reload_checks.append((pending[0], pending[1], ok_count))
            pending = None
        used, keys = redis_memory_and_keys(args.redis_port)
        report = {
            "elapsed": interval["elapsed"],
            "rate": interval["rate"],
            "ok": interval["ok"],
            "over_limit": interval["over_limit"],
            "errors": interval["errors"],
            "late": interval["late"],
            "p50_us": interval["p50_us"],
            "p99_us": interval["p99_us"],
            "p99_9_us": interval["p99_9_us"],
            "rss_mb": rss_kb(args.service_pid) / 1024,
            "fds": open_fds(args.service_pid),
            "cpu_pct": cpu_share(interval, "service"),
            "redis_cpu_pct": cpu_share(interval, "redis"),
            "redis_mb": used / 2**20,
            "dbsize": keys,
            "reloads": ok_count - ok_before,
            "reload_errors": error_count - errors_before,
        }
        reports.append(report)
        print(row(report), flush=True)
        # Rewrite the config between interval lines, never in the last
        # interval (its reload could not be checked).
        if now >= next_reload and now - started + args.reload_settle < args.duration:
            variant = 1 - variant
            pending = (now - started, ok_count)
            write_config(args.config, args.rate, variant)
            next_reload = now + args.reload_every
    code = load.wait()
    if raw:
        raw.close()
    if pending:
        time.sleep(max(0.0, pending[0] + args.reload_settle - (time.monotonic() - started)))
        reload_checks.append((pending[0], pending[1], reloads(args.http)[0]))
    return verdict(args, reports, summary, code, reload_checks)


def verdict(args, reports, summary, code, reload_checks):
    print()
    print(markdown(reports))
    print()
    failures = []
    if code != 0:
        failures.append(f"throttlegate-load exited with {code}")
    if summary is None:
        failures.append("no summary line from throttlegate-load")
        errors = None
    else:
        errors = summary["errors"]
        print(
            f"whole run: {summary['requests']} requests in {summary['seconds']:.0f} s, "
            f"{summary['rate']:.0f} decisions/s (target {args.rate:.0f}), ok {summary['ok']}, "
            f"over_limit {summary['over_limit']}, errors {errors} {summary['errors_by_code']}, "
            f"late {summary['late']}, latency µs p50 {summary['p50_us']} p99 {summary['p99_us']} "
            f"p99.9 {summary['p99_9_us']} max {summary['max_us']}"
        )
        if errors:
            failures.append(f"{errors} errors: {summary['errors_by_code']}")
    # The report of the run's last interval is sampled as the generator
    # closes its connections (its descriptors gone from the service's
    # count): compare up to the last one before that.
    after_warmup = [
        r for r in reports
        if args.warmup <= r["elapsed"] < args.duration - args.report_every / 2
    ]
    if len(after_warmup) < 2:
        failures.append(f"fewer than two reports after the {args.warmup} s warm-up")
    else:
        first, last = after_warmup[0], after_warmup[-1]
        span = f"{first['elapsed']:.0f} s to {last['elapsed']:.0f} s"
        rss_growth = last["rss_mb"] - first["rss_mb"]
        rss_peak = max(r["rss_mb"] for r in after_warmup)
        fd_growth = last["fds"] - first["fds"]
        key_growth = last["dbsize"] / max(1, first["dbsize"]) - 1
        print(f"service RSS {span}: {first['rss_mb']:.1f} -> {last['rss_mb']:.1f} MB "
              f"({rss_growth:+.1f} MB; peak {rss_peak:.1f}; bound +{args.max_rss_growth_mb} MB)")
        print(f"service descriptors {span}: {first['fds']} -> {last['fds']} ({fd_growth:+d}; "
              f"bound +{args.max_fd_growth})")
        print(f"Redis keys {span}: {first['dbsize']} -> {last['dbsize']} ({key_growth:+.0%}; "
              f"bound +{args.max_key_growth:.0%}); used_memory {first['redis_mb']:.1f} -> "
              f"{last['redis_mb']:.1f} MB")
        if rss_growth > args.max_rss_growth_mb:
            failures.append(f"service RSS grew {rss_growth:.1f} MB")
        if fd_growth > args.max_fd_growth:
            failures.append(f"service descriptors grew by {fd_growth}")
        if key_growth > args.max_key_growth:
            failures.append(f"Redis keys grew {key_growth:.0%}: no plateau")
    missed = [at for at, before, after in reload_checks if after <= before]
    print(f"config rewrites: {len(reload_checks)}, each followed by a reload: "
          f"{'yes' if not missed else 'no, not after those at ' + str([round(m) for m in missed]) + ' s'}")
    if not reload_checks:
        failures.append("no config rewrite was checked")
    if missed:
        failures.append(f"{len(missed)} config rewrites without a reload")
    reload_errors = reports[-1]["reload_errors"] if reports else 0
    if reload_errors:
        failures.append(f"{reload_errors} refused reloads")
    if failures:
        print("verdict: FAIL: " + "; ".join(failures))
        return 1
    print("verdict: PASS (no errors, RSS, descriptors and Redis keys flat within their bounds, "
          "every config rewrite reloaded)")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config")
    config.add_argument("rate", type=float)
    config.add_argument("variant", type=int, choices=[0, 1])
    config.add_argument("path")
    run = commands.add_parser("watch")
    run.add_argument("--load", required=True)
    run.add_argument("--grpc", required=True)
    run.add_argument("--http", required=True)
    run.add_argument("--redis-port", type=int, required=True)
    run.add_argument("--service-pid", type=int, required=True)
    run.add_argument("--redis-pid", type=int, required=True)
    run.add_argument("--config", required=True)
    run.add_argument("--rate", type=float, required=True)
    run.add_argument("--duration", type=int, required=True)
    run.add_argument("--report-every", type=int, default=30)
    run.add_argument("--reload-every", type=int, default=60)
    run.add_argument("--reload-settle", type=float, default=5.0,
                     help="seconds a rewrite gets to be reloaded before it is checked")
    run.add_argument("--warmup", type=int, default=120)
    run.add_argument("--connections", type=int, default=4)
    run.add_argument("--streams", type=int, default=32)
    run.add_argument("--max-rss-growth-mb", type=float, default=10.0)
    run.add_argument("--max-fd-growth", type=int, default=4)
    run.add_argument("--max-key-growth", type=float, default=0.25)
    run.add_argument("--raw", help="copy of the generator's output")
    args = parser.parse_args()
    if args.command == "config":
        write_config(args.path, args.rate, args.variant)
        return 0
    return watch(args)


if __name__ == "__main__":
    sys.exit(main())
