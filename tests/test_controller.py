"""Controller invariants under random decode/evict sequences, on the fixture (property tests)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ahakv_local.budget import Budget
from ahakv_local.controller import ControllerConfig, KVController
from ahakv_local.engine import Engine, EngineConfig
from ahakv_local.errors import AhakvError
from ahakv_local.native import TapFlag
from ahakv_local.policies import POLICIES, make_policy

import device
from numerics import sum_rtol

EVICTING = sorted(set(POLICIES) - {"full"})
CHUNK = 16
pytestmark = pytest.mark.device


def engine_for(path) -> Engine:
    return Engine(path, EngineConfig(n_ctx=512, n_batch=64, n_ubatch=CHUNK, n_gpu_layers=device.N_GPU_LAYERS))


@settings(max_examples=30, deadline=None)
@given(
    policy=st.sampled_from(EVICTING),
    budget=st.integers(40, 90),
    n_sink=st.integers(0, 4),
    n_recent=st.integers(0, 16),
    every=st.integers(1, 4),
    watch=st.one_of(st.none(), st.integers(1, 4)),
    pin=st.tuples(st.integers(0, 30), st.integers(0, 12)),
    prompt=st.integers(1, 150),
    steps=st.integers(1, 60),
)
def test_controller_invariants(
    fixture_model, license_text, policy, budget, n_sink, n_recent, every, watch, pin, prompt, steps
):  # one decode/evict history per example
    pinned = (pin[0], pin[0] + pin[1])
    watch = min(watch, every) if watch else None
    cfg = ControllerConfig(
        Budget.parse(budget), n_sink=n_sink, n_recent=n_recent, evict_every=every, pinned=pinned, observe_steps=watch
    )
    with engine_for(fixture_model) as e:
        tokens = e.tokenize(license_text)[: prompt + steps]
        c = KVController(e, make_policy(policy), cfg)

        evictions = []  # (live before, victims, the policy's last scores of live) of every native eviction
        native_evict, policy_score, scored = e.evict, c.policy.score, []

        def spy(positions):
            evictions.append((c.live.copy(), np.asarray(positions), scored[-1]))
            return native_evict(positions)

        def score(obs):
            scored.append(policy_score(obs))
            return scored[-1]

        e.evict, c.policy.score = spy, score

        def check(slack: int) -> None:
            np.testing.assert_array_equal(c.live, e.live_positions())  # bookkeeping == native cell map
            assert e.n_used() == c.live.size
            assert c.live.size <= budget + slack

        c.prefill(tokens[:prompt])
        check(0)
        for tok in tokens[prompt:]:
            c.step(tok)
            check(0)  # evictions leave room for the steps until the next one: the budget holds at every step

        for before, victims, scores in evictions:
            assert not np.any(victims < n_sink), "a sink was evicted"
            assert not np.any((victims >= pinned[0]) & (victims < pinned[1])), "a pinned position was evicted"
            recent = before[max(0, before.size - n_recent) :]
            assert not np.intersect1d(victims, recent).size, "a recent position was evicted"
            assert before[-1] not in victims, "the newest position was evicted"
            # the victims are the lowest-scored positions that may go (ties: the oldest first, which the rule allows)
            may_go = (before >= n_sink) & ~((before >= pinned[0]) & (before < pinned[1])) & ~np.isin(before, recent)
            may_go[-1] = False
            gone = np.isin(before, victims)
            assert not np.any(gone & ~may_go)
            if (may_go & ~gone).any():
                assert scores[gone].max() <= scores[may_go & ~gone].min(), "a higher-scored position went first"
        assert c.stats.evicted == sum(v.size for _, v, _ in evictions)
        assert c.stats.tokens_seen == prompt + steps


def test_long_prompt_never_needs_more_than_budget_plus_a_chunk(fixture_model, license_text):
    budget = 48
    config = EngineConfig(n_ctx=budget + CHUNK + 1, n_batch=64, n_ubatch=CHUNK, n_gpu_layers=device.N_GPU_LAYERS)
    with Engine(fixture_model, config) as e:
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


@pytest.mark.parametrize("policy_name", ["ahakv", "tova"])
def test_observe_steps_tap_only_the_steps_before_each_eviction(fixture_model, license_text, policy_name):
    every, watch, prompt = 8, 2, 60
    with engine_for(fixture_model) as e:
        tokens = e.tokenize(license_text)[:140]
        policy = make_policy(policy_name)
        observed = []  # (tokens seen, query rows) of every observation the policy gets
        observe = policy.observe
        policy.observe = lambda obs: (observed.append((obs.n_seen, obs.n_rows)), observe(obs))
        cfg = ControllerConfig(Budget.parse(64), n_recent=8, evict_every=every, observe_steps=watch)
        c = KVController(e, policy, cfg)
        c.prefill(tokens[:prompt])
        observed.clear()
        flags, prefill_evictions = [], c.stats.evictions
        for tok in tokens[prompt:]:
            c.step(tok)
            flags.append(c._tap[0])
        steps = range(len(tokens) - prompt)
        # positions 6 and 7 of every eight are observed; eviction follows position 7
        tapped = [i for i in steps if (prompt + i) % every >= every - watch]
        expected, pending = [], 0
        for i in steps:
            if i not in tapped:
                pending += 1
                continue
            if policy.accumulates and pending:
                # the steps since the last observation, summed by the tap, come first as one block
                expected.append((prompt + i, pending))
            expected.append((prompt + i + 1, 1))
            pending = 0
        assert observed == expected
        # unobserved steps keep the model's softmax (summed for a summing policy, dropped at the next observation for
        # another: its observations above read one row each) and the norms, so that an observation switches neither
        # on again (a scheduler reserve); the side pass and the error term run on the observed steps only
        quiet = TapFlag.ATTN | (policy.needs & TapFlag.VNORM)
        assert all(flags[i] == (policy.needs | TapFlag.ATTN if i in tapped else quiet) for i in steps)
        assert c.live.size <= 64 and c.stats.evictions - prefill_evictions == sum(
            (prompt + i) % every == 7 for i in steps
        )


def test_a_summed_block_scores_like_its_steps_observed_one_by_one(fixture_model, license_text):
    """H2O's score is a sum over query rows: observing every step or summing six in the graph and
    observing them at once must give the same scores (a second code path for the block)."""
    scores = []
    for watch in (None, 2):
        with engine_for(fixture_model) as e:
            tokens = e.tokenize(license_text)[:136]  # ends on an observed step (position 135): nothing left pending
            cfg = ControllerConfig(Budget.parse(400), n_recent=8, evict_every=8, observe_steps=watch)  # no eviction
            c = KVController(e, make_policy("h2o"), cfg)
            c.prefill(tokens[:60])
            for tok in tokens[60:]:
                c.step(tok)
            scores.append(c.policy.acc.get(c.live).copy())
    # the same F32 probabilities summed over 76 decode rows, in the graph or on the host: any order of
    # a sum of 76 non-negative terms is within sum_rtol(76) of another (plus the prefill's 60 rows)
    np.testing.assert_allclose(scores[1], scores[0], rtol=2 * sum_rtol(136))


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
        for tok in tokens[64:]:
            c.step(tok)
            # at every step (the cap was checked after 50 steps only, where the ratio is far below it): an eviction
            # every step keeps between ceil(0.1 n) and floor(0.4 n) of the n tokens seen then; one token came since
            n = e.n_past - 1
            assert math.ceil(0.1 * n) <= c.live.size <= math.floor(0.4 * n) + 1, (c.live.size, n)
        assert c.stats.budget == c.live.size


def test_a_controller_refuses_what_would_leave_it_wrong(fixture_model, license_text):
    """A prompt chunk of -1 read nothing and looped for good; one past the ubatch was cut into several decodes and the
    cache filled in the second, with the first's positions unknown to the policy (never evicted again); a rewind
    forward (truncate past n_past) moved n_past on, counted phantom tokens and evictions, and every later decode
    failed. Each is a ValueError now. And a controller over an engine evicted from before counts those evictions
    (tokens_seen = cells_used + evicted; it said 0 evicted of 100 seen with 80 cells)."""
    with engine_for(fixture_model) as e:
        tokens = e.tokenize(license_text)[:200]
        ctl = KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse(64), n_sink=4, n_recent=8))
        for chunk in (-1, 0, CHUNK + 1):
            with pytest.raises(ValueError, match=rf"^a prompt chunk is 1 to {CHUNK} tokens .*, not {chunk}$"):
                ctl.prefill(tokens, chunk=chunk)
        assert e.n_past == 0  # refused before any decode
        ctl.prefill(tokens[:150], chunk=CHUNK)
        with pytest.raises(ValueError, match=r"^cannot rewind to 151: 150 positions decoded$"):
            ctl.truncate(151)
        assert e.n_past == ctl.stats.tokens_seen == 150
        np.testing.assert_array_equal(ctl.live, e.live_positions())
        ctl.step(tokens[150])
    with engine_for(fixture_model) as e:
        e.decode(tokens[:100])
        e.evict(list(range(10, 30)))
        ctl = KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse(64), n_sink=4, n_recent=8))
        assert (ctl.stats.tokens_seen, ctl.stats.cells_used, ctl.stats.evicted) == (100, 80, 20)


def test_bad_configurations_are_refused(fixture_model):
    with engine_for(fixture_model) as e:
        with pytest.raises(AhakvError, match="smaller than sinks \\+ recent"):
            KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse(20), n_sink=4, n_recent=32))
        with pytest.raises(AhakvError, match="auto budget needs a policy with an error model"):
            KVController(e, make_policy("h2o"), ControllerConfig(Budget.parse("auto")))
    # caches of one prompt chunk and the newest token leave a ratio no cell: its cap read "at most -1 cells"
    with Engine(fixture_model, EngineConfig(n_ctx=64, n_batch=64, n_ubatch=64, cache_cells=(64, 0))) as e:
        for budget in ("0.5", "auto"):
            with pytest.raises(AhakvError, match=r"keeps nothing in caches of 64 cells: they hold only one prompt"):
                KVController(e, make_policy("ahakv"), ControllerConfig(Budget.parse(budget), 4, 8, positions=4096))
    for text in ("0", "-3", "1.5", "lots"):
        with pytest.raises(AhakvError, match="budget must be"):
            Budget.parse(text)
    assert Budget.parse("128") == Budget("cells", 128) and Budget.parse("0.2").mode == "ratio"
    # a whole number as written, past float's 53 bits too (it was refused as "budget 100000000000000000000 cells")
    assert Budget.parse("99999999999999999999").value == 99999999999999999999 and Budget.parse("1e3").value == 1000
    with pytest.raises(AhakvError, match="budget must be"):  # past float's range (an OverflowError, a traceback)
        Budget.parse("1" + "0" * 400)
