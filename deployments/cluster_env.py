"""Environment for the Ray cluster that runs the app: read by Ray's own processes when they start, so it
must be set before `ray start` or `serve run` (scripts/serve does it; `serve deploy` uses whatever the
cluster was started with). A value already in the environment wins.

- `RAY_worker_niceness=0`: Ray starts every worker process, the engine replica included, at niceness
  15, while its GCS, raylet, dashboard and log monitor run at 0. On a small CPU host the replica's BLAS
  threads then yield to every wake-up of those daemons, and a matmul split across the cores waits for
  its preempted half. At 0 the replica shares the cores with them as equals.
- `RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5`: Serve's controller runs its control loop every 0.1 s by
  default, which an idle app's controller and GCS feel most. Deploys and replica restarts react up to
  0.4 s later; health checks and autoscaling keep their own periods.
- `RAY_task_events_report_interval_ms=10000`: every Ray process sends its task events (what `ray list
  tasks` and the dashboard's task views show) to the GCS every second by default; every 10 s they reach
  those views up to 10 s later.

Together they cut the CPU an idle app's Ray processes take beside the replica (`scripts/process_cpu.py`
measures it; docs/benchmarks.md has the figures).

    eval "$(python -m deployments.cluster_env)"   # exports what is not set yet
"""

from __future__ import annotations

import os
import shlex
from typing import Mapping, Optional

CLUSTER_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_task_events_report_interval_ms": "10000",
}


def missing(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The entries of CLUSTER_ENV that `environ` (default: os.environ) does not set."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in CLUSTER_ENV.items() if k not in environ}


def with_cluster_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """`environ` (default: os.environ) with CLUSTER_ENV's defaults added where unset."""
    environ = dict(os.environ if environ is None else environ)
    return {**missing(environ), **environ}


def main() -> None:
    for key, value in missing().items():
        print(f"export {key}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
