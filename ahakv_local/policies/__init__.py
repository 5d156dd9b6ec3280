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
    for f in dataclasses.fields(cls):
        if f.name not in params:
            continue
        value = params[f.name]
        # a setting of the wrong kind ran on as whatever it was truthy as ({"error_model": "maybe"} was taken); the
        # type as written where the module postpones annotations, else the class (snapkv's kernel "x" ran)
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if (ok := KINDS.get(type_name)) is not None and not ok(value):
            raise AhakvError(f"policy {name}'s {f.name} must be of type {type_name}, not {value!r}")
        # and out of its range (snapkv's kernel -3 and ahakv's r 0 ran; random's seed -1 failed deep in numpy)
        least, most = cls.ranges.get(f.name, (None, None))
        if (least is not None and value < least) or (most is not None and value > most):
            bounds = f"{least} to {most}" if most is not None else f"at least {least}"
            raise AhakvError(f"policy {name}'s {f.name} must be {bounds}, not {value!r}")
    policy = cls(**params)
    return policy


__all__ = ["POLICIES", "Observation", "Policy", "holistic_sum", "make_policy", "query_readers"]
