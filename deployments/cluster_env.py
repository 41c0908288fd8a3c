"""Environment for the Ray cluster that runs the app: read by Ray's own processes when they start, so it
must be set before `ray start` or `serve run` (scripts/serve does it), and in the shell that runs `serve
deploy` / `serve status` (the auth mode). A value already in the environment wins.

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
- `RAY_AUTH_MODE=token`: every Ray process and client (`ray start`, `serve deploy`, `serve status`)
  authenticates with the cluster's token. Ray 2.60's `ray.init` turns token authentication on for a
  cluster it starts, but a client reads the mode from its own environment: `serve deploy` against a
  `ray start --head` cluster without it sends no token and fails ("Token authentication is enabled but
  no authentication token was found"). `main` also writes a token to ~/.ray/auth_token (mode 0600)
  when none is found (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or that file): on a fresh machine
  `ray start --head` with token mode on and no token refuses to start. Other nodes need the head's token
  (copy the file, or set RAY_AUTH_TOKEN) before they run this, or they would make a token of their own.

The first three together cut the CPU an idle app's Ray processes take beside the replica (`scripts/process_cpu.py`
measures it; docs/benchmarks.md has the figures).

    eval "$(python -m deployments.cluster_env)"   # exports what is not set yet
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from pathlib import Path
from typing import Mapping, Optional

CLUSTER_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_task_events_report_interval_ms": "10000",
}
# Printed by `main` beside CLUSTER_ENV, but not part of `missing` / `with_cluster_env`: a process that has
# imported ray reads the mode once, so setting it later in os.environ (as tests/serve/conftest.py does with
# those) would leave the process without a token while the cluster it starts wants one. `ray.init` turns
# token mode on for a cluster it starts by itself.
AUTH_ENV = {"RAY_AUTH_MODE": "token"}
AUTH_TOKEN_ENV = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # where Ray looks first, then ~/.ray/auth_token


def missing(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The entries of CLUSTER_ENV that `environ` (default: os.environ) does not set."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in CLUSTER_ENV.items() if k not in environ}


def with_cluster_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """`environ` (default: os.environ) with CLUSTER_ENV's defaults added where unset."""
    environ = dict(os.environ if environ is None else environ)
    return {**missing(environ), **environ}


def default_token_path(home: Optional[Path] = None) -> Path:
    """Where Ray reads its token when neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is set."""
    return (home or Path.home()) / ".ray" / "auth_token"


def ensure_auth_token(environ: Optional[Mapping[str, str]] = None, home: Optional[Path] = None) -> Optional[Path]:
    """Write a new random token to ~/.ray/auth_token (mode 0600) when token authentication is on and Ray
    would find no token; the path written, or None when nothing was needed."""
    environ = {**AUTH_ENV, **(os.environ if environ is None else environ)}
    if environ.get("RAY_AUTH_MODE", "").lower() != "token" or any(environ.get(k) for k in AUTH_TOKEN_ENV):
        return None
    path = default_token_path(home)
    if path.is_file() and path.read_text().strip():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # the size of the tokens `ray get-auth-token --generate` makes
    return path


def main() -> None:
    unset = {**missing(), **{k: v for k, v in AUTH_ENV.items() if k not in os.environ}}
    for key, value in unset.items():
        print(f"export {key}={shlex.quote(value)}")
    written = ensure_auth_token()
    if written is not None:
        print(f"[cluster_env] wrote a new Ray auth token to {written}; other nodes of this cluster need a copy",
              file=sys.stderr)


if __name__ == "__main__":
    main()
