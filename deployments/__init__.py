"""The Ray Serve application: an OpenAI-compatible ingress in front of MLX engine replicas.

    app.py        AppArgs (pydantic) and build_app(args) -> serve.Application; the only place where
                  serve.deployment / serve.ingress are applied
    ingress.py    OpenAIIngress: validation, tokenization, fan-out to replicas, the Python handle API
    http_api.py   its FastAPI app: routes, SSE streaming, OpenAI error objects
    protocol.py   pure request -> engine input and increment -> response logic
    replica.py    EngineReplica: owns one AsyncEngine, streams plain-data increments, health, stats
    schemas.py    pydantic request / response models of the API
    errors.py     typed API errors (HTTP status + OpenAI error object), raised through handles too
    admission.py  AdmissionController (one detached Ray actor per app), the ingress's AdmittedReplicaClient,
                  the replicas' heartbeat (ReplicaReporter)
    admission_state.py / admission_queue.py   its pure accounting and bounded wait queue (no ray)
    cluster_env.py  environment for Ray's own processes (worker niceness, Serve's control loop, task events), set
                  before the cluster starts: `eval "$(python -m deployments.cluster_env)"`
    routing.py    AdmissionRequestRouter: Serve's request router, sends a request to the replica
                  admission chose (GenerateRequest.target_replica_id): prefix affinity, else most room

This package is the only one that imports ray (engine/ never does). `config/serve.yaml` runs it:
`serve run config/serve.yaml`.
"""
