"""Fixtures of the Serve tests: the repo root on sys.path, and one Ray cluster for the whole session.

The cluster is started lazily by the `ray_cluster` fixture (only the end-to-end tests need it) with a
small CPU count and no dashboard; Serve's HTTP proxy listens on 127.0.0.1 on a free port.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster plus Serve on http://127.0.0.1:<port>; yields the base URL."""
    import ray
    from ray import serve

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    ray.init(
        num_cpus=4,  # logical CPUs: ingress 0.1 + engine replicas 0.5 each fit with room to spare
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
        configure_logging=False,
        log_to_driver=False,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
