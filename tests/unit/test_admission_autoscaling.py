"""Autoscaling on admission demand, the wake from zero, and the admission span, without a Ray cluster:
Serve's own AutoscalingConfig / AutoscalingContext / AutoscalingPolicy around the policy, the real
AdmissionController class in-process, in-memory telemetry."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.admission.actor import AdmissionClient, AdmissionController, AdmittedReplicaClient
from deployments.admission.autoscaling import (QUEUED_METRIC, RUNNING_METRIC, admission_demand_policy,
                                               desired_replicas)
from deployments.admission.state import AdmissionConfig
from deployments.app import AUTOSCALING_POLICY, AppArgs
from deployments.errors import ServiceUnavailableError
from deployments.messages import GenerateRequest, ReplicaCapacity, ReplicaReport
from deployments.telemetry.metrics import Telemetry
from engine.core.types import SamplingParams

CONFIG = AdmissionConfig(heartbeat_interval_s=0.1, replica_timeout_s=1.0, queue_timeout_s=0.3, max_queue_len=2,
                         idle_shutdown_s=0)


def context(metrics: dict, current: int, total: float = 0.0, min_replicas: int = 0, max_replicas: int = 4):
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas, target_ongoing_requests=2,
                               policy={"policy_function": AUTOSCALING_POLICY})
    return AutoscalingContext(
        deployment_id=DeploymentID(name="EngineReplica", app_name="app"), deployment_name="EngineReplica",
        app_name="app", current_num_replicas=current, target_num_replicas=current, running_replicas=[],
        total_num_requests=total, total_queued_requests=0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=time.time(),
        config=config)


def test_desired_replicas():
    assert desired_replicas(0, 0, current=2, target_per_replica=2, min_replicas=0, max_replicas=4) == 0  # idle
    assert desired_replicas(0, 0, current=2, target_per_replica=2, min_replicas=1, max_replicas=4) == 1
    assert desired_replicas(3, 0, current=1, target_per_replica=2, min_replicas=0, max_replicas=4) == 2
    assert desired_replicas(1, 1, current=2, target_per_replica=8, min_replicas=0, max_replicas=4) == 3  # queued
    assert desired_replicas(40, 9, current=2, target_per_replica=2, min_replicas=0, max_replicas=4) == 4
    # two replicas each generating, demand for one: both stay (Serve would stop the newest, busy or not)
    assert desired_replicas(2, 0, current=2, target_per_replica=4, min_replicas=0, max_replicas=4, busy=2) == 2
    assert desired_replicas(1, 0, current=2, target_per_replica=4, min_replicas=0, max_replicas=4, busy=1) == 1
    assert desired_replicas(2, 0, current=3, target_per_replica=4, min_replicas=0, max_replicas=4, busy=2) == 2


def test_policy_reads_the_replicas_metrics_through_serves_own_config():
    from ray.serve.config import AutoscalingPolicy

    policy = AutoscalingPolicy(policy_function=AUTOSCALING_POLICY).get_policy()  # pickled by value, as Serve does
    metrics = {RUNNING_METRIC: {"r1": 2.0, "r2": 1.0}, QUEUED_METRIC: {"r1": 4.0, "r2": 4.0}}
    desired, state = policy(context(metrics, current=2))
    assert desired == 4 and state == {"running": 3.0, "queued": 4.0}  # ceil((3 + 4) / 2); the queue counted once
    assert admission_demand_policy(context({}, current=1))[0] == 0  # idle: down (Serve delays it)
    busy = {RUNNING_METRIC: {"r1": 1.0, "r2": 0.6}, QUEUED_METRIC: {"r1": 0.0, "r2": 0.0}}
    assert policy(context(busy, current=2))[0] == 2  # both held requests in the window: no downscale
    assert policy(context({RUNNING_METRIC: {"r1": 1.0, "r2": 0.0}}, current=2))[0] == 1
    assert admission_demand_policy(context({}, current=1, total=5))[0] == 3  # no report yet: the handles' count


def test_app_args_give_serve_the_policy_and_the_push_interval():
    args = AppArgs(num_replicas=None,
                   autoscaling={"min_replicas": 0, "max_replicas": 2, "metrics_push_interval_s": 0.5})
    options = args.replica_deployment_options()
    config = options["autoscaling_config"]
    assert config["policy"] == {"policy_function": AUTOSCALING_POLICY} and config["min_replicas"] == 0
    assert "metrics_push_interval_s" not in config
    assert options["ray_actor_options"]["runtime_env"]["env_vars"][
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] == "0.5"
    off = AppArgs(num_replicas=None, autoscaling={"max_replicas": 2}, admission={"enabled": False})
    assert "policy" not in off.replica_deployment_options()["autoscaling_config"]  # Serve's default policy


class FakeController:
    """The controller's methods as Ray would call them (`.remote` returns an awaitable)."""

    def __init__(self, actor: AdmissionController) -> None:
        self.actor = actor
        for name in ("reserve", "release", "report", "replica_failed", "stats"):
            setattr(self, name, _Remote(getattr(actor, name)))


class _Remote:
    def __init__(self, method) -> None:
        self._method = method

    def remote(self, *args):
        return asyncio.ensure_future(self._method(*args))


def capacity(replica_id: str) -> ReplicaCapacity:
    return ReplicaCapacity(replica_id, 1 << 30, 0, 8, 256, 0, 1 << 29, 4096)


class _Inner:
    """The handle client: `info` stands for a call queued at Serve's handle until a replica runs."""

    def __init__(self, on_info) -> None:
        self.calls: list[str] = []
        self._on_info = on_info

    async def info(self, timeout_s: float):
        self.calls.append("info")
        return await self._on_info(timeout_s)

    async def generate(self, request):
        yield request.target_replica_id


async def test_a_request_at_zero_replicas_wakes_one_then_waits_for_it():
    actor = AdmissionController(CONFIG.model_copy(update={"queue_timeout_s": 5.0}))
    controller = FakeController(actor)

    async def replica_starts(timeout_s: float):  # Serve starts a replica; it registers with admission
        await asyncio.sleep(0.05)
        await actor.report(ReplicaReport(capacity("fresh")))

    inner = _Inner(replica_starts)
    client = AdmittedReplicaClient(inner, AdmissionClient(actor.config, controller_factory=lambda: controller,
                                                          client_id="ingress-0"))
    request = GenerateRequest("q1", [1, 2, 3], SamplingParams(max_tokens=4))
    assert [out async for out in client.generate(request)] == ["fresh"]
    assert inner.calls == ["info"]
    counters = (await actor.stats()).counters
    assert counters.num_no_replicas == 1 and counters.num_admitted == 1
    assert [out async for out in client.generate(GenerateRequest("q2", [1], SamplingParams(max_tokens=4)))] \
        == ["fresh"] and inner.calls == ["info"]  # a replica is registered: no wake


async def test_no_replica_starting_in_time_is_a_503_with_retry_after():
    actor = AdmissionController(CONFIG.model_copy(update={"queue_timeout_s": 0.1, "retry_after_s": 4.0}))

    async def nothing_starts(timeout_s: float):
        raise ServiceUnavailableError("no engine replica answered", retry_after_s=timeout_s)

    client = AdmittedReplicaClient(_Inner(nothing_starts), AdmissionClient(
        actor.config, controller_factory=lambda: FakeController(actor), client_id=""))
    with pytest.raises(ServiceUnavailableError) as err:
        [out async for out in client.generate(GenerateRequest("q", [1], SamplingParams(max_tokens=4)))]
    assert err.value.code == "no_replicas" and err.value.headers() == {"Retry-After": "4"}


async def test_admission_is_a_span_under_the_request_span():
    from opentelemetry import trace

    telemetry = Telemetry.for_testing()
    actor = AdmissionController(CONFIG, telemetry_factory=lambda: telemetry)
    await actor.report(ReplicaReport(ReplicaCapacity("r0", 1 << 30, 0, 8, 256, 0, 256 * 8, 4096)))  # one step
    parent = telemetry.tracer.start_span("chat tiny")
    carrier = telemetry.inject(trace.set_span_in_context(parent))
    assert (await actor.reserve("a", 10, 10, (), "ingress-0", True, carrier)).outcome == "admitted"
    waiting = asyncio.create_task(actor.reserve("b", 10, 10, (), "ingress-1", True, carrier))
    await asyncio.sleep(0.05)
    await actor.release("a")
    assert (await waiting).reason == "after_wait"
    await actor.reserve("c", 10, 10, (), "ingress-0", True, carrier)  # "b" holds the step: waits, times out
    parent.end()
    spans = [s for s in telemetry.span_exporters[0].get_finished_spans() if s.name == "mlx_serve.admission"]
    assert len(spans) == 3 and all(s.parent.span_id == parent.context.span_id for s in spans)
    first, after_wait, timed_out = (dict(s.attributes) for s in spans)
    assert first["mlx_serve.admission.outcome"] == "admitted" and first["replica"] == "r0"
    assert after_wait["mlx_serve.admission.reason"] == "after_wait" and after_wait["mlx_serve.admission.wait_s"] > 0
    assert timed_out["mlx_serve.admission.outcome"] == "rejected"
    assert timed_out["mlx_serve.admission.reason"] == "queue_timeout" and "replica" not in timed_out
    assert timed_out["mlx_serve.admission.wait_s"] >= CONFIG.queue_timeout_s
    assert spans[2].status.status_code.name == "ERROR" and "queue_timeout" in spans[2].status.description
