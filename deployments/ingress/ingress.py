"""OpenAIIngress: the OpenAI-compatible front door, over HTTP (FastAPI) and over a Python handle.

A plain class. Its FastAPI app is built per instance by `build_asgi_app()` (routes are closures over the
instance, so there is no module-level app); `build_app` hands that method to Ray Serve as the late-bound
ASGI builder (`serve.ingress()` + `__serve_build_asgi_app__`), and unit tests mount it in a TestClient.

Python handle API (`serve.get_app_handle("mlx-llm")`):

    resp = await handle.chat.remote(ChatCompletionRequest(...))            # ChatCompletionResponse
    async for chunk in handle.options(stream=True).chat_stream.remote(req):  # ChatCompletionChunk
    resp = await handle.completions.remote(CompletionRequest(...))         # CompletionResponse
    async for chunk in handle.options(stream=True).completions_stream.remote(req):
    await handle.models.remote()  /  handle.health.remote()  /  handle.stats.remote()

Requests may also be plain dicts. Errors are the typed exceptions of `deployments.errors`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine import EngineConfig

from deployments.errors import BadRequestError, ModelNotFoundError
from deployments.ingress.http_api import build_fastapi_app
from deployments.ingress.observation import RequestObservation
from deployments.ingress.drain import IngressDrain, find_drain
from deployments.ingress.protocol import Limits, PreparedRequest, prepare
from deployments.ingress.responses import Accumulator, OutputContext, StreamChunks, final_response, usage_chunk
from deployments.ingress.schemas import ChatCompletionRequest, CompletionRequest, HealthStatus, ModelCard, ModelList
from deployments.messages import GenerateOutput, GenerateRequest, ReplicaInfo, ReplicaStats
from deployments.replica.client import HandleReplicaClient, ReplicaClient
from deployments.telemetry.metrics import TelemetryConfig
from deployments.telemetry.observability import TelemetryFactory, process_telemetry

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what engine.model "default" serves


class IngressSettings(BaseModel):
    """What the ingress needs from AppArgs (built by `AppArgs.ingress_settings()`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig, description="For the tokenizer.")
    served_model_name: Optional[str] = Field(None, description="None: derived from engine.model.")
    max_tokens_cap: Optional[int] = Field(None, ge=1, description="None: the model's context.")
    max_n: int = Field(8, ge=1)
    max_request_body_bytes: int = Field(8 << 20, ge=1024)
    api_key: Optional[str] = Field(None, description="Bearer token required on /v1/*; None: open.")
    health_timeout_s: float = Field(5.0, gt=0)
    created: int = Field(0, description="Unix time reported in the model card.")
    telemetry: TelemetryConfig = Field(default_factory=lambda: TelemetryConfig(exporter="none"),
                                       description="This process's metrics and traces (AppArgs.telemetry).")

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        model = self.engine.model
        if model == "default":
            return DEFAULT_MODEL_NAME
        return model.rstrip("/").rsplit("/", 1)[-1]


def default_tokenizer_factory(config: EngineConfig) -> Any:
    """Load only the tokenizer of the engine's model (the ingress never loads weights)."""
    from mlx_lm.utils import load_tokenizer

    from engine.backend import resolve_dtype
    from engine.model.loader import resolve_model_path

    # The replicas' dtype, so a shared cache holds one converted copy of an embedded model, not two.
    return load_tokenizer(resolve_model_path(config.model, config.cache_dir, resolve_dtype(config.dtype)))


async def merge_streams(streams: list[AsyncGenerator[Any, None]]) -> AsyncGenerator[tuple[int, Any], None]:
    """Interleave several async iterators as (index, item); the first error ends the merge."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(index: int, stream: AsyncGenerator[Any, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((index, item, None))
        except Exception as e:
            await queue.put((index, None, e))
        finally:
            queue.put_nowait((index, finished, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is finished:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIIngress:
    """Validates and tokenizes requests, fans them out to the engine replicas, builds responses."""

    def __init__(
        self,
        replica: Any,
        settings: IngressSettings | dict,
        tokenizer_factory: Optional[Callable[[EngineConfig], Any]] = None,
        client_factory: Optional[Callable[[Any], ReplicaClient]] = None,
        telemetry_factory: Optional[TelemetryFactory] = None,
        drain_factory: Optional[Callable[[], IngressDrain]] = None,
    ) -> None:
        self._settings = IngressSettings.model_validate(settings)
        # Graceful shutdown (deployments/ingress/drain.py): the supervisor's drain signal, if any.
        self._drain = (drain_factory or find_drain)()
        self._telemetry = (telemetry_factory or process_telemetry)(self._settings.telemetry, "ingress")
        self._replicas: ReplicaClient = (client_factory or HandleReplicaClient)(replica)
        self._tokenizer = (tokenizer_factory or default_tokenizer_factory)(self._settings.engine)
        self._output_context = OutputContext.for_tokenizer(self._tokenizer)
        self._model_name = self._settings.model_name()
        self._info: Optional[ReplicaInfo] = None

    # ------------------------------------------------------------------ handle API

    async def models(self) -> ModelList:
        if self._info is None:  # before any request: ask a replica, briefly (the card can do without)
            try:
                self._info = await self._replicas.info(2.0)
            except Exception:  # noqa: BLE001 - no replica answered yet: max_model_len stays null
                logger.debug("no replica info for /v1/models yet", exc_info=True)
        return ModelList(data=[self._model_card()])

    async def chat(self, request: ChatCompletionRequest | dict) -> Any:
        """Non-streaming chat completion: a ChatCompletionResponse."""
        with self._drain.admit():
            return await self._complete(await self._prepare(request, ChatCompletionRequest))

    async def chat_stream(self, request: ChatCompletionRequest | dict) -> AsyncGenerator[Any, None]:
        """Streaming chat completion: ChatCompletionChunk objects (call with stream=True)."""
        with self._drain.admit():
            async with aclosing(self._stream(await self._prepare(request, ChatCompletionRequest))) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def completions(self, request: CompletionRequest | dict) -> Any:
        """Non-streaming completion: a CompletionResponse."""
        with self._drain.admit():
            return await self._complete(await self._prepare(request, CompletionRequest))

    async def completions_stream(self, request: CompletionRequest | dict) -> AsyncGenerator[Any, None]:
        """Streaming completion: CompletionChunk objects (call with stream=True)."""
        with self._drain.admit():
            async with aclosing(self._stream(await self._prepare(request, CompletionRequest))) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def health(self) -> HealthStatus:
        """Raises ServiceUnavailableError unless an engine replica answers healthy in time (and while the
        ingress drains: load balancers stop sending)."""
        self._drain.check_open()
        info = await self._replicas.info(self._settings.health_timeout_s)
        self._info = self._info or info
        return HealthStatus()

    async def stats(self) -> ReplicaStats:
        """Stats of one engine replica (the one the router picks)."""
        return await self._replicas.stats(self._settings.health_timeout_s)

    async def metrics_url(self) -> Optional[str]:
        """This ingress process's Prometheus /metrics URL (None: not served)."""
        return self._telemetry.prometheus_url

    def __del__(self) -> None:
        telemetry = getattr(self, "_telemetry", None)
        if telemetry is not None:
            telemetry.shutdown()

    def build_asgi_app(self) -> Any:
        """The FastAPI app serving this instance (see deployments.ingress.http_api)."""
        return build_fastapi_app(self, self._settings)

    # ------------------------------------------------------------------ internals

    def _model_card(self) -> ModelCard:
        max_len = self._info.max_model_len if self._info else None
        return ModelCard(id=self._model_name, created=self._settings.created, max_model_len=max_len)

    def check_model(self, name: str) -> None:
        if name not in (self._model_name, self._settings.engine.model):
            raise ModelNotFoundError(f"The model '{name}' does not exist; this server serves "
                                     f"'{self._model_name}'")

    async def _limits(self) -> Limits:
        if self._info is None:  # engines decide max_model_len; ask one replica once
            self._info = await self._replicas.info(max(30.0, self._settings.health_timeout_s))
        return Limits(max_model_len=self._info.max_model_len, vocab_size=_vocab_size(self._tokenizer),
                      max_tokens_cap=self._settings.max_tokens_cap, max_n=self._settings.max_n)

    async def _prepare(self, request: Any, cls: type[BaseModel]) -> PreparedRequest:
        received_ns = time.monotonic_ns()
        req = parse_request(request, cls)
        self.check_model(req.model)
        prepared = prepare(req, self._tokenizer, await self._limits(), self._model_name)
        return dataclasses.replace(prepared, received_ns=received_ns)

    async def _outputs(self, prepared: PreparedRequest) -> AsyncGenerator[tuple[int, GenerateOutput], None]:
        """Every increment of every choice; the request's telemetry is recorded when this ends."""
        observation = RequestObservation(self._telemetry, prepared)
        error: Optional[BaseException] = None
        try:
            async with aclosing(self._replica_outputs(prepared, observation.carrier())) as outputs:
                async for index, out in outputs:
                    self._drain.check_deadline()
                    observation.on_output(index, out)
                    yield index, out
        except BaseException as e:
            error = e
            raise
        finally:
            observation.finish(error)

    async def _replica_outputs(self, prepared: PreparedRequest,
                               trace_context: dict[str, str]) -> AsyncGenerator[tuple[int, GenerateOutput], None]:
        streams = [
            self._replicas.generate(GenerateRequest(f"{prepared.request_id}-{i}", prepared.prompt_token_ids, s,
                                                    trace_context))
            for i, s in enumerate(prepared.samplings)
        ]
        if len(streams) == 1:
            async with aclosing(streams[0]) as stream:
                async for out in stream:
                    yield 0, out
            return
        async with aclosing(merge_streams(streams)) as merged:
            async for item in merged:
                yield item

    async def _complete(self, prepared: PreparedRequest) -> Any:
        acc = Accumulator(len(prepared.samplings))
        async with aclosing(self._outputs(prepared)) as outputs:
            async for index, out in outputs:
                acc.add(index, out)
        return final_response(prepared, acc, self._output_context)

    async def _stream(self, prepared: PreparedRequest) -> AsyncGenerator[Any, None]:
        acc = Accumulator(len(prepared.samplings), keep_content=False)  # the chunks carry the content
        chunks = StreamChunks(prepared, self._output_context)
        async with aclosing(self._outputs(prepared)) as outputs:
            async for index, out in outputs:
                chunk = chunks.chunk(index, out)
                acc.add(index, out)
                if chunk is not None:
                    yield chunk
        if prepared.include_usage:
            yield usage_chunk(prepared, acc)


def parse_request(request: Any, cls: type[BaseModel]) -> Any:
    """A request model from a model or a dict; pydantic errors become BadRequestError(param=field)."""
    if isinstance(request, cls):
        return request
    try:
        data = request.model_dump() if isinstance(request, BaseModel) else request
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":  # OpenAI refuses unknown arguments too
            raise BadRequestError(f"{param}: this field is not supported by this server", param=param) from None
        raise BadRequestError(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def _vocab_size(tokenizer: Any) -> int:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return max(len(inner), int(getattr(inner, "vocab_size", 0) or 0))
    except TypeError:
        return int(getattr(inner, "vocab_size"))
