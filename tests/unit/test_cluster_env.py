"""deployments/cluster_env.py: the Ray cluster's environment, values already set winning."""

import os
import subprocess
import sys
from pathlib import Path

from deployments.cluster_env import CLUSTER_ENV, missing, with_cluster_env

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_fill_only_what_is_unset():
    assert missing({}) == CLUSTER_ENV
    assert CLUSTER_ENV["RAY_worker_niceness"] == "0"
    env = with_cluster_env({"RAY_worker_niceness": "7", "PATH": "/bin"})
    assert env["RAY_worker_niceness"] == "7"  # the user's value wins
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == CLUSTER_ENV["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]
    assert env["PATH"] == "/bin"


def test_module_prints_shell_exports_of_what_is_unset(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_ENV and not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # a fresh machine: no token yet
    env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = "2"
    out = subprocess.run([sys.executable, "-m", "deployments.cluster_env"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["export RAY_worker_niceness=0", "export RAY_task_events_report_interval_ms=10000",
                                "export RAY_AUTH_MODE=token"]
    shell = subprocess.run(["bash", "-c", f'eval "{out}"; echo "$RAY_worker_niceness $RAY_SERVE_CONTROL_LOOP_INTERVAL_S"'],
                           env=env, capture_output=True, text=True, check=True).stdout
    assert shell.split() == ["0", "2"]
    assert (tmp_path / ".ray" / "auth_token").is_file()  # `ray start --head` in token mode needs one


def test_auth_token_written_once_when_token_mode_finds_none(tmp_path):
    from deployments.cluster_env import default_token_path, ensure_auth_token

    path = ensure_auth_token({}, home=tmp_path)
    assert path == default_token_path(tmp_path) and len(path.read_text()) == 64
    assert path.stat().st_mode & 0o777 == 0o600
    token = path.read_text()
    assert ensure_auth_token({}, home=tmp_path) is None and path.read_text() == token  # kept, never replaced
    other = tmp_path / "other"
    assert ensure_auth_token({"RAY_AUTH_TOKEN": "x"}, home=other) is None  # Ray finds one: nothing written
    assert ensure_auth_token({"RAY_AUTH_MODE": "disabled"}, home=other) is None
    assert not other.exists()
