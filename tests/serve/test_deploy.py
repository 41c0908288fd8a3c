"""The README's "Deploying" commands on a fresh machine: `ray start --head`, `serve deploy config/serve.yaml`,
a chat over HTTP with the openai client, the cluster stopped.

Each command runs in bash after `eval "$(scripts/env)"` from the repository root, as the README says, with
HOME a new empty folder, so no Ray token exists yet (the eval makes one), and no venv on PATH. What differs from the README, so
the test can share a host with other clusters: free ports and a temp dir of its own on `ray start`, the
dashboard's address on `serve deploy`, and a copy of config/serve.yaml with the tiny model, a free HTTP
port and no Prometheus ports. The cluster is stopped by ending `ray start --block` and waiting for every
process it started: `ray stop` would stop every Ray process on the host, other clusters' too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT, free_port

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from bench_http import Server  # noqa: E402  (stops a process and everything it started)

EVAL = 'eval "$(scripts/env)" && '
MODEL = "tiny"


def fresh_env(home: Path) -> dict[str, str]:
    """A login shell's environment on a machine where Ray never ran: none of the project's variables, no
    venv on PATH. The model cache stays the machine's (MLX_SERVE_CACHE), so nothing is converted again."""
    from deployments.cluster_env import CLUSTER_ENV

    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items()
           if k not in CLUSTER_ENV and k not in ("VIRTUAL_ENV", "PYTHONPATH", "LD_PRELOAD")
           and not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env["MLX_SERVE_CACHE"] = os.environ.get("MLX_SERVE_CACHE", str(Path.home() / ".cache" / "mlx-serve"))
    env["HOME"] = str(home)
    return env


def tiny_config(path: Path, http_port: int, max_model_len: int = 512) -> Path:
    """config/serve.yaml with the tiny model (context max_model_len, max_tokens up to it) on http_port."""
    config = yaml.safe_load((REPO_ROOT / "config" / "serve.yaml").read_text())
    config["http_options"]["port"] = http_port
    args = config["applications"][0]["args"]
    args["engine"].update(model=MODEL, max_model_len=max_model_len)
    args["served_model_name"] = MODEL
    args["max_tokens_cap"] = None
    args["telemetry"]["prometheus_port"] = 0  # free ports: never another cluster's
    path.write_text(yaml.safe_dump(config))
    return path


def wait_url(url: str, timeout_s: float, head: Server, ok=(200,)) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert head.proc.poll() is None, f"ray start exited with {head.proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status in ok:
                    return
        except urllib.error.HTTPError as e:
            if e.code in ok:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready after {timeout_s:.0f} s"
        time.sleep(1.0)


@pytest.mark.timeout(600)
def test_readme_deploy_commands_serve_a_chat(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = fresh_env(home)
    gcs, dash, http = free_port(), free_port(), free_port()
    ports = [f"--{name}={free_port()}" for name in (
        "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        "metrics-export-port", "runtime-env-agent-port", "node-manager-port", "object-manager-port")]
    temp_dir = Path("/tmp") / f"rd{os.getpid()}"  # short: Ray's socket paths have a length limit
    start = (f"exec ray start --head --dashboard-host 127.0.0.1 --node-ip-address 127.0.0.1 --port={gcs} "
             f"--dashboard-port={dash} {' '.join(ports)} --temp-dir={temp_dir} --block")
    head = Server(["bash", "-c", EVAL + start], str(tmp_path / "ray_start.log"), dash, env=env,
                  cwd=str(REPO_ROOT))
    try:
        wait_url(f"http://127.0.0.1:{dash}/api/version", 120, head, ok=(200, 401, 403))
        # the dashboard answers before its Serve module does (a deploy then gets a 500 on a loaded host)
        wait_url(f"http://127.0.0.1:{dash}/api/serve/applications/", 120, head, ok=(200, 401, 403))
        config = tiny_config(tmp_path / "serve.yaml", http)
        address = f"http://127.0.0.1:{dash}"

        def shell(cmd: str) -> subprocess.CompletedProcess:
            return subprocess.run(["bash", "-c", EVAL + cmd], env=env, cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=120)

        deployed = shell(f"serve deploy {config} -a {address}")
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert (home / ".ray" / "auth_token").is_file()  # the eval made the token ray start needed
        wait_url(f"http://127.0.0.1:{http}/health", 300, head)
        status = shell(f"serve status -a {address}")
        assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout + status.stderr

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1

        # The token is what lets a client in: without the eval's RAY_AUTH_MODE, serve status is refused.
        bare = shell(f"env -u RAY_AUTH_MODE serve status -a {address}")
        assert bare.returncode != 0 and "Authentication required" in bare.stdout + bare.stderr, bare.stdout
    finally:
        head.stop(grace_s=60)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert head.proc.returncode is not None
