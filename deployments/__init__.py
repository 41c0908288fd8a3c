"""The Ray Serve application: an OpenAI-compatible ingress in front of MLX engine replicas.

    app.py            AppArgs (pydantic), build_app(args) -> serve.Application (the only place where
                      serve.deployment / serve.ingress are applied), and the CLI printing the metrics URLs
    messages.py       the wire types between deployments (GenerateRequest/Output, ReplicaReport, ...)
    engine_client.py  EngineClient: the typed engine contract the replica calls (AsyncEngine satisfies it)
    errors.py         typed API errors (HTTP status + OpenAI error object), raised through handles too
    cluster_env.py    environment for Ray's own processes, set before the cluster starts:
                      `eval "$(python -m deployments.cluster_env)"`
    ingress/          OpenAIIngress (validation, tokenization, fan-out), its FastAPI app, the pure
                      protocol logic, the API schemas, per-request telemetry
    replica/          EngineReplica (owns one engine, streams increments, reports capacity), its
                      telemetry, and the client callers reach it with (ReplicaClient, HandleReplicaClient)
    admission/        AdmissionController (one detached Ray actor per app) and its clients, the pure
                      accounting (state.py) and wait queue (queue.py), Serve's request router (routing.py)
    telemetry/        OpenTelemetry metrics and traces of every process, Prometheus ports

Imports go one way: app -> admission and ingress -> replica -> telemetry -> messages, engine_client,
errors (admission and ingress meet only in app). This package is the only one that imports ray
(engine/ never does). `config/serve.yaml` runs it: `serve run config/serve.yaml`.
"""
