"""Where Prometheus finds every process of a running app: a file_sd targets file.

Each process (every ingress, every engine replica, the admission controller) serves its own /metrics on a
port that may move (a taken port falls back to a free one; replicas restart, autoscale, land on other
hosts). This module asks the running app where they are and writes them as a Prometheus `file_sd_configs`
file, which Prometheus re-reads whenever it changes:

    scrape_configs:
      - job_name: mlx-serve
        file_sd_configs: [{files: [/path/to/targets.json]}]

scripts/serve (deployments/supervisor.py) rewrites it every FILE_SD_REFRESH_S while it runs
(`--prometheus-file-sd`); against a cluster started with `ray start` / `serve deploy`:

    python -m deployments.telemetry.discovery config/serve.yaml --out targets.json [--every 15]

For hosts other than Prometheus's, bind the endpoints to a reachable address (`telemetry.prometheus_host:
0.0.0.0` in serve.yaml): their URLs then name the node's IP.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence
from urllib.parse import urlparse

if TYPE_CHECKING:
    from deployments.app import AppArgs, ConfiguredApp


FILE_SD_REFRESH_S = 15.0  # how often the supervisor rewrites the file (Prometheus re-reads it on change)
CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MetricsEndpoint:
    """One process's /metrics."""

    app_name: str
    role: str  # "ingress" | "replica" | "admission"
    url: str
    replica_id: Optional[str] = None


def file_sd_targets(endpoints: list[MetricsEndpoint]) -> list[dict[str, Any]]:
    """Prometheus file_sd entries, one per endpoint: `host:port` (the path is /metrics, Prometheus's
    default) with the labels app, role and (replicas) replica; `job` is the scrape config's."""
    entries = []
    for e in sorted(endpoints, key=lambda e: (e.app_name, e.role, e.replica_id or "", e.url)):
        labels = {"app": e.app_name, "role": e.role}
        if e.replica_id:
            labels["replica"] = e.replica_id
        entries.append({"targets": [urlparse(e.url).netloc], "labels": labels})
    return entries


def write_file_sd(path: str, endpoints: list[MetricsEndpoint]) -> None:
    """Write the targets atomically (Prometheus may read the file at any moment)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".targets-", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(file_sd_targets(endpoints), f, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _sample(call: Callable[[], Any], key: Callable[[Any], Optional[str]], num: int, max_calls: int) -> list[Any]:
    """Distinct answers (by `key`) of up to max_calls calls routed by Serve, until `num` are seen."""
    seen: dict[str, Any] = {}
    for _ in range(max_calls):
        answer = call()
        k = key(answer)
        if k is not None:
            seen[k] = answer
        if len(seen) >= num:
            break
    return list(seen.values())


def collect_endpoints(app_name: str, app_args: AppArgs, max_calls: int = 64) -> list[MetricsEndpoint]:
    """The /metrics URLs of a running app's processes (ingresses and replicas by sampling their handles,
    as many as Serve reports running; the admission controller by name)."""
    import ray
    from ray import serve

    from deployments.admission.actor import NAMESPACE, controller_name
    from deployments.app import INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT

    deployments = serve.status().applications[app_name].deployments

    def running(name: str) -> int:
        return deployments[name].replica_states.get("RUNNING", 0) if name in deployments else 0

    ingress = serve.get_app_handle(app_name)
    replicas = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=app_name)
    out = [MetricsEndpoint(app_name, "ingress", url) for url in _sample(
        lambda: ingress.metrics_url.remote().result(timeout_s=CALL_TIMEOUT_S), lambda url: url,
        running(INGRESS_DEPLOYMENT), max_calls)]
    out += [MetricsEndpoint(app_name, "replica", s.prometheus_url, s.replica_id) for s in _sample(
        lambda: replicas.stats.remote().result(timeout_s=CALL_TIMEOUT_S),
        lambda s: s.replica_id if s.prometheus_url else None, running(REPLICA_DEPLOYMENT), max_calls)]
    if app_args.admission.enabled:
        try:
            controller = ray.get_actor(controller_name(app_args.admission, app_name), namespace=NAMESPACE)
            url = ray.get(controller.stats.remote(), timeout=CALL_TIMEOUT_S).prometheus_url
        except Exception:  # noqa: BLE001 - not created yet (it starts with the first replica)
            url = None
        if url:
            out.append(MetricsEndpoint(app_name, "admission", url))
    return out


def refresh(apps: Sequence[ConfiguredApp], out: str) -> list[MetricsEndpoint]:
    """Collect the endpoints of every app of `apps` that is running and write them to `out`; returns them."""
    from ray import serve

    status = serve.status().applications
    endpoints: list[MetricsEndpoint] = []
    for app in apps:
        if app.name in status and str(status[app.name].status).endswith("RUNNING"):
            endpoints += collect_endpoints(app.name, app.args)
    write_file_sd(out, endpoints)
    return endpoints


def main(argv: Optional[list[str]] = None) -> None:
    import ray

    from deployments.app import read_configured_apps

    p = argparse.ArgumentParser(prog="python -m deployments.telemetry.discovery",
                                description="Write a Prometheus file_sd targets file of a running app.")
    p.add_argument("config", nargs="?", default="config/serve.yaml")
    p.add_argument("--out", required=True, help="the targets file (JSON) Prometheus's file_sd_configs reads")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or "auto", help="the Ray cluster")
    p.add_argument("--every", type=float, default=0.0, help="rewrite it this often (seconds); 0: once")
    args = p.parse_args(argv)
    apps = read_configured_apps(args.config)
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    while True:
        endpoints = refresh(apps, args.out)
        print(f"[discovery] {len(endpoints)} /metrics endpoints -> {args.out}", flush=True)
        if args.every <= 0:
            return
        time.sleep(args.every)


if __name__ == "__main__":
    main()
