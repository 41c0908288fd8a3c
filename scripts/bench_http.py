"""HTTP half of scripts/bench_serving.py: streaming load against OpenAI-compatible servers, and the
servers it can start (our app through `serve run`, mlx_lm.server). Run through bench_serving.py."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, environment, log  # noqa: E402
from process_cpu import pids, read_stat  # noqa: E402
from deployments.cluster_env import CLUSTER_ENV, with_cluster_env  # noqa: E402
from bench_serving_stats import RequestRecord, arrival_times, compare, fmt, summarize  # noqa: E402


class PromptMaker:
    """Text prompts of about N tokens (counted with the model's tokenizer when it is at hand)."""

    WORDS = ("river stone cloud market lantern orbit violet copper garden signal harbor thunder "
             "meadow pixel canyon glacier falcon ember quartz willow").split()

    def __init__(self, tokenizer_file: Optional[str]):
        self.tok = None
        if tokenizer_file and Path(tokenizer_file).is_file():
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(tokenizer_file)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids) if self.tok else len(text.split())

    def make(self, index: int, num_tokens: int, seed: int) -> str:
        rng = random.Random(seed * 100003 + index)
        head = f"Request {index}:"
        words = [rng.choice(self.WORDS) for _ in range(num_tokens)]
        lo, hi = 0, len(words)  # the longest prefix that stays within num_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(" ".join([head] + words[:mid])) <= num_tokens:
                lo = mid
            else:
                hi = mid - 1
        return " ".join([head] + words[:lo])


async def http_load(url: str, model: str, prompts: list[str], arrivals: list[float], concurrency: int,
                    output_tokens: int, eos_ids: list[int], timeout_s: float, api_key: Optional[str]) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body_extra = dict(ignore_eos=True, temperature=0.0, stream=True, stream_options={"include_usage": True},
                      max_tokens=output_tokens)
    if eos_ids:  # mlx_lm.server ignores ignore_eos; a strong negative bias keeps EOS out the same way
        body_extra["logit_bias"] = {str(t): -100.0 for t in eos_ids}
    records = [RequestRecord(i, 0.0) for i in range(len(prompts))]
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s, limits=limits,
                                 headers=headers) as client:
        t0 = time.perf_counter()

        async def one(i: int):
            await asyncio.sleep(arrivals[i])
            async with sem:
                rec = records[i]
                rec.sent_s = time.perf_counter() - t0
                body = dict(model=model, prompt=prompts[i], **body_extra)
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        rec.status = resp.status_code
                        if resp.status_code != 200:
                            text = (await resp.aread()).decode(errors="replace")[:200]
                            rec.error = f"HTTP {resp.status_code}: {text}"
                            return
                        usage_tokens = None
                        async for line in resp.aiter_lines():
                            if not line.startswith("data:"):
                                continue
                            data = line[5:].strip()
                            if data == "[DONE]":
                                break
                            chunk = json.loads(data)
                            if chunk.get("error"):
                                rec.error = f"stream error: {chunk['error']}"
                                return
                            if chunk.get("usage"):
                                usage_tokens = chunk["usage"].get("completion_tokens")
                            if any(c.get("text") for c in chunk.get("choices") or []):
                                rec.token_times_s.append(time.perf_counter() - t0)
                        chunks = len(rec.token_times_s)
                        rec.num_output_tokens = usage_tokens if usage_tokens is not None else chunks
                        rec.status = None
                except Exception as exc:  # noqa: BLE001 - counted per request
                    rec.error = f"{type(exc).__name__}: {exc}"

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    result = summarize(records, wall)
    # A streamed chunk may carry more than one token (detokenizer hold-back): TPOT per token.
    per_token = [(r.token_times_s[-1] - r.token_times_s[0]) / (r.num_output_tokens - 1)
                 for r in records if r.error is None and r.num_output_tokens > 1 and r.token_times_s]
    result["tpot_mean_s"] = statistics.fmean(per_token) if per_token else result["tpot_mean_s"]
    return result


def wait_http(url: str, path: str, timeout_s: float, proc: Optional[subprocess.Popen] = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {path}")
        try:
            r = httpx.get(url.rstrip("/") + path, timeout=5)
            if r.status_code == 200:
                return
            last = r.status_code
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = exc
        time.sleep(1.0)
    raise TimeoutError(f"{url}{path} not ready after {timeout_s} s (last: {last!r})")


def served_model(url: str, fallback: str = "default_model") -> str:
    """The first model the server lists; mlx_lm.server lists only its hub cache (maybe nothing) and
    answers 'default_model' with the --model it was started with."""
    import httpx

    data = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json().get("data") or []
    return data[0]["id"] if data else fallback


class Server:
    """A server process this script started, in a process group of its own; stopping it waits for every
    process it started (`stop`)."""

    def __init__(self, cmd: list[str], log_path: str, port: int, env: Optional[dict] = None,
                 cwd: Optional[str] = None):
        wait_port_free(port, 30.0)
        self.port = port
        self.log = open(log_path, "a")  # every pass of --repeat appends its own start
        self.log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd,
                                     env=env, start_new_session=True)

    def stop(self, grace_s: float = 30.0) -> None:
        """Interrupt the group, then wait until every process the server started is gone (SIGKILL after
        `grace_s`) and its port is free. Ray's workers, the proxy that holds the HTTP port among them,
        are the raylet's children in sessions of their own: outside the group, they outlive `serve run`
        by seconds, and a server started meanwhile on the same port would be answered by the old proxy."""
        tree = descendants(self.proc.pid)  # before they are orphaned (Linux /proc; empty elsewhere)
        deadline = time.monotonic() + grace_s
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in alive(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10.0
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.log.close()
        wait_port_free(self.port, grace_s)


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of process `root`, from /proc's parent links: pid -> its start time (so a
    pid the system reuses later is not taken for it)."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for pid in pids():
        stat = read_stat(pid)
        if stat is not None:
            children.setdefault(int(stat[1][1]), []).append(pid)  # ppid: field 4
            started[pid] = stat[1][19]  # starttime: field 22
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out[child] = started[child]
                todo.append(child)
    return alive(out)


def alive(processes: dict[int, str]) -> dict[int, str]:
    """Those of `processes` (pid -> start time) that still run; zombies, whose exit is only unreported,
    do not."""
    out = {}
    for pid, start in processes.items():
        stat = read_stat(pid)
        if stat is not None and stat[1][0] != "Z" and stat[1][19] == start:
            out[pid] = start
    return out


def wait_port_free(port: int, timeout_s: float) -> None:
    """Return once nothing accepts connections on 127.0.0.1:`port`; RuntimeError after `timeout_s`."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} is still in use after {timeout_s:.0f} s: stop what listens "
                               "there (an earlier server?) or choose another port")
        time.sleep(0.2)


def start_app(args) -> Server:
    """Our app through `serve run` on a copy of --app-config whose HTTP port is --url's, in a Ray
    cluster of its own (`--address local`, its own RAY_TMPDIR), so a cluster that tests or other
    people run on this host is never joined nor its application replaced."""
    import urllib.parse

    import yaml

    config = yaml.safe_load((ROOT / args.app_config).read_text())
    port = urllib.parse.urlparse(args.url).port or 8000
    config.setdefault("http_options", {})["port"] = port
    os.makedirs(args.log_dir, exist_ok=True)
    cfg_path = Path(args.log_dir) / "serve_bench.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = dict(with_cluster_env(), PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               RAY_TMPDIR=str(Path(args.log_dir) / "ray"))  # the cluster's environment as scripts/serve's
    os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    serve = str(Path(sys.executable).with_name("serve"))
    server = Server([serve, "run", "--address", "local", str(cfg_path)], args.log_dir + "/app.log", port,
                    env=env, cwd=str(ROOT))
    wait_http(args.url, "/v1/models", args.start_timeout_s, server.proc)
    return server


def start_mlx_lm(args, folder: str) -> Server:
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", folder, "--port", str(args.mlx_lm_port),
           "--host", "127.0.0.1"]
    server = Server(cmd, args.log_dir + "/mlx_lm_server.log", args.mlx_lm_port)
    wait_http(f"http://127.0.0.1:{args.mlx_lm_port}", "/v1/models", args.start_timeout_s, server.proc)
    return server


def http_mode(args) -> dict:
    from engine.model.loader import resolve_model_path

    folder = str(resolve_model_path(args.model)) if args.model else None
    tok_file = str(Path(folder) / "tokenizer.json") if folder else None
    eos_ids = eos_token_ids(folder)
    maker = PromptMaker(tok_file)
    result = dict(bench="serving_http", argv=sys.argv[1:], model_folder=folder, targets={},
                  prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, rate=args.rate,
                  environment=environment())
    if args.start_app:
        cluster_env = with_cluster_env()
        result["cluster_env"] = {k: cluster_env[k] for k in CLUSTER_ENV}  # what our app's Ray got
    os.makedirs(args.log_dir, exist_ok=True)
    targets = []
    if args.start_app:
        targets.append(("mlx_serve", lambda: start_app(args), args.url))
    elif args.url:
        targets.append(("mlx_serve", None, args.url))
    if args.compare_mlx_lm:
        if not folder:
            raise SystemExit("--compare-mlx-lm needs --model (the folder mlx_lm.server loads)")
        targets.append(("mlx_lm_server", lambda: start_mlx_lm(args, folder),
                        f"http://127.0.0.1:{args.mlx_lm_port}"))
    for rep in range(args.repeat):
        # each pass starts every server afresh; the order alternates (ABBA...), so drift of the host
        # and whatever the first server leaves behind fall on both
        for name, start, url in (targets if rep % 2 == 0 else targets[::-1]):
            run_target(args, result, maker, eos_ids, name, start, url, rep, log)
    if "mlx_serve" in result["targets"] and "mlx_lm_server" in result["targets"]:
        runs = {}
        for prefix, name in (("o", "mlx_serve"), ("t", "mlx_lm_server")):
            runs.update({f"{prefix}@{c}": v for c, v in result["targets"][name]["runs"].items()})
        result["comparison"] = compare(runs, [str(c) for c in args.concurrency], "o", "t")
    return result


def run_target(args, result: dict, maker, eos_ids: list[int], name: str, start, url: str, rep: int, log) -> None:
    """One pass of one server: start it (if we own it), warm it with two short requests, run every
    concurrency on prompts of this pass alone (the prefix cache helps no pass), stop it. Pass k's runs
    are keyed "<concurrency>#k" (k > 0), as compare() reads them."""
    server = start() if start else None
    try:
        model = served_model(url) if name == "mlx_serve" else "default_model"
        target = result["targets"].setdefault(name, {"url": url, "served_model": model, "runs": {}})
        warm = [maker.make(10_000 + i + 100_000 * rep, min(32, args.prompt_tokens), args.seed) for i in range(2)]
        asyncio.run(http_load(url, model, warm, [0.0] * 2, 2, 4, eos_ids, args.request_timeout_s,
                              args.api_key))
        for conc in args.concurrency:
            n = args.num_requests or conc
            prompts = [maker.make(i + 1000 * conc + 100_000 * rep, args.prompt_tokens, args.seed)
                       for i in range(n)]
            r = asyncio.run(http_load(url, model, prompts, arrival_times(n, args.rate, args.seed), conc,
                                      args.output_tokens, eos_ids, args.request_timeout_s, args.api_key))
            r["concurrency"], r["repeat"] = conc, rep
            target["runs"][str(conc) + (f"#{rep}" if rep else "")] = r
            log(f"{name} x{conc}{f' (pass {rep + 1})' if args.repeat > 1 else ''}: TTFT mean "
                f"{fmt(r['ttft_mean_s'])} s p95 {fmt(r['ttft_p95_s'])} s, TPOT {fmt(r['tpot_mean_s'])} s, "
                f"{fmt(r['output_tok_per_s'], 1)} tok/s, errors {r['errors']}")
    finally:
        if server is not None:
            server.stop()


def eos_token_ids(folder: Optional[str]) -> list[int]:
    if not folder:
        return []
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = Path(folder) / name
        if p.is_file():
            v = json.loads(p.read_text()).get("eos_token_id")
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    return sorted(ids)


