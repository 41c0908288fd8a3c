"""Soak test: a bounded run at ~80% of admitted capacity, 10% random cancellations, one replica restart.

    python scripts/soak.py                               # starts the app itself: tiny model, 2 replicas, 10 min
    python scripts/soak.py --duration-s 180 --model default
    python scripts/soak.py --url http://127.0.0.1:8000 --model-name SmolLM2-135M-Instruct   # a running app
                                                         # (no restart, no replica stats unless --ray-address)

Concurrency is `load` x (max_num_seqs x replicas): that many clients loop, each sending one request at a
time (prompt and max_tokens drawn at random, half of them streamed); `cancel_fraction` of the requests are
abandoned by the client after a random short delay. Halfway through, one engine replica actor is killed
through Ray (Serve restarts it). Ends with one JSON summary on stdout: outcomes by status, errors that are
not allowed (anything but 200, 503, 429, a client cancel, and errors of requests in flight on the killed
replica), replica RSS and MLX memory (medians) in the first and last quarter with `memory_flat` (MLX active memory
beside the KV pool grew by at most 8 MB on every replica alive the whole run), and the
replicas' and admission controller's state after
the run (running, waiting, KV in use, reservations: all should be zero; the prefix cache's bytes, which
finished requests leave behind by design, beside them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

APP = "soak"
REPLICA_DEPLOYMENT = "EngineReplica"
ALLOWED = {"200", "503", "429", "cancelled"}
WORDS = "the a of to and in is it that was for on are as with his they at be this from".split()


@dataclass
class Run:
    outcomes: Counter = field(default_factory=Counter)
    unexpected: list = field(default_factory=list)  # (t, status, message) of errors that are not allowed
    restart_window: list = field(default_factory=list)  # errors of requests in flight on the killed replica
    rss: dict = field(default_factory=dict)  # replica actor name -> [(t, rss_bytes)]
    mlx: dict = field(default_factory=dict)  # replica id -> [(t, active - KV pool, active, cache)]
    start: float = 0.0
    killed_at: Optional[float] = None
    killed: Optional[str] = None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--url", default=None, help="an app already serving (else one is started here)")
    p.add_argument("--ray-address", default=None, help="with --url: the cluster, for stats and the restart")
    p.add_argument("--model", default="tiny", help="engine.model of the app started here (tiny | default)")
    p.add_argument("--model-name", default=None, help="model name clients send (default: derived)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--load", type=float, default=0.8, help="fraction of admitted capacity kept in flight")
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--no-restart", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def start_app(args: argparse.Namespace) -> str:
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    serve.start(http_options={"host": "127.0.0.1", "port": 8123})
    engine = {"model": args.model, "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": 256,
              "prefill_chunk_size": 128, "max_model_len": 2048}
    app_args = {"engine": engine, "num_replicas": args.replicas, "max_tokens_cap": 512,
                # All replicas on this host (the default is one per node): admission splits its memory.
                "replica": {"num_cpus": 0.5, "health_check_period_s": 2.0, "graceful_shutdown_timeout_s": 2.0,
                            "max_replicas_per_node": args.replicas},
                "ingress": {"num_cpus": 0.1},
                "admission": {"heartbeat_interval_s": 0.5, "replica_timeout_s": 3.0, "queue_timeout_s": 10.0}}
    serve.run(build_app(app_args), name=APP, route_prefix="/")
    return "http://127.0.0.1:8123"


def request_body(rng: random.Random, model: str) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((8, 64, 400))))
    return {"model": model, "prompt": prompt, "max_tokens": rng.randint(8, 96), "temperature": rng.choice((0, 0.8)),
            "ignore_eos": True, "stream": rng.random() < 0.5}


async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> tuple[str, str]:
    """(status, error message); a mid-stream error event counts as its error type."""
    if not body["stream"]:
        r = await http.post(f"{url}/v1/completions", json=body)
        return str(r.status_code), "" if r.status_code == 200 else r.text[:200]
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return str(r.status_code), (await r.aread()).decode()[:200]
        last = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line[6:]
        if last == "[DONE]":
            return "200", ""
        return "stream-error", last[:200]


async def client(i: int, url: str, model: str, args: argparse.Namespace, run: Run, stop_at: float) -> None:
    rng = random.Random(args.seed * 1000 + i)
    async with httpx.AsyncClient(timeout=60) as http:
        while time.monotonic() < stop_at:
            body = request_body(rng, model)
            cancel_after = rng.uniform(0.05, 1.0) if rng.random() < args.cancel_fraction else None
            started = time.monotonic()
            try:
                status, message = await asyncio.wait_for(one_request(http, url, body), cancel_after)
            except asyncio.TimeoutError:
                status, message = "cancelled", ""
            except httpx.HTTPError as e:
                status, message = "transport-error", repr(e)[:200]
            run.outcomes[status] += 1
            if status not in ALLOWED:  # in flight when the replica was killed: the restart's own errors
                in_flight = run.killed_at is not None and started <= run.killed_at + 1.0 and \
                    time.monotonic() >= run.killed_at
                target = run.restart_window if in_flight and "replica" in message else run.unexpected
                target.append((round(started - run.start, 1), status, message))
            if status in ("503", "429"):
                await asyncio.sleep(1.0)  # Retry-After


def replica_actors() -> list[dict]:
    """Alive engine replica actors as {name, pid} (GCS actor table: works without the dashboard)."""
    from ray._private import state

    return [{"name": a["Name"], "pid": a["Pid"]} for a in state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"].endswith(f"{APP}:{REPLICA_DEPLOYMENT}")]


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc (Linux; the replicas run on this host)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def sample_rss(run: Run, t: float) -> None:
    for a in replica_actors():
        try:
            run.rss.setdefault(a["name"], []).append((t, rss_bytes(a["pid"])))
        except Exception:  # a replica going away between the listing and the read
            pass


def sample_mlx(run: Run, t: float) -> None:
    """Each replica's MLX memory from its stats: what is allocated beside the KV pool (which holds the
    running requests' KV, the prefix cache and free blocks, and grows up to the KV budget) is the weights
    plus whatever leaks, and must stay flat."""
    from ray import serve

    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP)
    seen = set()
    for _ in range(6):  # the router picks a replica per call
        try:
            s = handle.stats.remote().result(timeout_s=5)
        except Exception:  # a replica restarting
            continue
        if s.replica_id in seen:
            continue
        seen.add(s.replica_id)
        e = s.engine
        other = e.mlx_active_bytes - e.kv_allocated_bytes  # the KV pool: running KV, prefix cache, free
        run.mlx.setdefault(s.replica_id, []).append((t, other, e.mlx_active_bytes, e.mlx_cache_bytes))


def kill_one_replica(run: Run) -> None:
    import ray

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("SERVE_REPLICA::") and f"{APP}#{REPLICA_DEPLOYMENT}#" in a["name"]]
    if not actors:
        return
    victim = actors[0]
    run.killed, run.killed_at = victim["name"], time.monotonic()
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)


async def monitor(args: argparse.Namespace, run: Run, start: float, stop_at: float, with_ray: bool) -> None:
    restart_at = start + args.duration_s / 2
    while time.monotonic() < stop_at:
        now = time.monotonic()
        if with_ray:
            await asyncio.to_thread(sample_rss, run, now - start)
            await asyncio.to_thread(sample_mlx, run, now - start)
            if not args.no_restart and run.killed_at is None and now >= restart_at:
                await asyncio.to_thread(kill_one_replica, run)
        await asyncio.sleep(2.0)


def rss_summary(run: Run, duration_s: float) -> dict[str, Any]:
    out = {}
    for name, samples in run.rss.items():
        first = [r for t, r in samples if t <= duration_s / 4]
        last = [r for t, r in samples if t >= 3 * duration_s / 4]
        first_mb = round(statistics.median(first) / 2**20, 1) if first else None
        last_mb = round(statistics.median(last) / 2**20, 1) if last else None
        out[name.rsplit("#", 1)[-1]] = {
            "first_quarter_rss_mb": first_mb, "last_quarter_rss_mb": last_mb,
            "growth_mb": round(last_mb - first_mb, 1) if first and last else None, "num_samples": len(samples)}
    return out


def mlx_summary(run: Run, duration_s: float, tolerance_mb: float = 8.0) -> dict[str, Any]:
    """Per replica, medians over the first and last quarter of the run of MLX active memory minus the KV
    pool (weights plus anything leaked): flat when it grew by at most
    tolerance_mb. Active and cached (reusable, freed) bytes are printed beside it."""
    out = {}
    for replica_id, samples in run.mlx.items():
        def median_mb(column: int, first: bool) -> Optional[float]:
            values = [row[column] for row in samples
                      if (row[0] <= duration_s / 4 if first else row[0] >= 3 * duration_s / 4)]
            return round(statistics.median(values) / 2**20, 1) if values else None

        first, last = median_mb(1, True), median_mb(1, False)
        growth = round(last - first, 1) if first is not None and last is not None else None
        out[replica_id] = {
            "first_quarter_other_mb": first, "last_quarter_other_mb": last, "growth_mb": growth,
            "flat": None if growth is None else growth <= tolerance_mb,  # None: not alive the whole run
            "first_quarter_active_mb": median_mb(2, True), "last_quarter_active_mb": median_mb(2, False),
            "first_quarter_cache_mb": median_mb(3, True), "last_quarter_cache_mb": median_mb(3, False),
            "num_samples": len(samples)}
    return out


def final_state(num_replicas: int, timeout_s: float = 20.0) -> dict[str, Any]:
    """Each replica's running/waiting/KV/reservations and the admission controller's, once idle (or at timeout)."""
    from ray import serve

    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP)
    keys = ("num_running", "num_waiting", "kv_used_bytes", "kv_reserved_bytes", "prefix_cache_bytes")
    deadline, replicas, admission = time.monotonic() + timeout_s, {}, None
    while time.monotonic() < deadline:
        for _ in range(30):  # the router picks a replica per call: sample until every replica answered
            s = handle.stats.remote().result(timeout_s=10)
            replicas[s.replica_id] = {k: getattr(s.engine, k) for k in keys}
            if len(replicas) >= num_replicas:
                break
        # Idle once every replica answered zeros and every heartbeat the controller holds (a replica's
        # last one may predate its last request's end by one heartbeat interval) says so too.
        admission = admission_state()
        beats = (admission or {}).get("replicas", {}).values()
        if (not any(v for r in replicas.values() for k, v in r.items() if k != "prefix_cache_bytes")
                and not any(v for r in beats for v in r.values())):
            break
        time.sleep(0.5)
    return {"replicas": replicas, "admission": admission}


def admission_state() -> Optional[dict]:
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(f"mlx-admission.{APP}."):
            s = ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).stats.remote(), timeout=10)
            # Every registered replica as its last heartbeat reported it (Serve's router may keep picking
            # one replica for the stats calls above).
            replicas = {r.replica_id: {"engine_kv_used_bytes": r.engine_kv_used_bytes,
                                       "engine_kv_reserved_bytes": r.engine_kv_reserved_bytes,
                                       "live_requests": len(r.request_ids)} for r in s.replicas}
            return {"num_reservations": s.num_reservations, "num_waiting": s.num_waiting,
                    "reserved_kv_bytes": s.reserved_kv_bytes, "replicas": replicas}
    return None


async def soak(args: argparse.Namespace, url: str, model: str, with_ray: bool) -> dict[str, Any]:
    run = Run(start=time.monotonic())
    start = run.start
    stop_at = start + args.duration_s
    concurrency = max(1, round(args.load * args.max_num_seqs * args.replicas))
    tasks = [client(i, url, model, args, run, stop_at) for i in range(concurrency)]
    await asyncio.gather(monitor(args, run, start, stop_at, with_ray), *tasks)
    summary: dict[str, Any] = {
        "duration_s": round(time.monotonic() - start, 1), "concurrency": concurrency,
        "outcomes": dict(run.outcomes), "unexpected_errors": run.unexpected[:20],
        "num_unexpected_errors": len(run.unexpected), "restart_errors": run.restart_window[:10],
        "num_restart_errors": len(run.restart_window),
        "killed_replica": run.killed, "killed_at_s": round(run.killed_at - start, 1) if run.killed_at else None,
    }
    if with_ray:
        summary["replica_rss"] = rss_summary(run, args.duration_s)
        summary["replica_mlx_memory"] = mlx_summary(run, args.duration_s)
        spanning = [m for m in summary["replica_mlx_memory"].values() if m["growth_mb"] is not None]
        summary["memory_flat"] = bool(spanning) and all(m["flat"] for m in spanning)
        summary["after_run"] = await asyncio.to_thread(final_state, args.replicas)
    return summary


def main() -> None:
    args = parse_args()
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    with_ray = args.url is None or args.ray_address is not None
    if args.url is None:
        url = start_app(args)
    else:
        url = args.url.rstrip("/")
        if args.ray_address:
            import ray

            ray.init(address=args.ray_address, configure_logging=False, log_to_driver=False)
    model = args.model_name or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    summary = asyncio.run(soak(args, url, model, with_ray))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
