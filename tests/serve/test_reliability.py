"""Reliability end to end: bad input, overload and cancellation, injected engine faults, a hung engine.

Real Ray Serve, the tiny model, one engine replica whose engine comes from `tests.serve.faults`: the
forward raises on a magic prompt token (prefill) or after a few decode steps (mid-stream), and hangs on
another (the health check then fails and Serve replaces the replica). After each failure the test checks
that the app keeps serving and that the replica holds no request, KV or reservation. The hang test is
last: it replaces the replica. About a minute and a half on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from deployments.app import REPLICA_DEPLOYMENT, build_app_with
from deployments.messages import ReplicaStats
from tests.serve.faults import FAIL_DECODE_TOKEN_ID, FAIL_TOKEN_ID, HANG_TOKEN_ID, FaultyEngineFactory
from conftest import named_actor  # noqa: E402

APP = "reliability"
MODEL = "tiny"
MAX_MODEL_LEN = 2048
BODY_LIMIT = 64 << 10
ENGINE = {"model": MODEL, "max_num_seqs": 4, "max_num_batched_tokens": 256, "prefill_chunk_size": 128,
          "max_model_len": MAX_MODEL_LEN, "memory_limit_bytes": 2 << 30}
APP_ARGS = {
    "engine": ENGINE,
    "num_replicas": 1,
    "replica": {"num_cpus": 0.5, "health_check_period_s": 0.5, "health_check_timeout_s": 2.0,
                "graceful_shutdown_timeout_s": 1.0},
    "ingress": {"num_cpus": 0.1},
    "max_n": 2,
    "max_tokens_cap": 1000,
    "max_request_body_bytes": BODY_LIMIT,
    "admission": {"heartbeat_interval_s": 0.5, "replica_timeout_s": 3.0},  # a dead replica is dropped fast
}
MESSAGES = [{"role": "user", "content": "Say hello."}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
LEAKS = ("/work", "/root", "/home", "site-packages", ".py", "0x", "Traceback")


@pytest.fixture(scope="module")
def base_url(ray_cluster):
    from ray import serve

    serve.run(build_app_with(APP_ARGS, engine_factory=FaultyEngineFactory()), name=APP, route_prefix="/")
    yield ray_cluster
    serve.delete(APP)


def replica_stats() -> ReplicaStats:
    from ray import serve

    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP)
    return handle.stats.remote().result(timeout_s=30)


def admission_reservations() -> int:
    """Reservations the app's admission controller holds."""
    import ray

    from deployments.admission.actor import NAMESPACE

    [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if a["namespace"] == NAMESPACE and a["name"].startswith(f"mlx-admission.{APP}.")]
    return ray.get(named_actor(actor["name"], NAMESPACE).stats.remote(), timeout=30).num_reservations


def wait_idle(timeout_s: float = 5.0) -> float:
    """Seconds until the replica runs nothing and holds no KV, and admission holds no reservation; fails
    after timeout_s."""
    start = time.monotonic()
    while True:
        s = replica_stats().engine
        busy = {"num_running": s.num_running, "num_waiting": s.num_waiting, "kv_used_bytes": s.kv_used_bytes,
                "kv_reserved_bytes": s.kv_reserved_bytes}
        busy["admission_reservations"] = admission_reservations()
        if not any(busy.values()):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"replica still busy after {timeout_s} s: {busy}")
        time.sleep(0.1)


def assert_clean_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert not [leak for leak in LEAKS if leak in error["message"]], error["message"]
    return error


def assert_serving(base_url: str) -> None:
    ok = httpx.post(f"{base_url}{CHAT}", timeout=30, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": MESSAGES, **fields}).encode()


SURROGATE_CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
NAN_CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
INF_CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}'
BAD_INPUT = [  # (id, route, body, status, the field the message must name; None: no field)
    ("list-body", CHAT, b"[1, 2]", 400, None),
    ("string-body", CHAT, b'"hello"', 400, None),
    ("max-tokens-type", CHAT, chat(max_tokens="lots"), 400, "max_tokens"),
    ("max-tokens-bool", CHAT, chat(max_tokens=True), 400, "max_tokens"),
    ("n-float", CHAT, chat(n=1.0), 400, "n"),
    ("stream-string", CHAT, chat(stream="yes"), 400, "stream"),
    ("messages-type", CHAT, json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
    ("temperature-type", COMP, json.dumps({"model": MODEL, "prompt": "x", "temperature": [1]}).encode(), 400,
     "temperature"),
    ("max-tokens-over-model", COMP, json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 5000}).encode(),
     400, "max_tokens"),
    ("temperature-nan", CHAT, NAN_CHAT, 400, "temperature"),
    ("temperature-inf", CHAT, INF_CHAT, 400, "temperature"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-p-over-one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("n-over-cap", CHAT, chat(n=3), 400, "n"),
    ("too-many-stops", CHAT, chat(stop=["x"] * 17), 400, "stop"),
    ("stop-too-long", CHAT, chat(stop=["x" * 1000]), 400, "stop"),
    ("stop-not-strings", CHAT, chat(stop=[1, 2]), 400, "stop"),
    ("seed-out-of-range", CHAT, chat(seed=-(1 << 70), temperature=1.0), 400, "seed"),
    ("lone-surrogate-chat", CHAT, SURROGATE_CHAT, 400, "messages"),
    ("lone-surrogate-prompt", COMP, b'{"model": "tiny", "prompt": "\\udfff"}', 400, "prompt"),
    ("lone-surrogate-stop", COMP, b'{"model": "tiny", "prompt": "x", "stop": "\\ud800"}', 400, "stop"),
    ("invalid-utf8", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     None),
    ("body-over-limit", CHAT, chat(user="x" * (BODY_LIMIT + 1)), 413, None),
    ("unknown-model", CHAT, json.dumps({"model": "gpt-4o", "messages": MESSAGES}).encode(), 404, "model"),
]


@pytest.mark.parametrize("route, body, status, field", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_clean_4xx(base_url, route, body, status, field):
    r = httpx.post(f"{base_url}{route}", content=body, headers={"content-type": "application/json"}, timeout=30)
    error = assert_clean_error(r, status)
    if field is not None:
        assert field in error["message"] and (error["param"] or "").startswith(field), error
    assert_serving(base_url)
    wait_idle()


def test_oversized_headers_are_refused(base_url):
    headers = {"x-filler": "a" * (256 << 10)}
    try:
        r = httpx.post(f"{base_url}{CHAT}", content=chat(max_tokens=2), headers=headers, timeout=30)
        assert 400 <= r.status_code < 500, r.status_code
    except httpx.HTTPError:  # the server may close the connection instead of answering
        pass
    assert_serving(base_url)


def long_prompt(i: int, num_words: int) -> str:
    return f"{i} " + " ".join(f"w{(i * 7 + k) % 500}" for k in range(num_words))


def test_timeout_storm_recovers(base_url):
    """200 long prompts with a 0.5 s client timeout: afterwards a short request is fast and nothing leaks."""
    num_requests, timeout = 200, httpx.Timeout(0.5)

    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": long_prompt(i, 400), "max_tokens": 256, "ignore_eos": True,
                "stream": i % 2 == 0}
        try:
            r = await http.post(f"{base_url}{COMP}", json=body, timeout=timeout)
            return str(r.status_code)
        except httpx.TimeoutException:
            return "timeout"

    async def storm() -> list[str]:
        limits = httpx.Limits(max_connections=num_requests)
        async with httpx.AsyncClient(limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(num_requests)))

    outcomes = asyncio.run(storm())
    assert outcomes.count("timeout") > num_requests // 2, outcomes
    assert set(outcomes) <= {"timeout", "200", "503", "429"}, outcomes
    start = time.monotonic()
    r = httpx.post(f"{base_url}{COMP}", timeout=30, json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and time.monotonic() - start < 5.0, (r.status_code, time.monotonic() - start)
    wait_idle(timeout_s=5.0)


def test_greedy_under_load_equals_alone(base_url):
    prompts = [long_prompt(i, 20 + 30 * i) for i in range(6)]

    def body(p: str) -> dict:
        return {"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    alone = [httpx.post(f"{base_url}{COMP}", json=body(p), timeout=60).json()["choices"][0]["text"]
             for p in prompts]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as http:
            rs = await asyncio.gather(*(http.post(f"{base_url}{COMP}", json=body(p)) for p in prompts * 2))
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(together()) == alone * 2
    wait_idle()


def test_forward_fault_fails_only_its_request(base_url):
    async def run() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=60) as http:
            def normal(i: int):
                return http.post(f"{base_url}{COMP}", json={"model": MODEL, "prompt": long_prompt(i, 40),
                                                            "max_tokens": 32, "ignore_eos": True})
            others = [asyncio.create_task(normal(i)) for i in range(3)]
            await asyncio.sleep(0.3)  # the others are decoding when the faulty prompt prefills
            bad = await http.post(f"{base_url}{COMP}", json={"model": MODEL, "prompt": [1, 2, FAIL_TOKEN_ID, 3],
                                                             "max_tokens": 8})
            return bad, list(await asyncio.gather(*others))

    bad, others = asyncio.run(run())
    error = assert_clean_error(bad, 500)
    assert error["type"] == "internal_error" and "injected fault" in error["message"]
    assert [r.status_code for r in others] == [200] * 3
    assert all(r.json()["usage"]["completion_tokens"] == 32 for r in others)
    wait_idle()
    assert_serving(base_url)


def test_forward_fault_mid_stream_is_an_error_event(base_url):
    body = {"model": MODEL, "prompt": [1, 2, FAIL_DECODE_TOKEN_ID], "max_tokens": 64, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base_url}{COMP}", json=body) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events and len(events) >= 2
    error = json.loads(events[-1])["error"]
    assert error["type"] == "internal_error" and "injected decode fault" in error["message"]
    assert not [leak for leak in LEAKS if leak in error["message"]]
    wait_idle()
    assert_serving(base_url)


def test_hung_engine_fails_health_and_is_replaced(base_url):
    """Last: the engine thread blocks for good; the health check fails and Serve starts a new replica."""
    from ray import serve

    old_id = replica_stats().replica_id
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}{COMP}", timeout=1.0, json={"model": MODEL, "prompt": [1, HANG_TOKEN_ID, 2],
                                                           "max_tokens": 4})
    deadline, new_id = time.monotonic() + 90, None
    while time.monotonic() < deadline:
        try:
            new_id = replica_stats().replica_id
        except Exception:  # the old replica is going away, the new one is not up yet
            new_id = None
        if new_id not in (None, old_id):
            break
        time.sleep(0.5)
    assert new_id not in (None, old_id), "the hung replica was never replaced"
    served = None
    while served is None and time.monotonic() < deadline:  # admission may still hold the dead replica
        try:
            r = httpx.post(f"{base_url}{CHAT}", timeout=10, json={"model": MODEL, "messages": MESSAGES,
                                                                  "max_tokens": 2})
            served = r if r.status_code == 200 else None
        except httpx.TimeoutException:
            pass
    assert served is not None and served.headers["x-replica-id"] == new_id, "the new replica never served"
    assert serve.status().applications[APP].status == "RUNNING"
    wait_idle()
