"""The drain of deployments/ingress/drain.py without Ray: DrainSignal's bookkeeping, and an ingress over a fake
engine that refuses new requests with 503 + Retry-After and ends a stream still running at the deadline with
an error event. (tests/serve/test_shutdown.py runs the whole path: scripts/serve and SIGTERM.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
from contextlib import aclosing

import pytest

from deployments.errors import ServiceUnavailableError
from deployments.ingress.drain import DrainSignal, IngressDrain
from deployments.ingress.schemas import ChatCompletionRequest
from engine.config import EngineConfig
from deployments.ingress.ingress import IngressSettings, OpenAIIngress
from deployments.replica.replica import EngineReplica
from serve_fakes import FakeEngine, LocalReplicaClient
from test_serve_local import MODEL, tokenizer  # noqa: F401 (fixture)


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class _Ref:
    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def future(self) -> concurrent.futures.Future:
        return self._future


class LocalSignal:
    """A DrainSignal called in-process, as an actor handle would call it; `go(timeout_s)` starts the drain."""

    def __init__(self) -> None:
        self.actor = DrainSignal()
        self._started: concurrent.futures.Future = concurrent.futures.Future()
        self.register = _Method(self.actor.register)
        self.report = _Method(self.actor.report)
        self.wait = _Method(lambda: _Ref(self._started))

    def go(self, timeout_s: float) -> None:
        self.actor.start(timeout_s)
        self._started.set_result(timeout_s)


def test_signal_counts_the_latest_report_of_every_ingress():
    signal = DrainSignal()
    signal.register("a")
    signal.register("b")
    signal.start(5.0)
    assert signal.pending() == {"a": -1, "b": -1}  # no report since the start
    signal.report("a", 2, 1)
    signal.report("a", 1, 3)  # an older report arriving late changes nothing
    signal.report("b", 1, 0)
    assert signal.pending() == {"a": 1}
    signal.report("a", 3, 0)
    assert signal.pending() == {}


def test_ingress_drain_refuses_new_requests_and_reports_its_count():
    local = LocalSignal()
    drain = IngressDrain(local, "i0", retry_after_s=2.0)
    assert not drain.draining
    with drain.admit():
        local.go(30.0)
        assert drain.draining
        assert local.actor.pending() == {"i0": 1}
        with pytest.raises(ServiceUnavailableError) as refused:
            drain.check_open()
        assert refused.value.retry_after_s == 2.0 and "shutting down" in str(refused.value)
        drain.check_deadline()  # 30 s left: running requests go on
    assert local.actor.pending() == {}


async def test_stream_running_at_the_deadline_ends_with_an_error(tokenizer):  # noqa: F811
    local = LocalSignal()
    engine = FakeEngine(EngineConfig(model=MODEL, max_model_len=512), step_s=0.01)
    replica = EngineReplica(engine.config, engine_factory=lambda cfg: engine, replica_id="r0")
    ingress = OpenAIIngress(replica, IngressSettings(engine=engine.config), tokenizer_factory=lambda cfg: tokenizer,
                            client_factory=LocalReplicaClient,
                            drain_factory=lambda: IngressDrain(local, "i0"))
    request = ChatCompletionRequest(model=MODEL, max_tokens=400, messages=[{"role": "user", "content": "hi"}])
    chunks = []
    with pytest.raises(ServiceUnavailableError, match="shut down before this request finished"):
        async with aclosing(ingress.chat_stream(request)) as stream:
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 3:
                    local.go(0.0)  # the deadline is now
    assert 3 <= len(chunks) < 400
    await asyncio.sleep(0.05)
    assert engine.running == set()  # the engine request was aborted
    assert local.actor.pending() == {}
    with pytest.raises(ServiceUnavailableError, match="shutting down"):
        await ingress.chat(request)
    with pytest.raises(ServiceUnavailableError):
        await ingress.health()


def test_supervisor_stop_first_signal_drains_second_skips_the_drain():
    import signal as signals

    from deployments.supervisor import Stop, parse

    stop = Stop()
    stop.handle(signals.SIGTERM, None)
    assert stop.requested.is_set() and not stop.forced.is_set() and stop.signal_name == "SIGTERM"
    stop.handle(signals.SIGINT, None)
    assert stop.forced.is_set() and stop.signal_name == "SIGTERM"
    args = parse(["config/serve.yaml", "--drain-timeout-s", "7"])
    assert args.drain_timeout_s == 7.0 and args.config == "config/serve.yaml"
    with pytest.raises(SystemExit):
        parse(["--drain-timeout-s", "-1"])
