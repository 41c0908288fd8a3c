"""What scripts/serve runs instead of `serve run`: a local Ray cluster, the app of a Serve config, and a
graceful stop on SIGTERM (what systemd and Kubernetes send) or SIGINT.

    python -m deployments.supervisor config/serve.yaml [--drain-timeout-s 30] [--address ADDR]

`serve run` aborts on SIGTERM with Ray's stack, and its proxy is killed with the app, cutting the streams
in flight. Here a stop drains first (deployments/ingress/drain.py): new requests and /health get 503 with
Retry-After, requests in flight have `--drain-timeout-s` to finish (then they end with an error, a stream
with an error event), then Serve and Ray shut down and the process exits with status 0. A second signal
skips the rest of the drain. The config is deployed as `serve run` and `serve deploy` do (Serve's
ServeDeploySchema: http_options, proxy_location, per-deployment overrides, runtime_env).

Under systemd use `KillMode=mixed` (SIGTERM to this process only): the default sends SIGTERM to every
process of the unit, Ray's too, and they would die before the drain.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from deployments.app import ConfiguredApp

logger = logging.getLogger("mlx_serve.supervisor")

FLUSH_S = 1.0  # after the last request ends: its final bytes leave through the proxy before it stops
POLL_S = 0.2
CALL_TIMEOUT_S = 30.0
SILENT_S = 5.0  # an ingress silent this long after the drain's start is taken for gone


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deployments.supervisor", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="config/serve.yaml", help="Serve config (serve.yaml)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="longest wait for requests in flight after SIGTERM (default 30)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or "local",
                   help="Ray cluster to use (default: $RAY_ADDRESS, else a new local cluster)")
    p.add_argument("--prometheus-file-sd", default=os.environ.get("MLX_SERVE_PROMETHEUS_FILE_SD") or None,
                   help="keep a Prometheus file_sd targets file of every process's /metrics here "
                        "(deployments/telemetry/discovery.py; default: $MLX_SERVE_PROMETHEUS_FILE_SD)")
    args = p.parse_args(argv)
    if args.drain_timeout_s < 0:
        p.error(f"--drain-timeout-s={args.drain_timeout_s} must be >= 0")
    return args


class Stop:
    """Set by the first SIGTERM / SIGINT; a second one asks to skip the drain."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.forced = threading.Event()
        self.signal_name = ""

    def handle(self, signum: int, _frame: Any) -> None:
        if self.requested.is_set():
            self.forced.set()
            return
        self.signal_name = signal.Signals(signum).name
        self.requested.set()


def deploy(raw_config: dict[str, Any], address: str) -> Any:
    """Ray, the drain signal and the config's apps, as `serve run` starts them; returns the signal."""
    import ray
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    from deployments.ingress.drain import DRAIN_ACTOR_NAME, DRAIN_NAMESPACE, DrainSignal

    config = ServeDeploySchema.model_validate(raw_config)
    ray.init(address=address, namespace=DRAIN_NAMESPACE)
    drain = ray.remote(DrainSignal).options(name=DRAIN_ACTOR_NAME, namespace=DRAIN_NAMESPACE, num_cpus=0,
                                            get_if_exists=True).remote()
    client = serve_api.serve_start(http_options=config.http_options.model_dump(),
                                   proxy_location=config.proxy_location,
                                   grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
                                   controller_options=config.controller_options)
    client.deploy_apps(config, _blocking=False)
    http = config.http_options
    print(f"[serve] OpenAI API on http://{http.host}:{http.port}/v1  (health: /health)", flush=True)
    return drain


def drain(signal_actor: Any, timeout_s: float, stop: Stop) -> dict[str, int]:
    """Start the drain and wait until no ingress has requests in flight, the deadline passes (a little
    later than the ingresses' own, so they end theirs with an error first) or a second signal comes.
    Returns the ingresses still busy."""
    import ray

    ray.get(signal_actor.start.remote(timeout_s), timeout=CALL_TIMEOUT_S)
    started = time.monotonic()
    deadline = started + timeout_s + 2.0

    def busy() -> dict[str, int]:
        # An ingress that never reports (-1) after SILENT_S is gone (replaced earlier, or dead): a live one
        # reports as soon as its wait returns.
        pending = ray.get(signal_actor.pending.remote(), timeout=CALL_TIMEOUT_S)
        return {k: n for k, n in pending.items() if n > 0 or time.monotonic() - started < SILENT_S}

    pending = busy()
    while pending and time.monotonic() < deadline and not stop.forced.is_set():
        time.sleep(POLL_S)
        pending = busy()
    return pending


def keep_file_sd(apps: Sequence[ConfiguredApp], out: str, stop: Stop) -> threading.Thread:
    """A thread that rewrites the targets file of `apps` every FILE_SD_REFRESH_S until the stop."""
    from deployments.telemetry.discovery import FILE_SD_REFRESH_S, refresh

    def loop() -> None:
        wait_s, known = 2.0, -1
        while not stop.requested.wait(wait_s):
            try:
                found = len(refresh(apps, out))
            except Exception as e:  # noqa: BLE001 - the app is still starting, or a replica restarts
                logger.debug("file_sd refresh failed: %r", e)
                continue
            if found != known:
                print(f"[serve] Prometheus targets: {found} /metrics endpoints in {out}", flush=True)
                known = found
            wait_s = FILE_SD_REFRESH_S if found else 2.0

    thread = threading.Thread(target=loop, name="file-sd", daemon=True)
    thread.start()
    return thread


def run(args: argparse.Namespace) -> int:
    import ray
    import yaml
    from ray import serve

    from deployments.app import configured_apps

    with open(args.config) as f:  # read once: Serve deploys it, the file_sd thread finds its apps' endpoints
        raw_config = yaml.safe_load(f)
    apps = configured_apps(raw_config) if args.prometheus_file_sd else []
    stop = Stop()
    signal_actor = deploy(raw_config, args.address)
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(signum, stop.handle)
    print(f"[serve] deployed {args.config}; SIGTERM or Ctrl-C drains (up to {args.drain_timeout_s:g} s) "
          "and stops", flush=True)
    file_sd = keep_file_sd(apps, args.prometheus_file_sd, stop) if args.prometheus_file_sd else None
    while not stop.requested.wait(1.0):
        pass
    print(f"[serve] {stop.signal_name}: draining; new requests get 503", flush=True)
    try:
        pending = drain(signal_actor, args.drain_timeout_s, stop)
        if pending:
            print(f"[serve] drain ended with requests still in flight: {pending}", flush=True)
        time.sleep(FLUSH_S)
    except Exception as e:  # noqa: BLE001 - a failed drain must not stop the shutdown
        print(f"[serve] drain failed ({type(e).__name__}: {e}); shutting down", flush=True)
    try:
        serve.shutdown()
    except Exception as e:  # noqa: BLE001 - e.g. Ctrl-C in a terminal also reached Ray's own processes
        print(f"[serve] Serve shutdown failed ({type(e).__name__}: {e})", flush=True)
    if file_sd is not None:
        from deployments.telemetry.discovery import write_file_sd

        file_sd.join(timeout=CALL_TIMEOUT_S)
        write_file_sd(args.prometheus_file_sd, [])  # nothing to scrape any more
    ray.shutdown()
    print("[serve] stopped", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
