"""Eviction policies, one per module, by name.

Each is a small dataclass whose ``score(obs)`` gives one keep-score per live position (see
base.py); the controller evicts the lowest scores outside the protected tokens.
"""

from __future__ import annotations

import dataclasses
from numbers import Integral, Real

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


def check_guided(policy: str, asked: str, instead: str) -> None:
    """Refuse ``asked`` (a reading by a question or a reconstruction: "--reading query", "kv_query 'reconstruct'") for
    a policy no question guides, naming the ones it can guide and what to read with ``instead``."""
    if not make_policy(policy).reads_with_query:
        raise AhakvError(
            f"{asked} needs a policy a question can guide ({query_readers()}), not {policy}: read with {instead}"
        )


KINDS = {  # a setting's annotated type -> what it takes (numpy's numbers too; a bool is no number here)
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, Integral) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, Real) and not isinstance(v, bool),
}


def make_policy(name: str, **params) -> Policy:
    """A fresh policy by registry name, e.g. make_policy("ahakv", error_model=False)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise AhakvError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    policy = cls(**params)
    # a setting of the wrong kind ran on as whatever it was truthy as ({"error_model": "maybe"} was taken)
    for f in dataclasses.fields(policy):
        ok = KINDS.get(str(f.type))
        if f.name in params and ok is not None and not ok(value := getattr(policy, f.name)):
            raise AhakvError(f"policy {name}'s {f.name} must be of type {f.type}, not {value!r}")
    return policy


__all__ = ["POLICIES", "Observation", "Policy", "holistic_sum", "make_policy", "query_readers"]
