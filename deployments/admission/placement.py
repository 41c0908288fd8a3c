"""Which device an engine replica runs on, and its share of that device's memory; pure (no ray).

A replica's engine claims `memory_utilization` of what MLX reports for its device: the host's memory on
CPU and Metal hosts, its GPU's on CUDA hosts. Serve places one engine replica per node by default
(`max_replicas_per_node: 1`, deployments/app.py), or one per GPU (`num_gpus: 1`), so each device holds
one. If an override puts several on one device, each still claims the whole; the admission ledger
groups replicas by `DeviceKey` and models each with its share (the limit divided by the replicas on
that device) instead of promising each the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

HOST_DEVICE = "host"  # the host's memory: the CPU backend, or Metal's unified memory


@dataclass(frozen=True)
class DeviceKey:
    """One memory pool: a node's host memory, or one GPU of a node."""

    node_id: str
    device: str


def device_label(gpu_ids: Sequence[str]) -> str:
    """`host` without GPUs, else `gpu:<ids>` (Ray's ids on that node, e.g. `gpu:0`)."""
    return "gpu:" + ",".join(sorted(str(i) for i in gpu_ids)) if gpu_ids else HOST_DEVICE


def device_key(replica_id: str, node_id: str, device: str) -> DeviceKey:
    """A replica that did not say where it runs (node_id "") is alone on its device."""
    return DeviceKey(node_id or f"replica:{replica_id}", device)


def memory_share_bytes(memory_limit_bytes: int, num_on_device: int) -> int:
    """What one of `num_on_device` replicas on one device may use: an equal share of the limit."""
    return memory_limit_bytes // max(1, num_on_device)
