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


def test_module_prints_shell_exports_of_what_is_unset():
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_ENV}
    env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = "2"
    out = subprocess.run([sys.executable, "-m", "deployments.cluster_env"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["export RAY_worker_niceness=0", "export RAY_task_events_report_interval_ms=10000"]
    shell = subprocess.run(["bash", "-c", f'eval "{out}"; echo "$RAY_worker_niceness $RAY_SERVE_CONTROL_LOOP_INTERVAL_S"'],
                           env=env, capture_output=True, text=True, check=True).stdout
    assert shell.split() == ["0", "2"]
