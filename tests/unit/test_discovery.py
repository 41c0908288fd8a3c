"""deployments/telemetry/discovery.py's pure parts: Prometheus file_sd entries, the atomic write, and the host
a wildcard-bound endpoint advertises."""

import json

from deployments.telemetry.discovery import MetricsEndpoint, file_sd_targets, write_file_sd
from deployments.telemetry.exporters import advertised_host


def test_file_sd_entries_name_host_port_and_labels(tmp_path):
    endpoints = [MetricsEndpoint("mlx-llm", "replica", "http://10.0.0.2:9466/metrics", "abc"),
                 MetricsEndpoint("mlx-llm", "ingress", "http://10.0.0.1:9464/metrics"),
                 MetricsEndpoint("mlx-llm", "admission", "http://[fd00::1]:9465/metrics")]
    entries = file_sd_targets(endpoints)
    assert entries == [
        {"targets": ["[fd00::1]:9465"], "labels": {"app": "mlx-llm", "role": "admission"}},
        {"targets": ["10.0.0.1:9464"], "labels": {"app": "mlx-llm", "role": "ingress"}},
        {"targets": ["10.0.0.2:9466"], "labels": {"app": "mlx-llm", "role": "replica", "replica": "abc"}},
    ]
    path = tmp_path / "sd" / "targets.json"
    write_file_sd(str(path), endpoints)
    assert json.loads(path.read_text()) == entries
    write_file_sd(str(path), [])
    assert json.loads(path.read_text()) == []
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"]  # no temporary file left


def test_wildcard_bind_advertises_a_reachable_host():
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("::1") == "[::1]"
    for wildcard in ("0.0.0.0", "::"):
        assert advertised_host(wildcard) not in ("0.0.0.0", "[::]", "::", "")
