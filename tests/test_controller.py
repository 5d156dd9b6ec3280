"""Controller invariants under random decode/evict sequences, on the fixture (property tests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ahakv_local.controller import Budget, ControllerConfig, KVController
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError
from ahakv_local.policies import POLICIES, make_policy

EVICTING = sorted(set(POLICIES) - {"full"})
CHUNK = 16


def engine_for(path) -> Engine:
    return Engine(path, EngineConfig(n_ctx=512, n_batch=64, n_ubatch=CHUNK))


@settings(max_examples=30, deadline=None)
@given(
    policy=st.sampled_from(EVICTING),
    budget=st.integers(40, 90),
    n_sink=st.integers(0, 4),
    n_recent=st.integers(0, 16),
    every=st.integers(1, 4),
    pin=st.tuples(st.integers(0, 30), st.integers(0, 12)),
    prompt=st.integers(1, 150),
    steps=st.integers(1, 60),
)
def test_controller_invariants(
    fixture_model, license_text, policy, budget, n_sink, n_recent, every, pin, prompt, steps
):  # one decode/evict history per example
    pinned = (pin[0], pin[0] + pin[1])
    cfg = ControllerConfig(Budget.parse(budget), n_sink=n_sink, n_recent=n_recent, evict_every=every, pinned=pinned)
    with engine_for(fixture_model) as e:
        tokens = e.tokenize(license_text)[: prompt + steps]
        c = KVController(e, make_policy(policy), cfg)

        evictions = []  # (live before, victims) of every native eviction
        native_evict = e.evict

        def spy(positions):
            evictions.append((c.live.copy(), np.asarray(positions)))
            return native_evict(positions)

        e.evict = spy

        def check(slack: int) -> None:
            np.testing.assert_array_equal(c.live, e.live_positions())  # bookkeeping == native cell map
            assert e.n_used() == c.live.size
            assert c.live.size <= budget + slack

        c.prefill(tokens[:prompt])
        check(0)
        for tok in tokens[prompt:]:
            c.step(tok)
            check(every - 1)  # between evictions the cache grows by at most evict_every - 1

        for before, victims in evictions:
            assert not np.any(victims < n_sink), "a sink was evicted"
            assert not np.any((victims >= pinned[0]) & (victims < pinned[1])), "a pinned position was evicted"
            recent = before[max(0, before.size - n_recent) :]
            assert not np.intersect1d(victims, recent).size, "a recent position was evicted"
            assert before[-1] not in victims, "the newest position was evicted"
        assert c.stats.evicted == sum(v.size for _, v in evictions)
        assert c.stats.tokens_seen == prompt + steps


def test_long_prompt_never_needs_more_than_budget_plus_a_chunk(fixture_model, license_text):
    budget = 48
    with Engine(fixture_model, EngineConfig(n_ctx=budget + CHUNK + 1, n_batch=64, n_ubatch=CHUNK)) as e:
        # n_ctx is padded to 256 by llama.cpp; the engine must still never hold more than budget + chunk
        tokens = e.tokenize(license_text)[:400]
        c = KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse(budget), n_recent=8))
        peak = 0
        for i in range(0, len(tokens), CHUNK):
            c._decode(tokens[i : i + CHUNK], c.policy.window, False)
            peak = max(peak, e.n_used())
            c.evict()
        assert peak <= budget + CHUNK
        assert c.live.size == budget


def test_ratio_budget_follows_tokens_seen(fixture_model, license_text):
    with engine_for(fixture_model) as e:
        tokens = e.tokenize(license_text)[:300]
        c = KVController(e, make_policy("tova"), ControllerConfig(Budget.parse("25%"), n_recent=8))
        c.prefill(tokens[:100])
        for tok in tokens[100:]:
            c.step(tok)
            assert c.live.size == int(np.ceil(0.25 * e.n_past))
        assert c.stats.retention == pytest.approx(0.25, abs=0.01)


def test_auto_budget_stays_within_its_ratio_bounds(fixture_model, license_text):
    with engine_for(fixture_model) as e:
        tokens = e.tokenize(license_text)[:320]
        budget = Budget.parse("auto", min_ratio=0.1, max_ratio=0.4, error_tol=0.05)
        c = KVController(e, make_policy("ahakv"), ControllerConfig(budget, n_recent=8))
        c.prefill(tokens[:64])
        ratios = []
        for tok in tokens[64:]:
            c.step(tok)
            ratios.append(c.live.size / e.n_past)
        assert max(ratios[50:]) <= 0.4 + 1 / 100
        assert min(ratios) >= 0.1 - 1 / 100
        assert c.stats.budget == c.live.size


def test_bad_configurations_are_refused(fixture_model):
    with engine_for(fixture_model) as e:
        with pytest.raises(AhakvError, match="smaller than sinks \\+ recent"):
            KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse(20), n_sink=4, n_recent=32))
        with pytest.raises(AhakvError, match="auto budget needs a policy with an error model"):
            KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse("auto")))
    for text in ("0", "-3", "1.5", "lots"):
        with pytest.raises(AhakvError, match="budget must be"):
            Budget.parse(text)
    assert Budget.parse("128") == Budget("cells", 128) and Budget.parse("0.2").mode == "ratio"
