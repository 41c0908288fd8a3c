#!/usr/bin/env python3
"""CPU time of every process on this host over an interval (Linux /proc), busiest first; prints JSON.

What the serving benchmarks' CPU figures rest on: on a 2-core host the engine replica shares the cores
with Ray's own processes (GCS, raylet, dashboard, Serve's controller and proxy, the ingress), and every
one of them shows up here with its niceness.

    python scripts/process_cpu.py --seconds 30 [--top 15] [--out cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Optional


def read_stat(pid: int) -> Optional[tuple[str, list[str]]]:
    """/proc/<pid>/stat as (command name, fields from field 3 on: state, ppid, pgrp, ...); None if the
    process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def pids() -> list[int]:
    """Every process id in /proc (none where there is no /proc)."""
    root = Path("/proc")
    return [int(e.name) for e in root.iterdir() if e.name.isdigit()] if root.is_dir() else []


def snapshot() -> dict[int, tuple[int, int, str]]:
    """pid -> (user + system clock ticks, niceness, command line)."""
    out = {}
    for pid in pids():
        stat = read_stat(pid)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        if stat is None:
            continue
        name, fields = stat
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        out[pid] = (ticks, int(fields[16]), cmd or f"[{name}]")  # nice: field 19
    return out


def measure(seconds: float) -> dict:
    hz = os.sysconf("SC_CLK_TCK")
    before = snapshot()
    start = time.monotonic()
    time.sleep(seconds)
    after = snapshot()
    elapsed = time.monotonic() - start
    rows = []
    for pid, (ticks, nice, cmd) in after.items():
        if pid in before:
            pct = 100.0 * (ticks - before[pid][0]) / hz / elapsed
            if pct > 0:
                rows.append({"pid": pid, "cpu_percent": round(pct, 2), "nice": nice, "command": cmd[:120]})
    rows.sort(key=lambda r: -r["cpu_percent"])
    return {"seconds": round(elapsed, 2), "cpu_count": os.cpu_count(),
            "total_cpu_percent": round(sum(r["cpu_percent"] for r in rows), 2), "processes": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--top", type=int, default=0, help="keep the N busiest processes (0: all)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    if args.seconds <= 0:
        p.error(f"--seconds={args.seconds} must be > 0")
    result = measure(args.seconds)
    if args.top:
        result["processes"] = result["processes"][: args.top]
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
