"""Eviction policies, one per module, by name.

Each is a small dataclass whose ``score(obs)`` gives one keep-score per live position (see
base.py); the controller evicts the lowest scores outside the protected tokens.
"""

from __future__ import annotations

from ..errors import AhakvError
from .ahakv import AhaKV
from .base import Observation, Policy, holistic_sum
from .full import Full
from .h2o import H2O
from .random import Random
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming import Streaming
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, Streaming, Random, H2O, Scissorhands, TOVA, SnapKV, AhaKV)
}


def query_readers() -> str:
    """The policies a question can guide while a long prompt is read, named for a refusal ("tova, snapkv, ahakv")."""
    return ", ".join(name for name, cls in POLICIES.items() if cls.reads_with_query)


def make_policy(name: str, **params) -> Policy:
    """A fresh policy by registry name, e.g. make_policy("ahakv", error_model=False)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise AhakvError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return cls(**params)


__all__ = ["POLICIES", "Observation", "Policy", "holistic_sum", "make_policy", "query_readers"]
