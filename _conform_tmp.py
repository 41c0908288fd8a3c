from engine import AsyncEngine
from deployments.engine_client import EngineClient, EngineFactory
from deployments.replica.client import ReplicaClient, HandleReplicaClient
from deployments.admission.actor import AdmittedReplicaClient, ReplicaReporter
from deployments.replica.replica import Reporter
import sys; sys.path.insert(0, "tests/serve")
from serve_fakes import FakeEngine, LocalReplicaClient

def a(e: AsyncEngine) -> EngineClient: return e
def f(e: FakeEngine) -> EngineClient: return e
def h(c: HandleReplicaClient) -> ReplicaClient: return c
def ad(c: AdmittedReplicaClient) -> ReplicaClient: return c
def l(c: LocalReplicaClient) -> ReplicaClient: return c
def r(x: ReplicaReporter) -> Reporter: return x
fac: EngineFactory = AsyncEngine.from_config
