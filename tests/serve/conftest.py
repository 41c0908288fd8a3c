"""Fixtures of the Serve tests: the repo root on sys.path, and one Ray cluster for the whole session.

The cluster is started lazily by the `ray_cluster` fixture (only the end-to-end tests need it) and shared by
the modules until one needing its own cluster stops it (`local_ray.stop()`), with a
small CPU count and no dashboard; Serve's HTTP proxy listens on 127.0.0.1 on a free port.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRay:
    """The plain `ray.init` cluster the end-to-end modules share, started on first use. A module that needs
    a cluster of its own (test_admission.py: `ray.cluster_utils.Cluster` with two nodes) stops it first;
    the next module that asks for it starts it again."""

    def __init__(self) -> None:
        self.url: Optional[str] = None

    def ensure(self) -> str:
        import ray
        from ray import serve

        if self.url is not None and ray.is_initialized():
            return self.url
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
        from deployments.cluster_env import missing

        os.environ.update(missing())  # the cluster's environment as scripts/serve sets it
        ray.init(
            address="local",  # always a new cluster: never attach to another Ray running on the machine
            num_cpus=4,  # logical CPUs: ingress 0.1 + engine replicas 0.5 each fit with room to spare
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
            configure_logging=False,
            log_to_driver=False,
        )
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        import ray
        from ray import serve

        if self.url is not None and ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        self.url = None


@pytest.fixture(scope="session")
def local_ray():
    local = LocalRay()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def ray_cluster(local_ray):
    """A local Ray cluster plus Serve on http://127.0.0.1:<port>; yields the base URL (shared by modules)."""
    return local_ray.ensure()


def named_actor(name: str, namespace: str, attempts: int = 20):
    """ray.get_actor, retried: a lookup of a live named actor failed once in CI ("Failed to look up
    actor with name ..."), a transient of Ray's actor directory."""
    import ray

    for attempt in range(attempts):
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.25)
