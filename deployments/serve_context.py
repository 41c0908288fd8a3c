"""What Ray Serve says about the replica this code runs in (its id, app and rank), read in one place.

Each function answers a neutral value outside a Serve replica (unit tests, the driver, a plain actor).
"""

from __future__ import annotations

from typing import Optional


def current_replica_id() -> str:
    """This Serve replica's unique id ("" outside Serve)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica
        return ""


def current_app_name() -> str:
    """The application of this Serve replica ("default" outside Serve, or for an unnamed app)."""
    try:
        from ray import serve

        return serve.get_replica_context().app_name or "default"
    except Exception:  # outside a Serve replica
        return "default"


def replica_rank() -> Optional[int]:
    """This Serve replica's rank in its deployment (0..n-1); None outside Serve."""
    try:
        from ray import serve

        rank = serve.get_replica_context().rank
        return int(getattr(rank, "rank", rank))
    except Exception:  # not inside a Serve replica, or a Serve without ranks
        return None
