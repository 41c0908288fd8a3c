"""Fault injection for the reliability tests: an engine factory whose model forward fails or hangs.

`FaultyEngineFactory` is passed to `build_app_with(args, engine_factory=...)`. It builds the real engine
on the tiny model and wraps its runner: a prompt chunk holding `fail_token_id` raises in prefill (and a
forward of it with decode rows, which the engine then runs apart); a prompt holding `fail_decode_token_id` makes the decode forward raise once that request has decoded
`decodes_before_fault` tokens (mid-stream); one holding `hang_token_id` blocks the engine thread for good
(AsyncEngine's `hang_timeout_s` then reports the engine unhealthy). Ray pickles the factory by reference,
so the replicas import this module as `tests.serve.faults` (the repository root is on their PYTHONPATH).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

FAIL_TOKEN_ID = 49149  # three of the last ids of the tiny model's 49152-token vocabulary
FAIL_DECODE_TOKEN_ID = 49150
HANG_TOKEN_ID = 49151
DECODES_BEFORE_FAULT = 3


class InjectedFault(RuntimeError):
    """What the wrapped forward raises."""


@dataclass(frozen=True)
class FaultyEngineFactory:
    fail_token_id: int = FAIL_TOKEN_ID
    fail_decode_token_id: int = FAIL_DECODE_TOKEN_ID
    hang_token_id: int = HANG_TOKEN_ID
    decodes_before_fault: int = DECODES_BEFORE_FAULT
    hang_timeout_s: float = 3.0

    def __call__(self, config: Any) -> Any:
        from engine.async_engine import AsyncEngine
        from engine.engine import Engine

        engine = Engine.from_config(config)
        self.wrap(engine.runner)  # Engine looks the runner's methods up on every step
        return AsyncEngine(engine, hang_timeout_s=self.hang_timeout_s)

    def wrap(self, runner: Any) -> None:
        prefill, decode, mixed = runner.prefill, runner.decode, runner.mixed_forward
        marked: dict[str, int] = {}  # request_id -> decodes so far, for prompts with fail_decode_token_id

        def check_prefill(work: Any) -> None:
            if self.fail_token_id in work.token_ids:
                raise InjectedFault(f"injected fault: token {self.fail_token_id} in the prompt")
            if self.hang_token_id in work.token_ids:
                threading.Event().wait()  # never set: the engine loop hangs here

        def faulty_prefill(work: Any) -> Any:
            check_prefill(work)
            if self.fail_decode_token_id in work.token_ids:
                marked[work.request_id] = 0
            return prefill(work)

        def faulty_decode(works: list, *args: Any, **kwargs: Any) -> Any:
            for w in works:
                if w.request_id in marked:
                    marked[w.request_id] += 1
                    if marked[w.request_id] > self.decodes_before_fault:
                        del marked[w.request_id]
                        raise InjectedFault(f"injected decode fault for {w.request_id}")
            return decode(works, *args, **kwargs)

        def faulty_mixed(work: Any, works: list) -> Any:
            # a chunk with decode rows (engine/model/layers/mixed.py): a fault in either makes the engine run them
            # apart, where the faulty part raises again
            check_prefill(work)
            if self.fail_decode_token_id in work.token_ids or any(w.request_id in marked for w in works):
                raise InjectedFault("injected fault: a marked row in a mixed forward")
            return mixed(work, works)

        runner.prefill, runner.decode, runner.mixed_forward = faulty_prefill, faulty_decode, faulty_mixed
