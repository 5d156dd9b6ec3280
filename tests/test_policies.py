"""Every policy's choice on small hand-made statistics, against its paper's rule written out plainly."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ahakv_local.errors import AhakvError
from ahakv_local.policies import POLICIES, Observation, make_policy
from ahakv_local.policies.ahakv import head_median
from ahakv_local.policies.base import avg_pool

from numerics import sum_rtol
from reference import window_mean, word_max

L, H, N = 2, 2, 8  # layer 1 plays a sliding-window layer that sees only the last 4 positions
VISIBLE = np.array([[True] * N, [False] * 4 + [True] * 4])


# the policies work on the tap's float32 statistics, partly in float32: sums over at most L * H * N
# float32 terms, so their scores match a float64 reference within sum_rtol(L * H * N)
POLICY_RTOL = sum_rtol(L * H * N)


def synthetic_steps(seed: int = 0, steps: int = 3) -> list[Observation]:
    """A few decode steps of random softmax rows over 8 live positions (zero where not visible)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        logits = rng.normal(0, 2, (L, H, N))
        a = np.where(VISIBLE[:, None, :], np.exp(logits), 0.0)
        a /= a.sum(axis=2, keepdims=True)
        side = np.where(VISIBLE[:, None, :], np.exp(2 * logits), 0.0)
        side /= side.sum(axis=2, keepdims=True)
        vnorm = rng.uniform(0.5, 2.0, (L, 1, N))
        dist = rng.uniform(0.1, 3.0, (L, H, N))
        out.append(
            Observation(
                positions=np.arange(10, 10 + N),
                n_seen=10 + N,
                n_rows=1,
                budget=6,
                visible=VISIBLE,
                attn=a.astype(np.float32),
                side=side.astype(np.float32),
                verr=(a * dist).astype(np.float32),
                vnorm=vnorm.astype(np.float32),
            )
        )
    return out


def visible_mean(x: np.ndarray, j: int) -> float:
    """Mean of x[l, h, j] over the (layer, head) pairs that see position j, written as loops."""
    vals = [x[li, h, j] for li in range(L) for h in range(H) if VISIBLE[li, j]]
    return sum(vals) / len(vals)


# the paper's rule for each policy, as plain loops over the steps: keep-score per position
def expected_scores(name: str, steps: list[Observation]) -> np.ndarray | None:
    last = steps[-1]
    if name == "full":
        return np.full(N, np.inf)
    if name == "streaming":  # keep the most recent
        return last.positions.astype(float)
    if name == "h2o":  # attention accumulated over every step; the recent half of the budget is kept
        s = np.array([sum(visible_mean(o.attn, j) for o in steps) for j in range(N)])
        s[-3:] = np.inf  # recent_ratio 0.5 of budget 6
        return s
    if name == "tova":  # the current query's attention only
        return np.array([visible_mean(last.attn, j) for j in range(N)])
    if name == "scissorhands":  # fraction of steps with attention >= 1/t (t = tokens the layer sees)
        hits = np.zeros(N)
        for o in steps:
            important = np.zeros((L, H, N))
            for li in range(L):
                t = VISIBLE[li].sum()
                important[li] = o.attn[li] >= 1.0 / t
            hits += [visible_mean(important, j) for j in range(N)]
        return hits / len(steps)
    if name == "snapkv":  # window sum of attention, average-pooled with kernel 7 (3 each side)
        w = np.array([sum(visible_mean(o.attn, j) for o in steps) for j in range(N)])
        return np.array([w[max(0, j - 3) : j + 4].mean() for j in range(N)])
    return None  # random and ahakv: specific tests below


@pytest.mark.parametrize("seen", ["one layer slides", "every position"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_follows_its_rule(name, seen, monkeypatch):
    if seen == "every position":  # a group whose layers see all it holds takes a shortcut (no masking): same rule
        monkeypatch.setitem(globals(), "VISIBLE", np.ones((L, N), dtype=bool))
    policy = make_policy(name)
    steps = synthetic_steps()
    for obs in steps:
        policy.observe(obs)
    score = policy.score(steps[-1])
    assert score.shape == (N,)
    expected = expected_scores(name, steps)
    if name == "random":  # numpy's own stream for its seed, whatever was observed: uniformly random victims
        np.testing.assert_array_equal(score, np.random.default_rng(0).random(N))
        victims = np.concatenate([np.argsort(policy.score(steps[-1]))[:2] for _ in range(4000)])
        share = np.bincount(victims, minlength=N) / victims.size
        # each position's share of 8,000 victims is 1/8 within 4 binomial standard deviations (sqrt(p(1 - p) / n) =
        # 0.0037); a rule by position (oldest first, Streaming's) gives positions 0 and 1 a half each
        assert np.all(np.abs(share - 1 / N) < 4 * np.sqrt(1 / N * (1 - 1 / N) / victims.size)), share
        return
    if name == "ahakv":
        expected = ahakv_reference(steps, policy)
    np.testing.assert_allclose(score, expected, rtol=POLICY_RTOL)
    # the victims are the lowest scores
    order = np.lexsort((steps[-1].positions, expected))
    np.testing.assert_array_equal(np.lexsort((steps[-1].positions, score))[:3], order[:3])


def ahakv_reference(steps, policy) -> np.ndarray:
    """AhaKV with its defaults, from the definitions: weights from head focus (EMA 0.9), per-step
    contribution = side mass * ||v - o|| / ||o|| (error model), summed over the last r steps."""
    weights = None
    total = np.zeros(N)
    for obs in steps:
        focus = np.zeros((L, H))
        for li in range(L):
            for h in range(H):
                p = [obs.attn[li, h, j] for j in range(N) if VISIBLE[li, j]]
                p = np.array(p) / sum(p)
                ent = -sum(x * math.log(x) for x in p if x > 0)
                focus[li, h] = min(max(1 - ent / math.log(max(VISIBLE[li].sum(), 2)), 0.05), 1.0)
        weights = focus if weights is None else 0.9 * weights + 0.1 * focus
        w = weights / weights.mean()
        contrib = np.zeros(N)
        for j in range(N):
            num = den = 0.0
            for li in range(L):
                if not VISIBLE[li, j]:
                    continue
                for h in range(H):
                    o_norm = sum(obs.attn[li, h, i] * obs.vnorm[li, 0, i] for i in range(N))
                    dist = obs.verr[li, h, j] / obs.attn[li, h, j]
                    num += w[li, h] * obs.side[li, h, j] * dist / o_norm
                    den += w[li, h]
            contrib[j] = num / den
        total += contrib  # r = 32 > 3 steps: all count
    return total


def test_ahakv_recent_accumulation_forgets_old_steps():
    """RA: only the last r queries count, so every token older than r has r terms."""
    steps = synthetic_steps(steps=5)
    p = make_policy("ahakv", r=2, sg_softmax=False, value_prior=False, error_model=False, holistic_weights=False)
    for obs in steps:
        p.observe(obs)
    expected = [sum(visible_mean(o.attn, j) for o in steps[-2:]) for j in range(N)]
    np.testing.assert_allclose(p.score(steps[-1]), expected, rtol=POLICY_RTOL)


def test_ahakv_value_prior_and_sg_softmax():
    steps = synthetic_steps(steps=1)
    obs = steps[0]
    p = make_policy("ahakv", error_model=False, holistic_weights=False)
    p.observe(obs)
    nu = obs.vnorm[:, 0, :].astype(float) ** 2  # [L, N]
    # each position's window of 5, over the positions its layer sees (the sliding layer's values before its window,
    # which the tap reads as 0, are left out)
    seen = [[[i for i in range(max(0, j - 2), min(N, j + 3)) if VISIBLE[li, i]] for j in range(N)] for li in range(L)]
    pooled = np.array([[nu[li, w].mean() if w else 0.0 for w in seen[li]] for li in range(L)])
    gamma = pooled / pooled.max(axis=1, keepdims=True)
    expected = [visible_mean(obs.side * gamma[:, None, :], j) for j in range(N)]
    np.testing.assert_allclose(p.score(obs), expected, rtol=POLICY_RTOL)


def test_ahakv_value_prior_of_equal_values_is_one_wherever_a_layer_sees():
    """Equal values have gamma 1. The tap's 0 for what a sliding layer no longer sees was pooled in: the first
    positions its window sees had 0.6 and 0.8."""
    obs = dataclasses.replace(synthetic_steps(steps=1)[0], vnorm=np.where(VISIBLE[:, None, :], 1.5, 0.0))
    gamma = make_policy("ahakv", error_model=False)._value_prior(obs)
    # (float64 throughout: the pools are differences of cumulative sums, a few units in the last place off)
    np.testing.assert_allclose(gamma[VISIBLE[:, None, :].repeat(H, axis=1)], 1.0, rtol=1e-12)


def test_ahakv_gives_a_new_position_its_head_s_median_over_what_its_layer_saw():
    """Positions new since the last measured distances (a summed block) get each head's median distance. It was taken
    over every live position, and a sliding layer's distance is 0 where it sees nothing: past its window for most of a
    shared pool, the median of every sliding head was 0 and the new positions' block counted nothing there."""
    first = synthetic_steps(steps=1)[0]
    sees = np.array([[True] * N, [False] * 5 + [True] * 3])  # the sliding layer sees 3 of 8
    first = dataclasses.replace(first, visible=sees, verr=np.where(sees[:, None, :], first.verr, 0.0))
    p = make_policy("ahakv")
    p.observe(first)
    block = np.append(first.positions, first.positions[-1] + 1)  # one position more, not measured
    dist = p._last_distance(block)
    measured = p._distance[1]
    for li in range(L):
        for h in range(H):
            assert dist[li, h, -1] == pytest.approx(np.median(measured[li, h, sees[li]]), rel=1e-12)
    assert (dist[1, :, -1] > 0).all()


def test_ahakv_head_weights_learn_nothing_from_an_observation_without_rows():
    """An observation of no rows (every head's attention 0) read as entropy 0, focus 1: every weight was pulled to 1."""
    p = make_policy("ahakv")
    for obs in synthetic_steps(steps=3):
        p.observe(obs)
    before = p.weights.copy()
    empty = synthetic_steps(steps=1)[0]
    empty = dataclasses.replace(empty, n_rows=0, attn=np.zeros_like(empty.attn), side=np.zeros_like(empty.side))
    p.observe(dataclasses.replace(empty, verr=np.zeros_like(empty.verr)))
    np.testing.assert_array_equal(p.weights, before)
    first = make_policy("ahakv")  # nor as the first observation (its weights began at focus 1)
    first.observe(dataclasses.replace(empty, verr=np.zeros_like(empty.verr)))
    assert first.weights is None


def test_ahakv_lambda():
    p = make_policy("ahakv")
    assert p.side_scale(n_seen=100, budget=128) == 1.0  # nothing to evict yet: the model's own softmax
    assert p.side_scale(n_seen=8 * 128, budget=128) == pytest.approx(math.sqrt(2 * math.log(8)))  # 2.04


def test_ahakv_predicted_error_is_the_leave_set_out_bound():
    obs = synthetic_steps(steps=1)[0]
    p = make_policy("ahakv", holistic_weights=False)
    p.observe(obs)
    order = np.array([0, 5, 6])
    got = p.predicted_error(obs, order)
    for k in range(1, 4):
        total = count = 0.0
        for li in range(L):
            for h in range(H):
                o_norm = sum(obs.attn[li, h, i] * obs.vnorm[li, 0, i] for i in range(N))
                chosen = [j for j in order[:k] if VISIBLE[li, j]]
                a_e = sum(obs.attn[li, h, j] for j in chosen)
                e = sum(obs.verr[li, h, j] for j in chosen)
                total += e / (1 - a_e) / o_norm
                count += 1
        assert got[k - 1] == pytest.approx(total / count, rel=1e-6)
    assert np.all(np.diff(got) >= 0)


def test_sliding_window_zeros_do_not_count_against_old_tokens():
    """Position 0 is seen by layer 0 only; its score must not be halved by layer 1's forced zeros."""
    obs = synthetic_steps(steps=1)[0]
    p = make_policy("tova")
    expected0 = obs.attn[0, :, 0].mean()
    assert p.score(obs)[0] == pytest.approx(expected0, rel=1e-6)


def test_unknown_policy_is_a_clear_error():
    from ahakv_local.errors import AhakvError

    with pytest.raises(AhakvError, match="unknown policy 'h3o'; choose from full, streaming"):
        make_policy("h3o")


def test_ahakv_question_scored_by_its_pooled_attention_with_the_learned_head_weights():
    """A question's rows count by what they look at (FINCH/SnapKV): per row, the mean over the layers and heads
    that see position j of w(h, l) * attention (w: the running head focus, mean 1), pooled over query_kernel
    neighbours; joined with half the running score, each scaled to mean 1 (Policy.with_query)."""
    steps = synthetic_steps(steps=2)
    p = make_policy("ahakv", query_kernel=3)
    p.observe(steps[0])
    obs = steps[1]
    w = p.weights / p.weights.mean()
    raw = []
    for j in range(N):
        pairs = [(li, h) for li in range(L) for h in range(H) if VISIBLE[li, j]]
        raw.append(sum(w[li, h] * obs.attn[li, h, j] for li, h in pairs) / sum(w[li, h] for li, h in pairs))
    raw = np.array(raw) / obs.n_rows
    pooled = np.array([raw[max(0, j - 1) : j + 2].mean() for j in range(N)])
    before = (p.weights.copy(), p.ring.get(obs.positions).copy())
    got = p.query_score(obs)
    np.testing.assert_allclose(got, pooled, rtol=POLICY_RTOL)
    assert np.array_equal(p.weights, before[0]) and np.array_equal(p.ring.get(obs.positions), before[1])
    own = np.arange(1.0, N + 1)
    np.testing.assert_allclose(
        p.with_query(own, got), pooled / pooled.mean() + 0.5 * own / own.mean(), rtol=POLICY_RTOL
    )
    # with the words known (a pass key's five digits, a name in two pieces), each token takes its word's best
    words = obs.positions[[0, 1, 1, 1, 1, 1, 6, 6]]
    by_word = dataclasses.replace(obs, words=words)
    np.testing.assert_allclose(p.query_score(by_word), word_max(pooled, words), rtol=POLICY_RTOL)
    assert not np.allclose(word_max(pooled, words), pooled)  # the words change this case's scores


def test_ahakv_pools_its_running_score_only_in_a_guided_reading():
    """The rule: while a guided prompt (and its answer) is read, AhaKV's keep-score of position j is the mean of
    its per-token running score over positions j-h .. j+h that exist (h = read_kernel // 2); in any other reading,
    the per-token score itself (the paper's). Both computed here from the per-token score by hand."""
    steps = synthetic_steps(steps=2)
    p = make_policy("ahakv")
    for obs in steps:
        p.observe(obs)
    per_token = p.ring.get(steps[-1].positions)
    assert np.array_equal(p.score(steps[-1]), per_token)  # a fresh policy reads plainly
    p.reading(True)
    assert p.read_kernel >= 2  # a window wider than one token
    expected = window_mean(per_token, p.read_kernel)
    np.testing.assert_allclose(p.score(steps[-1]), expected, rtol=POLICY_RTOL)
    assert not np.allclose(expected, per_token)  # the pooling changes the scores of this input
    p.reading(False)
    assert np.array_equal(p.score(steps[-1]), per_token)
    p.reading(True)
    assert not p.fresh()._guided  # a sequence read from the start is plain until told otherwise


@pytest.mark.parametrize("kernel", [1, 5, 7, 15])
def test_avg_pool_is_a_window_mean(kernel):
    """Entry i is the plain mean of x over [i - kernel // 2, i + kernel // 2] clipped to the array (the odd kernels
    the policies use), against a loop in float64."""
    x = np.random.default_rng(3).random((2, 23))
    got = avg_pool(x, kernel)
    want = np.stack([window_mean(row, kernel) for row in x])
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 517, 518])
def test_ahakv_head_median_is_numpys_median(n):
    """AhaKV's median of each head's distances (the stand-in for positions not measured yet) is np.median's, to the
    last bit: the same partition and the same mean of the middle pair, odd and even counts."""
    rng = np.random.default_rng(n)
    dist = rng.lognormal(0.0, 1.0, (2, 4, n))
    np.testing.assert_array_equal(head_median(dist), np.median(dist, axis=2, keepdims=True))


def test_a_setting_of_the_wrong_kind_is_refused_by_name():
    """{"error_model": "maybe"} ran as a true value; 1.5 query rows as a window of 1.5. Numbers of numpy's are
    numbers, and a whole number is a float's value too."""
    with pytest.raises(AhakvError, match="policy ahakv's error_model must be of type bool, not 'maybe'"):
        make_policy("ahakv", error_model="maybe")
    with pytest.raises(AhakvError, match="policy ahakv's r must be of type int, not 1.5"):
        make_policy("ahakv", r=1.5)
    with pytest.raises(AhakvError, match="policy ahakv's weight_smoothing must be of type float, not True"):
        make_policy("ahakv", weight_smoothing=True)
    assert make_policy("ahakv", r=np.int64(16), weight_smoothing=1).r == 16


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_numeric_setting_is_refused_out_of_its_range_or_kind(name):
    """Every policy's numeric settings (``Policy.ranges``) are refused by name below or above their range, and of
    another kind: snapkv's kernel -3 and "x", ahakv's r 0 and weight_smoothing 5.0 ran; random's seed -1 failed in
    numpy."""
    cls = POLICIES[name]
    for setting, (least, most) in cls.ranges.items():
        for bad in [least - 1] + ([most + 1] if most is not None else []):
            with pytest.raises(AhakvError, match=rf"^policy {name}'s {setting} must be .*, not {bad!r}$"):
                make_policy(name, **{setting: bad})
        with pytest.raises(AhakvError, match=rf"^policy {name}'s {setting} must be of type"):
            make_policy(name, **{setting: "x"})
        make_policy(name, **{setting: least})  # the bound itself is taken
    numeric = {
        f.name
        for f in dataclasses.fields(cls)
        if f.init and str(getattr(f.type, "__name__", f.type)) in ("int", "float")
    }
    assert numeric <= set(cls.ranges), numeric - set(cls.ranges)  # (every numeric setting has a range)


@pytest.mark.parametrize("room", [0, 31])
@pytest.mark.parametrize("split", ["eviction", "peak"])
def test_h2o_splits_the_budget_in_heavy_hitters_and_recent_tokens(split, room):
    """H2O's cache holds heavy hitters and recent tokens half and half at every step (papers.md: "evenly assigns the
    caching budget"). Evicting every 32 steps, an eviction leaves 31 cells free for the steps to come, which one of
    the halves goes without: the recent tokens ("peak": 64 heavy hitters, 33 recent at 128 cells, as many of each
    when the cache is back at the budget) or the heavy hitters ("eviction", the default: 64 recent, 33 heavy). Every
    step evicting (room 0), both are H2O's own 64 and 64."""
    n, budget = 200, 128
    rng = np.random.default_rng(1)
    attn = rng.dirichlet(np.ones(n), size=(1, 2)).astype(np.float32)  # [L=1, H=2, n]
    obs = Observation(np.arange(n), n, 1, budget, np.ones((1, n), dtype=bool), attn=attn, room=room)
    policy = make_policy("h2o", split=split)
    policy.observe(obs)
    kept = np.argsort(-policy.score(obs), kind="stable")[: budget - room]
    n_heavy = 64 if split == "peak" else 64 - room
    recent = kept[kept >= n - (budget - room - n_heavy)]
    assert recent.size == budget - room - n_heavy and kept.size - recent.size == n_heavy
    # the heavy hitters are the largest sums of attention among the older positions
    older = np.arange(n - recent.size)
    heavy = older[np.argsort(-attn.mean(axis=1)[0, older], kind="stable")[:n_heavy]]
    assert set(kept) - set(recent) == set(heavy)


def test_ahakv_error_model_is_an_estimate_below_the_truth_where_values_cancel():
    """``predicted_error`` divides by sum_j a_j ||v_j||, an upper bound on ||o||, so it is no bound on the relative
    change (its docstring called it one). Known answer, one head, two values that nearly cancel: v1 = (1, 0),
    v2 = (-1, 0.1), a = (0.5, 0.5), so o = (0, 0.05). Evicting v1 leaves o' = v2: ||o - o'|| / ||o|| = 20.02, where
    the prediction, a1 ||v1 - o|| / ((1 - a1) sum_j a_j ||v_j||), is about 1.0."""
    v = np.array([[1.0, 0.0], [-1.0, 0.1]])
    a = np.array([0.5, 0.5])
    o = a @ v
    true = np.linalg.norm(o - v[1]) / np.linalg.norm(o)
    obs = Observation(
        positions=np.arange(2), n_seen=2, n_rows=1, budget=1, visible=np.ones((1, 2), dtype=bool),
        attn=a.reshape(1, 1, 2).astype(np.float32),
        verr=(a * np.linalg.norm(v - o, axis=1)).reshape(1, 1, 2).astype(np.float32),
        vnorm=np.linalg.norm(v, axis=1).reshape(1, 1, 2).astype(np.float32),
    )  # fmt: skip
    predicted = make_policy("ahakv", holistic_weights=False).predicted_error(obs, np.array([0]))[0]
    expected = a[0] * np.linalg.norm(v[0] - o) / ((1 - a[0]) * (a @ np.linalg.norm(v, axis=1)))
    assert true == pytest.approx(np.sqrt(1 + 0.05**2) / 0.05)  # 20.02
    assert predicted == pytest.approx(expected, rel=1e-5) and predicted < true / 10
