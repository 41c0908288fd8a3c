"""scripts/process_cpu.py: per-process CPU time over an interval, read from /proc (Linux)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "process_cpu.py"

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def cpu_ticks(pid: int) -> int:
    """utime + stime of `pid` in clock ticks (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_busy_process_shows_up_with_its_share_and_niceness(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(3)\nwhile True: pass"])
    try:
        out = tmp_path / "cpu.json"
        before = cpu_ticks(busy.pid)
        result = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "1", "--out", str(out)],
                                capture_output=True, text=True, check=True)
        used_s = (cpu_ticks(busy.pid) - before) / os.sysconf("SC_CLK_TCK")
        data = json.loads(result.stdout)
        assert data == json.loads(out.read_text())
        rows = {r["pid"]: r for r in data["processes"]}
        assert busy.pid in rows, data
        assert rows[busy.pid]["nice"] == 3
        # its share of the script's (>= 1 s) interval cannot exceed the CPU time it used around it; how
        # large the share is depends on the host's load, so it is not asserted
        assert 0 < rows[busy.pid]["cpu_percent"] / 100 <= used_s + 0.02
        shares = [r["cpu_percent"] for r in data["processes"]]
        assert shares == sorted(shares, reverse=True)
        assert data["total_cpu_percent"] >= rows[busy.pid]["cpu_percent"]
    finally:
        busy.kill()
        busy.wait()


def test_bad_interval_is_refused():
    result = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "0"], capture_output=True, text=True)
    assert result.returncode == 2 and "--seconds=0.0 must be > 0" in result.stderr
