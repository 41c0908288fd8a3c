"""scripts/process_cpu.py: per-process CPU time over an interval, read from /proc (Linux)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "process_cpu.py"

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def test_a_busy_process_shows_up_with_its_share_and_niceness(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(3)\nwhile True: pass"])
    try:
        out = tmp_path / "cpu.json"
        result = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "1", "--out", str(out)],
                                capture_output=True, text=True, check=True)
        data = json.loads(result.stdout)
        assert data == json.loads(out.read_text())
        rows = {r["pid"]: r for r in data["processes"]}
        assert busy.pid in rows, data
        assert rows[busy.pid]["cpu_percent"] > 30 and rows[busy.pid]["nice"] == 3
        shares = [r["cpu_percent"] for r in data["processes"]]
        assert shares == sorted(shares, reverse=True)
        assert data["total_cpu_percent"] >= rows[busy.pid]["cpu_percent"]
    finally:
        busy.kill()
        busy.wait()


def test_bad_interval_is_refused():
    result = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "0"], capture_output=True, text=True)
    assert result.returncode == 2 and "--seconds=0.0 must be > 0" in result.stderr
