"""build_app: the Ray Serve application, from AppArgs (serve.yaml `args:` or Python); and its CLI.

This is the only place `serve.deployment` and `serve.ingress` are applied; EngineReplica and
OpenAIIngress stay plain classes (Ray Serve LLM's `build_llm_deployment` does the same):

    serve run config/serve.yaml                       # or: serve deploy config/serve.yaml
    serve.run(build_app({"engine": {"model": "tiny"}}), name="mlx-llm", route_prefix="/")
    python -m deployments.app metrics config/serve.yaml   # the Prometheus URLs its processes will use
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine import EngineConfig

from deployments.admission.actor import ReporterFactory, admitted_client_factory
from deployments.admission.state import AdmissionConfig
from deployments.engine_client import EngineFactory
from deployments.ingress.ingress import IngressSettings, OpenAIIngress
from deployments.replica.replica import EngineReplica
from deployments.telemetry.metrics import TelemetryConfig
from deployments.telemetry.observability import TelemetryFactory, planned_prometheus_urls, process_telemetry

APP_NAME = "mlx-llm"
REPLICA_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
API_KEY_ENV = "MLX_SERVE_API_KEY"  # the API key when serve.yaml's api_key is null
ADMISSION_ROUTER = "deployments.admission.routing:AdmissionRequestRouter"  # honours the admission controller's choice
AUTOSCALING_POLICY = "deployments.admission.autoscaling:admission_demand_policy"  # scales on admission demand


class AutoscalingArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Fewest engine replicas.")
    max_replicas: int = Field(1, ge=1, description="Most engine replicas (one per host / accelerator).")
    target_ongoing_requests: float = Field(8.0, gt=0, description="Requests per replica to aim for. With "
                                           "admission on, requests running plus those queued in the admission "
                                           "controller count (deployments/admission/autoscaling.py).")
    upscale_delay_s: float = Field(30.0, ge=0, description="Demand must call for more replicas this long "
                                                           "before Serve adds one (from zero: at once).")
    downscale_delay_s: float = Field(600.0, ge=0, description="Demand must call for fewer replicas this long "
                                                              "before Serve removes one.")
    look_back_period_s: float = Field(30.0, gt=10.0, description="Demand is averaged over this window (more "
                                      "than Serve's metrics_interval_s, 10 s: Serve requires it).")
    metrics_push_interval_s: float = Field(2.0, gt=0, le=60, description="How often each engine replica "
                                           "pushes its admission demand to Serve's controller (Serve's "
                                           "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S, default 10).")

    @model_validator(mode="after")
    def _order(self) -> "AutoscalingArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}")
        return self

    def serve_config(self, admission: bool) -> dict[str, Any]:
        """Serve's autoscaling_config; with admission, scaled on its demand (running + queued)."""
        config: dict[str, Any] = self.model_dump(exclude={"metrics_push_interval_s"})
        if admission:
            config["policy"] = {"policy_function": AUTOSCALING_POLICY}
        return config


class ReplicaArgs(BaseModel):
    """Ray options of each engine replica. One replica per host / accelerator: give each a GPU (num_gpus)
    or a custom per-host resource so two never share a device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per replica (small: the engine thread "
                                                   "does the work; Ray's default of 1 starves 2-core hosts).")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica (1 on an NVIDIA host with mlx[cuda]).")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="Custom Ray resources per replica, e.g. {'mlx_host': 1}.")
    max_replicas_per_node: Optional[int] = Field(
        None, ge=1, description="Engine replicas Serve may place on one node. None: 1 without GPUs (each "
        "replica claims memory_utilization of the host's memory), unbounded with num_gpus > 0 (one per GPU). "
        "Replicas sharing a device split its memory in admission (deployments/admission/placement.py).")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests in flight per replica before the "
                                                            "router queues them.")
    max_queued_requests: int = Field(-1, ge=-1, description="Requests queued at the router per replica "
                                                            "before 503 (-1: unbounded).")
    cpu_threads: int = Field(0, ge=0, description="Threads of the replica's CPU matmuls (OpenBLAS, "
                             "OpenMP: OPENBLAS_NUM_THREADS and OMP_NUM_THREADS of its process). 0: every "
                             "core of the host that builds the app. Ray would otherwise set OMP_NUM_THREADS "
                             "to num_cpus (at least 1), and MLX's CPU backend would multiply on one core.")
    health_check_period_s: float = Field(10.0, gt=0, description="Seconds between check_health calls.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="Seconds before a check counts as failed.")
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0, description="Drain time on shutdown.")


class IngressArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = Field(0.1, ge=0, description="CPUs reserved per ingress replica.")
    num_replicas: int = Field(1, ge=1, description="Ingress replicas (tokenization scales with these).")
    max_ongoing_requests: int = Field(1024, ge=1, description="Requests in flight per ingress replica.")


class AppArgs(BaseModel):
    """Everything `build_app` takes; serve.yaml's `args:` is validated by this model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(default_factory=EngineConfig, description="The engine of every replica.")
    served_model_name: Optional[str] = Field(
        None, min_length=1, description="Name clients put in `model`. None: 'SmolLM2-135M-Instruct' for "
        "the default model, 'tiny' for the tiny one, the folder name for a path. engine.model is accepted "
        "as an alias.")
    num_replicas: Optional[int] = Field(1, ge=1, description="Fixed number of engine replicas (None with "
                                                             "autoscaling).")
    autoscaling: Optional[AutoscalingArgs] = Field(None, description="Autoscale engine replicas instead.")
    replica: ReplicaArgs = Field(default_factory=ReplicaArgs, description="Engine replica Ray options.")
    ingress: IngressArgs = Field(default_factory=IngressArgs, description="Ingress Ray options.")
    max_tokens_cap: Optional[int] = Field(None, ge=1, description="Largest max_tokens a request may ask "
                                                                  "(and the default). None: the context.")
    max_n: int = Field(8, ge=1, le=128, description="Largest `n` (choices per request).")
    max_request_body_bytes: int = Field(8 << 20, ge=1024, description="Larger bodies get 413.")
    api_key: Optional[str] = Field(None, min_length=1, description="If set, /v1/* needs `Authorization: "
                                   f"Bearer <api_key>`. None: ${API_KEY_ENV} of the building process, if set.")
    health_timeout_s: float = Field(5.0, gt=0, description="GET /health waits this long for a replica.")
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig, description="Metrics and traces of every process. Prometheus: the "
        "ingress serves /metrics on prometheus_port, the replica of rank k on prometheus_port + 2 + k (a "
        "taken port falls back to a free one; scripts/serve prints the URLs).")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Cluster-wide admission: one controller actor models "
        "every replica as weights + reserved KV + floor step transient <= memory limit x headroom, "
        "picks the replica with room (most room, then most live headroom) and queues or rejects (503/429 + Retry-After) the rest.")

    @model_validator(mode="after")
    def _scaling(self) -> "AppArgs":
        if self.autoscaling is not None and self.num_replicas not in (None, 1):
            raise ValueError(f"num_replicas={self.num_replicas} and autoscaling are exclusive: set one")
        return self

    def resolved_api_key(self) -> Optional[str]:
        """api_key, else the environment's (so a secret need not sit in serve.yaml); None: no auth."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    def ingress_settings(self) -> IngressSettings:
        return IngressSettings(
            engine=self.engine, served_model_name=self.served_model_name, max_tokens_cap=self.max_tokens_cap,
            max_n=self.max_n, max_request_body_bytes=self.max_request_body_bytes, api_key=self.resolved_api_key(),
            health_timeout_s=self.health_timeout_s, created=int(time.time()), telemetry=self.telemetry,
        )

    def max_replicas_per_node(self) -> Optional[int]:
        """One engine replica per node on CPU and Metal hosts (each claims the host's memory); on GPUs
        num_gpus places them, one per GPU. An explicit replica.max_replicas_per_node wins."""
        r = self.replica
        if r.max_replicas_per_node is not None:
            return r.max_replicas_per_node
        return 1 if r.num_gpus == 0 else None

    def replica_deployment_options(self) -> dict[str, Any]:
        r = self.replica
        threads = str(r.cpu_threads or os.cpu_count() or 1)
        env = {"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}
        if self.autoscaling is not None:
            env["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = str(self.autoscaling.metrics_push_interval_s)
        actor: dict[str, Any] = {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus, "runtime_env": {"env_vars": env}}
        if r.resources:
            actor["resources"] = dict(r.resources)
        options: dict[str, Any] = dict(
            name=REPLICA_DEPLOYMENT, ray_actor_options=actor, max_ongoing_requests=r.max_ongoing_requests,
            max_queued_requests=r.max_queued_requests, health_check_period_s=r.health_check_period_s,
            health_check_timeout_s=r.health_check_timeout_s,
            graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s,
        )
        if self.max_replicas_per_node() is not None:
            options["max_replicas_per_node"] = self.max_replicas_per_node()
        if self.admission.enabled:
            options["request_router_config"] = {
                "request_router_class": ADMISSION_ROUTER,
                "request_router_kwargs": {"route_timeout_s": self.admission.replica_timeout_s,
                                          "admission": self.admission.model_dump()},
            }
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.serve_config(self.admission.enabled)
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options

    def ingress_deployment_options(self) -> dict[str, Any]:
        i = self.ingress
        return dict(name=INGRESS_DEPLOYMENT, num_replicas=i.num_replicas,
                    ray_actor_options={"num_cpus": i.num_cpus}, max_ongoing_requests=i.max_ongoing_requests)


def parse_args(args: Union[dict, AppArgs, None]) -> AppArgs:
    """AppArgs from a dict (serve.yaml) or an AppArgs; raises ValueError naming the bad field."""
    if isinstance(args, AppArgs):
        return args
    return AppArgs.model_validate(args or {})


@dataclass(frozen=True)
class ConfiguredApp:
    """One application of a Serve config (serve.yaml): its name and its validated args."""

    name: str
    args: AppArgs


def configured_apps(config: Mapping[str, Any]) -> list[ConfiguredApp]:
    """The applications of a loaded Serve config; raises ValueError naming a bad field of their args."""
    return [ConfiguredApp(app.get("name", "default"), parse_args(app.get("args")))
            for app in config.get("applications", [])]


def read_configured_apps(config_path: str) -> list[ConfiguredApp]:
    """`configured_apps` of a serve.yaml file."""
    with open(config_path) as f:
        return configured_apps(yaml.safe_load(f) or {})


def build_app(args: Union[dict, AppArgs, None]) -> Any:
    """The Serve application: OpenAIIngress (HTTP + handle API) -> EngineReplica x num_replicas."""
    return build_app_with(args)


def build_app_with(
    args: Union[dict, AppArgs, None],
    engine_factory: Optional[EngineFactory] = None,
    tokenizer_factory: Optional[Callable[[EngineConfig], Any]] = None,
    telemetry_factory: Optional[TelemetryFactory] = None,
) -> Any:
    """build_app with injected factories (tests use a fake engine; None means the real one)."""
    from ray import serve

    app_args = parse_args(args)
    admission = app_args.admission if app_args.admission.enabled else None
    # The controller's own Telemetry (role "admission"), built in its process by whoever creates it.
    admission_telemetry = functools.partial(telemetry_factory or process_telemetry, app_args.telemetry, "admission")
    replica = serve.deployment(EngineReplica, **app_args.replica_deployment_options())
    ingress_cls = serve.ingress()(serve_ingress_class(OpenAIIngress))
    ingress = serve.deployment(ingress_cls, **app_args.ingress_deployment_options())
    return ingress.bind(
        replica.bind(app_args.engine, engine_factory, telemetry=app_args.telemetry,
                     telemetry_factory=telemetry_factory,
                     reporter_factory=ReporterFactory(admission, admission_telemetry) if admission else None),
        app_args.ingress_settings(),
        tokenizer_factory,
        client_factory=admitted_client_factory(admission, admission_telemetry) if admission else None,
        telemetry_factory=telemetry_factory,
    )


def serve_ingress_class(cls: type) -> type:
    """A subclass whose `__serve_build_asgi_app__` (Serve's late-bound ASGI hook, called after the
    constructor) is the plain class's `build_asgi_app`; the plain class is left untouched."""
    sub = type(cls.__name__, (cls,), {"__serve_build_asgi_app__": cls.build_asgi_app})
    return sub


def metrics_lines(config_path: str) -> list[str]:
    """What `metrics` prints for each application of a serve.yaml: its exporter and planned URLs."""
    lines = []
    for app in read_configured_apps(config_path):
        args = app.args
        replicas = args.num_replicas or (args.autoscaling.max_replicas if args.autoscaling else 1)
        urls = planned_prometheus_urls(args.telemetry, replicas, admission=args.admission.enabled)
        lines.append(f"[serve] {app.name}: telemetry exporter {args.telemetry.exporter}")
        lines += [f"[serve]   Prometheus {url}" for url in urls]
        if urls:
            lines.append("[serve]   (a taken port moves to a free one: see the log line '<role>: Prometheus "
                         "metrics at <url>')")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`python -m deployments.app metrics [config/serve.yaml]`: the Prometheus URLs the app will use."""
    parser = argparse.ArgumentParser(prog="python -m deployments.app")
    commands = parser.add_subparsers(dest="command", required=True)
    metrics = commands.add_parser("metrics", help="print the Prometheus /metrics URL of each process")
    metrics.add_argument("config", nargs="?", default="config/serve.yaml", help="a serve.yaml")
    options = parser.parse_args(argv)
    if options.command == "metrics":
        print("\n".join(metrics_lines(options.config)))


if __name__ == "__main__":
    main()
