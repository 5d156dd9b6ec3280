"""ahakv_local.Llama used exactly like llama_cpp.Llama, on Gemma 3 270M; and what a budget changes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from ahakv_local import Llama
from ahakv_local.errors import AhakvError

from numerics import norm_rtol


@pytest.fixture(scope="module")
def plain(gemma_model):
    return Llama(str(gemma_model), n_ctx=512, verbose=False)


@pytest.fixture(scope="module")
def bounded(gemma_model):
    return Llama(str(gemma_model), n_ctx=512, n_batch=64, kv_budget=96, kv_policy="ahakv", verbose=False)


def test_without_a_budget_it_is_llama_cpp(gemma_model, plain):
    reference = llama_cpp.Llama(str(gemma_model), n_ctx=512, verbose=False)
    prompt = "The GNU General Public License is"
    ours = plain(prompt, max_tokens=16, temperature=0)
    theirs = reference(prompt, max_tokens=16, temperature=0)
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    assert ours.keys() == theirs.keys() and ours["usage"] == theirs["usage"]
    with pytest.raises(ValueError, match=r"Requested tokens \(\d+\) exceed context window of 512") as ours_err:
        plain("word " * 600, max_tokens=4)
    with pytest.raises(ValueError) as theirs_err:
        reference("word " * 600, max_tokens=4)
    assert str(ours_err.value) == str(theirs_err.value)  # the same error text
    assert plain.kv_controller is None and plain.kv_stats().layer_budgets == ""  # no budget, no layout


@pytest.mark.parametrize("fixture", ["plain", "bounded"])
def test_openai_shapes(request, fixture):
    llm = request.getfixturevalue(fixture)
    out = llm.create_completion("Hello", max_tokens=8, temperature=0)
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] in ("length", "stop")
    assert set(out["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    chunks = list(llm("Hello", max_tokens=8, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" and "text" in c["choices"][0] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    chat = llm.create_chat_completion(messages=messages, max_tokens=8, temperature=0)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    stream = list(llm.create_chat_completion(messages=messages, max_tokens=8, temperature=0, stream=True))
    assert all(c["object"] == "chat.completion.chunk" for c in stream)
    assert stream[0]["choices"][0]["delta"].get("role") == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in stream)
    assert text == chat["choices"][0]["message"]["content"]
    assert llm.tokenize(b"Hello") and llm.detokenize(llm.tokenize(b"Hello", add_bos=False)) == b"Hello"


def test_generation_past_budget_and_n_ctx(gemma_model):
    """4x the budget and past n_ctx, with the cells at the budget and the KV buffer sized for it (the product's
    layout, adaptive: one cache per layer, each kind holding the budget on average, which the statistics report)."""
    budget = 96
    llm = Llama(str(gemma_model), n_ctx=256, n_batch=64, kv_budget=budget, kv_policy="h2o", verbose=False)
    kv = llm.kv_controller
    prompt = llm.tokenize(b"Write down every number from one to a thousand in words:")
    peak = 0
    for i, _ in enumerate(llm.generate(prompt, temp=0.8, top_k=40)):
        peak = max(peak, kv.stats.cells_used)
        if i + 1 + len(prompt) >= 4 * budget + 64:
            break
    stats = llm.kv_stats()
    assert stats.tokens_seen >= 4 * budget and stats.tokens_seen > 256  # past n_ctx too
    assert peak <= budget + 1 and stats.cells_used <= budget
    assert stats.evicted == stats.tokens_seen - stats.cells_used
    # every layer's cache is its holding + one chunk + 1 cells (not padded to 256), not the text length: on average
    # budget + 65 in each kind (the budget is below the window), the shares rounded to whole cells
    assert stats.kv_cells == budget + 64 + 1 < stats.tokens_seen
    per_cell = 18 * 1 * (256 + 256) * 2  # Gemma 3 270M: 18 layers, 1 KV head of 256, F16 K and V
    assert per_cell * (stats.kv_cells - 1) < stats.kv_bytes <= per_cell * stats.kv_cells
    assert llm.n_ctx() == 32768  # positions are bounded by the trained context, not by the cells


def test_no_prefix_reuse_after_an_eviction(gemma_model):
    llm = Llama(str(gemma_model), n_ctx=256, n_batch=64, kv_budget=64, kv_policy="streaming", verbose=False)
    text = b"In the beginning " * 30
    first = llm(text.decode(), max_tokens=4, temperature=0)["choices"][0]["text"]
    gap = llm.kv_controller.first_gap()
    assert gap is not None and gap == 4  # streaming keeps the 4 sinks, then evicts the oldest
    # the same prompt again: read from the start (the policy's statistics cannot be rewound)
    calls = []
    original = llm.kv_controller.truncate

    def spy(n):
        calls.append(n)
        return original(n)

    llm.kv_controller.truncate = spy
    again = llm(text.decode(), max_tokens=4, temperature=0)["choices"][0]["text"]
    assert calls and calls[0] == 0
    assert again == first
    with pytest.raises(ValueError, match="state cache"):
        llm.set_cache(llama_cpp.LlamaRAMCache())


def test_context_manager_frees_the_model(gemma_model):
    with Llama(str(gemma_model), n_ctx=256, kv_budget=64, n_batch=64, verbose=False) as llm:
        native = llm._ctx, llm._model
        assert llm("Hi", max_tokens=2, temperature=0)["choices"]
    assert native[0].ctx is None and native[1].model is None  # native resources released on exit


@pytest.mark.parametrize("budget", [None, 64])
def test_use_after_close_raises_instead_of_crashing(gemma_model, budget):
    """Upstream hands freed pointers to llama.cpp after close() (a segfault); the drop-in raises."""
    llm = Llama(str(gemma_model), n_ctx=256, kv_budget=budget, n_batch=64, verbose=False)
    llm.close()
    calls = {
        "tokenize": lambda: llm.tokenize(b"hi"),
        "complete": lambda: llm("Hi", max_tokens=2),
        "chat": lambda: llm.create_chat_completion([{"role": "user", "content": "hi"}]),
        "kv_stats": llm.kv_stats,
        "save_state": llm.save_state,
        "eval": lambda: llm.eval([1]),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="closed"):
            call()
        assert name
    llm.close()  # closing twice is harmless


def test_a_state_from_another_model_is_refused(gemma_model, fixture_model):
    with Llama(str(fixture_model), n_ctx=256, kv_budget=64, n_batch=64, verbose=False) as small:
        small("a b c", max_tokens=2, temperature=0)
        state = small.save_state()
    with Llama(str(gemma_model), n_ctx=256, kv_budget=64, n_batch=64, verbose=False) as llm:
        llm("Hi", max_tokens=2, temperature=0)
        before = llm.kv_controller.live.copy()
        with pytest.raises(ValueError, match="another model"):
            llm.load_state(state)
        np.testing.assert_array_equal(llm.kv_controller.live, before)  # nothing changed
        assert llm("Hi", max_tokens=2, temperature=0)["choices"]


@pytest.mark.parametrize("budget", ["50%", "auto"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"], ids=["one cache", "adaptive layers"])
def test_a_ratio_or_auto_budget_reading_past_its_cells_stays_inside_them(budget, arch):
    """A ratio or auto budget lays its caches out in n_ctx cells (generate's -c, 4,096 by default), while positions
    run to the trained context: ``generate --budget 25%`` failed with "the KV cache is full" a third of the way into
    an 18K-token document, where 25% of what it had read outgrew the 4,096 cells. The budget is capped at what the
    caches hold (``KVController.fitted``): a prompt 8x n_ctx is read through whole, never past the cells."""
    from ahakv_local.budget import holding_of
    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    path = fixture_path(FixtureSpec(arch=arch, n_layer=6) if arch == "gemma3" else FixtureSpec())
    with Llama(str(path), kv_budget=budget, n_ctx=256, n_batch=64, verbose=False) as llm:
        kv = llm.kv_controller
        full = [g for g in kv.groups if not g.window]
        cells = min(llm.kv_engine.n_cells(g.map_layer) for g in full)
        holds = int(holding_of(cells, 64, kv.config.room).value)
        assert kv.config.budget.cap == holds  # what the smallest full-attention cache holds between evictions
        prompt = llm.tokenize(b" ".join(b"weather %d" % i for i in range(300)))  # ~3,200 tokens: 50% is 1,600
        assert len(prompt) > 8 * 256
        out = llm(prompt, max_tokens=2, temperature=0)
        assert out["usage"]["prompt_tokens"] == len(prompt)
        assert max(g.live.size for g in full) <= holds and kv.stats.tokens_seen > len(prompt)


def test_the_full_cache_on_cells_laid_out_for_a_ratio_is_refused(fixture_model):
    """The policy that keeps every token on 256 cells whose positions run to the trained context (4,096): it would
    fail with "the KV cache is full" past them."""
    with pytest.raises(AhakvError, match="policy full keeps every token: these caches hold 256 cells, not the 4096"):
        Llama(str(fixture_model), kv_budget="25%", kv_policy="full", n_ctx=256, verbose=False)


def test_a_short_context_holds_what_llama_cpp_pads_it_to(gemma_model):
    """n_ctx=10 becomes 256 cells in llama.cpp; upstream's token array kept 10 entries (broadcast error)."""
    with Llama(str(gemma_model), n_ctx=10, n_batch=64, verbose=False) as llm:
        out = llm("Once upon a time there was a little girl who lived in a", max_tokens=16, temperature=0)
        assert out["usage"]["prompt_tokens"] > 10 and out["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_that_fills_the_context_ends_as_length(fixture_model, stream):
    """llama-cpp-python cuts max_tokens to what the context has left, then samples on past it while a UTF-8
    character is incomplete: here (the random fixture's bytes) llama_decode failed one token past the 256 cells.
    The completion ends at the context instead, as "length", with every token that fit decoded."""
    with Llama(str(fixture_model), n_ctx=256, verbose=False) as llm:
        out = llm.create_completion("a b " * 50, max_tokens=300, temperature=0, stream=stream)
        last = list(out)[-1] if stream else out
        assert last["choices"][0]["finish_reason"] == "length"
        assert llm.n_tokens == 256 == llm.n_ctx()
        # the prompt's 102 tokens, then each sampled token decoded but the last (never decoded, as upstream's)
        assert llm.kv_stats().sampled_tokens == 256 - 102 + 1


def test_openais_json_schema_format_is_sampled_as_json_of_the_schema(gemma_model):
    """llama-cpp-python 0.3.36 reads ``response_format`` of type json_object only: OpenAI's json_schema was ignored and
    the answer came in prose. The drop-in samples it as json_object of that schema (its grammar)."""
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}}}
    schema["required"] = ["city", "year"]
    messages = [{"role": "user", "content": "Where and when was the GNU GPL first published? Answer in JSON."}]
    with Llama(str(gemma_model), kv_budget=256, verbose=False) as llm:
        fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
        out = llm.create_chat_completion(messages, max_tokens=60, temperature=0, response_format=fmt)
        answer = json.loads(out["choices"][0]["message"]["content"])
        assert isinstance(answer["city"], str) and isinstance(answer["year"], int)
        with pytest.raises(ValueError, match="needs"):  # no "json_schema" to sample under
            llm.create_chat_completion(messages, max_tokens=2, response_format={"type": "json_schema"})
        with pytest.raises(ValueError, match=r"schema is a JSON Schema object, not 5$"):
            bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": 5}}
            llm.create_chat_completion(messages, max_tokens=2, response_format=bad)
        # OpenAI's "schema" is optional: without one, any JSON object, as json_object samples it (it was refused)
        named = {"type": "json_schema", "json_schema": {"name": "place"}}
        anything = llm.create_chat_completion(messages, max_tokens=30, temperature=0, response_format=named)
        json_object = llm.create_chat_completion(
            messages, max_tokens=30, temperature=0, response_format={"type": "json_object"}
        )
        assert anything["choices"][0]["message"] == json_object["choices"][0]["message"]
        assert anything["choices"][0]["message"]["content"].lstrip().startswith("{")
        # one llama-cpp-python's grammar cannot be made from (a pattern without ^...$): it sampled any JSON instead
        code = {"type": "object", "properties": {"code": {"type": "string", "pattern": "[A-Z]{3}"}}}
        for fmt in (
            {"type": "json_schema", "json_schema": {"name": "c", "schema": code}},
            {"type": "json_object", "schema": code},
        ):
            with pytest.raises(
                ValueError, match=r"response_format's schema cannot be sampled: Pattern must start with"
            ):
                llm.create_chat_completion(messages, max_tokens=2, response_format=fmt)


def test_a_prompt_past_the_trained_context_names_it(fixture_model):
    with Llama(str(fixture_model), kv_budget=64, n_batch=64, verbose=False) as llm:  # trained context 4,096
        with pytest.raises(ValueError, match="trained context of 4096 positions"):
            llm("a b " * 4000, max_tokens=2)


def test_settings_of_a_bounded_cache_without_a_budget_are_warned_of(fixture_model, recwarn):
    """kv_policy="h2o" without kv_budget kept every token without a word (the CLI refuses --policy without --budget);
    the drop-in warns, naming what does nothing, and stays quiet for what does something without a budget."""
    with pytest.warns(
        UserWarning, match=r"^kv_policy, kv_sinks apply to a bounded KV cache: without kv_budget"
    ) as warned:
        Llama(str(fixture_model), kv_policy="h2o", kv_sinks=8, n_ctx=128, verbose=False).close()
    assert [w.filename for w in warned] == [__file__]  # the caller's line (it named contextlib.py's)
    with pytest.warns(UserWarning, match=r"^kv_reuse_compressed, kv_query apply"):
        Llama(str(fixture_model), kv_reuse_compressed=True, kv_query=False, n_ctx=128, verbose=False).close()
    recwarn.clear()
    for quiet in ({}, {"kv_policy": "full"}, {"kv_type": "f16"}, {"kv_policy": "ahakv", "kv_sinks": 4}):
        Llama(str(fixture_model), n_ctx=128, verbose=False, **quiet).close()  # defaults, and what a full cache uses
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)], [str(w.message) for w in recwarn]


def test_the_cli_without_a_budget_passes_no_bounded_settings(fixture_model):
    """The CLI loads a model without a budget with none of the bounded cache's settings: its environment's
    (AHAKV_POLICY) and chat's kv_reuse_compressed would each have been warned of."""
    env = dict(os.environ, AHAKV_POLICY="h2o", AHAKV_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ahakv_local", "generate", str(fixture_model), "-p", "a b c", "-n", "2", "--temp", "0"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr


def test_budget_beyond_the_trained_context_is_refused_before_allocating(fixture_model):
    with pytest.raises(AhakvError, match="exceeds the model's trained context of 4096"):
        Llama(str(fixture_model), kv_budget=10**9, verbose=False)


def test_kv_stats_and_save_load(gemma_model):
    llm = Llama(str(gemma_model), n_ctx=256, n_batch=64, kv_budget=64, kv_policy="ahakv", verbose=False)
    llm("The quick brown fox " * 20, max_tokens=8, temperature=0)
    s = llm.kv_stats()
    # budget 64 - 4 sinks - 32 recent leaves 28 cells: evictions every 28 // 4 = 7 steps, 6 cells below it
    assert llm.kv_controller.config.evict_every == 7
    assert 64 - 6 <= s.cells_used <= 64 and s.budget == 64 and s.evicted == s.tokens_seen - s.cells_used
    assert s.prompt_tps > 0 and s.generation_tps > 0 and 0 < s.retention_ratio < 1
    state = llm.save_state()
    live = llm.kv_controller.live.copy()
    engine = llm.kv_controller.engine
    norms = [engine.stat("vnorm", il) for il in (0, 5)]  # a sliding-window layer and a full one
    assert all(np.all(n.values > 0) for n in norms)  # ahakv writes the norms (VNORM)
    llm.reset()
    llm("Something else entirely", max_tokens=2, temperature=0)
    llm.load_state(state)
    np.testing.assert_array_equal(llm.kv_controller.live, live)
    np.testing.assert_array_equal(engine.live_positions(), live)
    # the saved sequence's figures, in a Llama that never evicted (evicted read 0 after a load: chat's /stats)
    with Llama(str(gemma_model), n_ctx=256, n_batch=64, kv_budget=64, kv_policy="ahakv", verbose=False) as fresh:
        fresh.load_state(state)
        restored = fresh.kv_stats()
        assert (restored.tokens_seen, restored.cells_used, restored.evicted) == (s.tokens_seen, s.cells_used, s.evicted)
    # the restored cells sit elsewhere now (packed from cell 0); their value norms follow them
    for il, before in zip((0, 5), norms, strict=True):
        after = engine.stat("vnorm", il)
        np.testing.assert_array_equal(after.positions, before.positions)
        # recomputed from the same F16 values by the same F32 norm: equal within one norm's rounding
        np.testing.assert_allclose(after.values, before.values, rtol=norm_rtol(engine.head_dim))


def test_should_stop_ends_a_prompt_between_chunks(fixture_model):
    """The stop hook (what serve uses for a client that left or a SIGTERM) is checked before every decode
    call, prompt chunks included; the cache stays consistent up to the last chunk decoded."""
    from ahakv_local.llama import Stopped

    with Llama(str(fixture_model), kv_budget=64, n_batch=32, verbose=False) as llm:
        calls = []
        llm.should_stop = lambda: calls.append(llm.n_tokens) is None and llm.n_tokens >= 64
        tokens = llm.tokenize(b"a b c d " * 40)
        with pytest.raises(Stopped):
            llm.eval(tokens)
        assert llm.n_tokens == 64 and calls == [0, 32, 64]  # two chunks read, the third refused
        np.testing.assert_array_equal(llm.kv_controller.engine.live_positions(), llm.kv_controller.live)
        assert llm.kv_controller.live.max() == 63
        llm.should_stop = lambda: False
        assert llm("a b", max_tokens=2)["choices"]  # the same Llama answers the next request


def test_generate_without_reset_continues_what_was_evaluated(gemma_model):
    """An app's own eval/sample loop: generate(tokens, reset=False) goes on after what is cached. With a budget the
    drop-in rewound to nothing first ("girl girl girl ...": the one token decoded alone at position 0). The budget
    holds the whole text here, so the tokens are upstream's."""

    def loop(llm) -> list[int]:
        prompt = llm.tokenize(b"Once upon a time, there was a little")
        llm.eval(prompt)
        first = llm.sample(temp=0)
        out = [first]
        for token in llm.generate([first], temp=0, reset=False):
            out.append(token)
            if len(out) == 8:
                break
        return out

    reference = llama_cpp.Llama(str(gemma_model), n_ctx=512, n_batch=64, verbose=False)
    bounded = Llama(str(gemma_model), n_ctx=512, n_batch=64, kv_budget=256, verbose=False)
    try:
        expected = loop(reference)
        assert loop(bounded) == expected and len(set(expected)) > 2
        assert bounded.n_tokens == reference.n_tokens > 8
    finally:
        reference.close()
        bounded.close()


@pytest.mark.parametrize("budget", ["25%", "auto"])
def test_ratio_and_auto_budgets_work_at_the_default_context(gemma_model, license_text, budget):
    """At llama-cpp-python's defaults (n_ctx 512, n_batch 512) a prompt chunk of 512 took every cell the ratio had:
    25% kept the 36 protected positions (4% of 948 tokens), and auto was refused ("at most -1 cells")."""
    llm = Llama(str(gemma_model), kv_budget=budget, n_threads=1, verbose=False)
    try:
        # nothing read yet: a quarter of no tokens holds no cells (it showed "budget 1"), auto has not decided ("-")
        assert llm.kv_stats().budget == (0 if budget == "25%" else None)
        llm(license_text[:4000], max_tokens=2)
        s = llm.kv_stats()
        assert s.tokens_seen > 800 and s.cells_used <= s.budget
        if budget == "25%":
            # the target is a quarter of what was read, rounded to a whole cell (abs=1). The cells held are the
            # full-attention layers' mean, each layer holding its adaptive share of it, rounded down to whole cells
            # and evicted at the last prompt chunk, a few positions before the sampled token: below the target by
            # those, far above the 4% the defect kept (0.2 separates the two; this is not a numerical tolerance)
            assert s.budget == pytest.approx(0.25 * s.tokens_seen, abs=1) and s.cells_used >= 0.2 * s.tokens_seen
        else:  # auto's error model keeps kv_min_ratio-kv_max_ratio (10-40%) of it, less one cell of rounding
            assert 0.10 * s.tokens_seen - 1 <= s.cells_used <= 0.40 * s.tokens_seen
        llm.reset()  # (as the chat does after a stopped /read)
        assert llm.kv_stats().budget == (0 if budget == "25%" else None) and llm.kv_stats().cells_used == 0
    finally:
        llm.close()


@pytest.mark.parametrize("layer_budgets", ["pyramid", "adaptive"])
def test_an_auto_budget_reads_a_long_prompt_in_a_small_context(gemma_model, license_text, layer_budgets):
    """At n_ctx 384 an auto budget's sliding layers hold what their caches have room for (less than the window):
    pyramid's first layers were given 1.5x of that (the constructor refused its own budget: "does not fit the 480
    allocated cells") and adaptive's widest layers grew past it at a re-split ("the KV cache is full")."""
    llm = Llama(
        str(gemma_model), kv_budget="auto", n_ctx=384, n_threads=1, verbose=False, kv_layer_budgets=layer_budgets
    )
    try:
        llm(license_text[:6000], max_tokens=2, kv_query=False)
        s, e = llm.kv_stats(), llm.kv_engine
        assert s.tokens_seen > 1200 and 0.10 * s.tokens_seen - 1 <= s.cells_used <= 0.40 * s.tokens_seen
        for g in llm.kv_controller.groups:  # every layer within its own cache, beside a chunk and the newest token
            assert g.live.size + e.config.n_ubatch + 1 <= e.cache_cells(g.cache)
    finally:
        llm.close()


@pytest.mark.parametrize("kw", [{"kv_type": "q8_0"}, {"kv_budget": 96, "kv_type": "q8_0"}, {"kv_budget": "4MiB"}])
def test_a_pickled_llama_keeps_its_kv_type(gemma_model, kw):
    """Upstream pickles type_k and type_v beside the drop-in's kv_type, which refuses them: the copy is made from
    kv_type alone."""
    import pickle

    with Llama(str(gemma_model), n_ctx=1024, n_batch=64, n_threads=1, verbose=False, **kw) as llm:
        with pickle.loads(pickle.dumps(llm)) as copy:
            assert copy.kv_engine.config.type_k == llm.kv_engine.config.type_k
            assert copy.kv_engine.cache_sizes() == llm.kv_engine.cache_sizes()


@pytest.mark.parametrize("budget", [None, 96, "25%"])
def test_a_pickled_llama_is_made_again_as_it_was_asked_for(gemma_model, budget):
    """llama-cpp-python pickles a Llama as its constructor's arguments (an app handing it to multiprocessing). The
    drop-in's chat handler for a model without a template was a closure (no pickling at all), and a copy lost its
    budget and took the allocated cells for its context."""
    import pickle

    llm = Llama(str(gemma_model), kv_budget=budget, n_ctx=1024, n_batch=64, n_threads=1, verbose=False)
    try:
        copy = pickle.loads(pickle.dumps(llm))
        try:
            assert copy.kv_stats().budget == llm.kv_stats().budget and copy.n_ctx() == llm.n_ctx()
            assert copy.kv_engine.cache_sizes() == llm.kv_engine.cache_sizes()
            prompt = "The GNU General Public License " * 40  # past 96 cells: the same evictions
            assert (
                copy(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
                == llm(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
            )
            chat = [{"role": "user", "content": "Hi"}]  # the transcript's handler, made again
            kw = {"max_tokens": 4, "temperature": 0}
            assert (
                copy.create_chat_completion(chat, **kw)["choices"] == llm.create_chat_completion(chat, **kw)["choices"]
            )
        finally:
            copy.close()
    finally:
        llm.close()


def test_bad_arguments_are_value_errors_as_upstreams(fixture_model):
    """An app's `except ValueError` around Llama(...) catches llama-cpp-python's refusals; the drop-in's were a plain
    Exception, and an unknown kv_policy without a budget was accepted in silence."""
    for kw in ({"kv_budget": "abc"}, {"kv_budget": 10}, {"kv_budget": 64, "logits_all": True}, {"kv_policy": "nope"}):
        with pytest.raises(ValueError):
            Llama(str(fixture_model), n_ctx=256, verbose=False, **kw)


def test_a_state_llama_cpp_refuses_leaves_the_sequence_as_it_was(gemma_model):
    """A state of other caches (no budget: the model's own two; here one per layer) passes the drop-in's checks and
    is refused by llama.cpp as it reads, after it emptied the sequence: the sequence was lost (n_tokens 5 -> 0)."""
    plain = Llama(str(gemma_model), n_ctx=256, n_batch=64, verbose=False)
    bounded = Llama(str(gemma_model), n_ctx=256, n_batch=64, kv_budget=64, verbose=False)
    try:
        plain("Hello there", max_tokens=2, temperature=0)
        foreign = plain.save_state()
        bounded("The quick brown fox " * 20, max_tokens=4, temperature=0)
        before = bounded.save_state()
        live = bounded.kv_controller.live.copy()
        with pytest.raises(ValueError, match="llama.cpp refused this state"):
            bounded.load_state(foreign)
        after = bounded.save_state()
        assert bounded.n_tokens == before.n_tokens and bytes(after.llama_state) == bytes(before.llama_state)
        np.testing.assert_array_equal(bounded.kv_engine.live_positions(), live)
        np.testing.assert_array_equal(bounded.kv_controller.live, live)
    finally:
        plain.close()
        bounded.close()


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_the_memory_check_counts_the_bytes_a_budget_allocates(gemma_model, monkeypatch, kv_type):
    """A byte budget in the natural layout was refused for the larger cache's cells x every layer in f16 (1.5GiB of
    q4_0 "needs 31.9 GiB"); what is checked against the memory available is what the caches take, to the byte."""
    import ahakv_local.llama as dropin
    from ahakv_local.info import read_info

    kw = dict(kv_budget="16MiB", kv_layer_budgets="natural", kv_type=kv_type, n_ctx=4096, n_batch=64, verbose=False)
    with Llama(str(gemma_model), **kw) as llm:
        e = llm.kv_engine
        taken = sum(e.kv_bytes(c) for c in e.caches)
        largest = max(e.cache_cells(c) for c in e.caches)
    assert largest * read_info(gemma_model).kv_bytes_per_token() > taken  # the old estimate, above it
    monkeypatch.setattr(dropin, "available_memory", lambda: taken)
    Llama(str(gemma_model), **kw).close()
    monkeypatch.setattr(dropin, "available_memory", lambda: taken - 1)
    with pytest.raises(AhakvError, match=r"KV cells need .* GiB, more than the .* GiB of memory available"):
        Llama(str(gemma_model), **kw)


@pytest.mark.parametrize("budget", [None, 64], ids=["full cache", "bounded"])
def test_a_closed_llama_answers_alike_with_or_without_a_budget(fixture_model, budget):
    """After close(), reset() raised with a budget (its controller's engine was gone) where upstream's is a no-op, and
    n_ctx() answered with a budget where without one it raised: each now as without a budget."""
    llm = Llama(str(fixture_model), n_ctx=256, kv_budget=budget, verbose=False)
    llm("the quick brown fox", max_tokens=2, temperature=0)
    llm.close()
    llm.reset()
    assert llm.n_tokens == 0
    for call in (llm.n_ctx, lambda: llm("x", max_tokens=1), llm.save_state):
        with pytest.raises(ValueError, match="^this Llama was closed: create a new one$"):
            call()


def test_a_llama_left_open_at_exit_prints_nothing():
    """llama.cpp logs as it frees a model at interpreter shutdown; the log callback imported llama-cpp-python's
    logger there, which failed ("sys.meta_path is None") and Python printed the traceback on stderr. (Whether a
    log line comes that late depends on the order the interpreter frees objects in: this script, a user's report,
    met it every time.)"""
    import subprocess
    import sys

    script = """
from ahakv_local import Llama
from ahakv_local.models import fixture_path
F = str(fixture_path())
kw = dict(n_threads=1, verbose=False, n_ctx=256)
def tryit(name, f):
    try:
        print(name, "OK", repr(f())[:100])
    except Exception as e:
        print(name, type(e).__name__, str(e)[:150])
llm = Llama(F, **kw)
with Llama(F, **kw) as l2:
    print(l2("abc", max_tokens=3, temperature=0)["choices"][0]["text"])
tryit("after with", lambda: l2("abc", max_tokens=3))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("this Llama was closed: create a new one")
    assert proc.stderr == ""


def test_without_a_budget_a_state_llama_cpp_refuses_is_upstreams_runtime_error(gemma_model):
    """README: without kv_budget the drop-in is llama_cpp.Llama, error texts included: upstream raises
    RuntimeError("Failed to set llama state data") for a state of other caches (q8_0 K under flash attention into
    f16 ones); the drop-in raised its own ValueError. The sequence is kept as it was (upstream half-replaces it)."""
    import llama_cpp

    kw = dict(n_ctx=256, n_batch=64, verbose=False)
    for cls in (llama_cpp.Llama, Llama):
        quantized = cls(str(gemma_model), type_k=llama_cpp.GGML_TYPE_Q8_0, flash_attn=True, **kw)
        plain = cls(str(gemma_model), **kw)
        try:
            quantized("Hi there", max_tokens=2, temperature=0)
            plain("Hello", max_tokens=2, temperature=0)
            before = plain.n_tokens
            with pytest.raises(RuntimeError, match="^Failed to set llama state data$"):
                plain.load_state(quantized.save_state())
            if cls is Llama:
                assert plain.n_tokens == before
        finally:
            quantized.close()
            plain.close()


def test_a_stream_dropped_by_the_next_call_leaves_that_call_its_question(gemma_model, license_text):
    """`g = llm(..., stream=True)` again while the old stream was open: the old generator was closed when `g` was
    rebound, after the new call had set its question, and its cleanup cleared that question: the new long prompt
    was read unguided (0 guide tokens) and answered otherwise than a fresh Llama."""
    kw = dict(n_ctx=512, kv_budget=128, n_batch=64, verbose=False)
    prompt = license_text[:1500]  # ~340 tokens, past the budget: read guided by its last paragraph

    def run(stream) -> str:
        return "".join(c["choices"][0]["text"] for c in stream)

    with Llama(str(gemma_model), **kw) as fresh:
        expected = run(fresh(prompt, max_tokens=12, temperature=0, stream=True))
        guided = fresh.kv_stats().guide_tokens
    assert guided > 0
    with Llama(str(gemma_model), **kw) as llm:
        g = llm("Once upon a time", max_tokens=12, temperature=0, stream=True)
        next(g)
        before = llm.kv_stats().guide_tokens
        g = llm(prompt, max_tokens=12, temperature=0, stream=True)  # the old stream is dropped here
        assert run(g) == expected
        assert llm.kv_stats().guide_tokens - before == guided


def test_evictions_count_from_none_for_each_new_sequence(gemma_model, license_text):
    """kv_stats().evicted kept the evictions of sequences a reset or a fresh read had forgotten (230 after reset(),
    460 after the same request again), where tokens_seen and cells_used describe the sequence now."""
    prompt = license_text[:1500]
    with Llama(str(gemma_model), n_ctx=512, kv_budget=128, n_batch=64, verbose=False) as llm:
        llm(prompt, max_tokens=4, temperature=0)
        first = llm.kv_stats()
        assert first.evicted > 0 and first.tokens_seen == first.cells_used + first.evicted
        llm.reset()
        assert llm.kv_stats().evicted == 0
        llm(prompt, max_tokens=4, temperature=0)
        assert llm.kv_stats().evicted == first.evicted
        llm("Hello world", max_tokens=2, temperature=0)  # a new prompt: read from the start
        s = llm.kv_stats()
        assert s.evicted == 0 and s.tokens_seen == s.cells_used


@pytest.mark.parametrize("layer_budgets", ["shared", "natural"])
def test_a_rewind_to_a_shared_prefix_counts_only_the_kept_positions_evictions(
    gemma3_fixture, license_text, layer_budgets
):
    """With kv_reuse_compressed a prompt sharing a prefix with the cached one is read on from that prefix: the
    evictions of the positions it forgot stayed counted ("25 cells, 1685 evicted, 25 seen"). Each group counts what it
    evicted below the prefix (a full-attention group: what it holds is all it did not evict); tokens_seen = cells_used +
    evicted, the groups' own arrays the reference."""
    kw = dict(kv_budget=64, kv_policy="h2o", kv_layer_budgets=layer_budgets, kv_reuse_compressed=True, n_batch=64)
    with Llama(str(gemma3_fixture), verbose=False, **kw) as llm:
        llm(license_text[:2000], max_tokens=4, temperature=0)
        first = llm.kv_stats()
        assert first.evicted > 1000 and first.tokens_seen == first.cells_used + first.evicted
        llm(license_text[:300] + " and something else entirely", max_tokens=4, temperature=0)  # a shared prefix
        s, kv = llm.kv_stats(), llm.kv_controller
        for g in kv.groups:
            if g.window:  # (what leaves a sliding window llama.cpp drops itself: no eviction counted)
                continue
            forgotten = np.count_nonzero(~np.isin(np.arange(s.tokens_seen), g.live))
            assert g.evicted == forgotten == s.tokens_seen - g.live.size
        assert s.evicted < first.evicted and s.tokens_seen == s.cells_used + s.evicted


def test_a_refused_budget_leaves_nothing_for_the_next_model(fixture_model):
    """A kv_budget refused before the load (past the trained context) left its cache layout pending in the thread,
    and the next Llama, without a budget, got 5,641 cells where it asked for 512 (Gemma: 18 caches, 13x the bytes)."""
    with pytest.raises(AhakvError, match="trained context"):
        Llama(str(fixture_model), kv_budget=5000, n_ctx=512, verbose=False)
    with Llama(str(fixture_model), n_ctx=512, verbose=False) as plain:
        assert plain.kv_engine.cache_sizes() == (512,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # 0 was taken for the default period (32), where -1 was refused: None is the default
        ({"kv_budget": 64, "kv_evict_every": 0}, "evict_every must be at least 1"),
        ({"kv_budget": 64, "kv_observe_steps": 0}, "observe_steps at least 1"),
        # with a budget a negative n_ctx was served (upstream, and the drop-in without one, refuse it)
        ({"kv_budget": 64, "n_ctx": -1}, "n_ctx must be 0 .* or more, not -1"),
        ({"n_ctx": -100}, "n_ctx must be 0 .* or more, not -100"),
    ],
)
def test_the_drop_in_refuses_a_bad_setting_before_the_model_loads(fixture_model, kwargs, message, monkeypatch):
    monkeypatch.setattr(Llama, "_load", lambda *a, **kw: pytest.fail("the model was loaded"))
    with pytest.raises(AhakvError, match=message):
        Llama(str(fixture_model), verbose=False, **kwargs)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"n_seq": 0}, ValueError),
        ({"layer_groups": (0,) * 6, "cache_cells": (256,)}, AhakvError),  # was an IndexError, the model left loaded
        ({"layer_groups": (0,) * 6}, AhakvError),
    ],
)
def test_an_engine_refused_after_its_model_loads_frees_it(config, error, monkeypatch):
    """A refusal past the model's load left the model loaded until the garbage collector found its cycle (250 MB for
    the default model); one of them was a bare IndexError."""
    import gc

    from ahakv_local import upstream
    from ahakv_local.engine import Engine, EngineConfig
    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    loaded = []
    real = upstream.load_model
    monkeypatch.setattr(upstream, "load_model", lambda *a: loaded.append(real(*a)) or loaded[-1])
    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    gc.disable()  # as between two collections
    try:
        with pytest.raises(error):
            Engine(path, EngineConfig(n_ctx=256, n_batch=64, n_ubatch=64, **config))
        assert all(m.model is None for m in loaded)  # never loaded, or freed at once
    finally:
        gc.enable()


def test_a_refused_state_in_an_empty_llama_leaves_it_working(gemma_model):
    """A state llama.cpp refuses halfway (cut to 3/4) loaded into a Llama with nothing cached: the per-layer caches
    it had read stayed, and every later call failed ("llama_decode failed with code -1")."""
    kw = dict(kv_budget=256, n_ctx=1024, n_batch=64, verbose=False)
    with Llama(str(gemma_model), **kw) as a:
        a("The quick brown fox jumps over the lazy dog", max_tokens=4, temperature=0)
        state = a.save_state()
        expected = a("Hello", max_tokens=3, temperature=0)["choices"][0]["text"]
    state.llama_state = bytes(state.llama_state)[: state.llama_state_size * 3 // 4]
    state.llama_state_size = len(state.llama_state)
    with Llama(str(gemma_model), **kw) as b:
        with pytest.raises(ValueError, match="llama.cpp refused this state"):
            b.load_state(state)
        assert b.n_tokens == 0 and b.kv_engine.n_used() == 0
        assert b("Hello", max_tokens=3, temperature=0)["choices"][0]["text"] == expected


def test_a_stream_closed_early_leaves_the_next_read_counted_as_prompt(fixture_model):
    """What is decoded counts as prompt or generation by whether a completion is sampling: a stream closed after its
    first token must not leave a later direct eval() (chat's /read) counted as generated tokens."""
    with Llama(str(fixture_model), n_ctx=256, kv_budget=64, verbose=False) as llm:
        stream = llm("the cat sat on the mat", max_tokens=8, temperature=0, stream=True)
        next(stream)
        stream.close()
        before = llm.kv_stats()
        tokens = llm.tokenize(b" and the dog", add_bos=False)
        llm.eval(tokens)
        after = llm.kv_stats()
        assert after.prompt_tokens - before.prompt_tokens == len(tokens)
        assert after.generated_tokens == before.generated_tokens


def test_a_loaded_state_answers_alike_whatever_the_llama_read_before(fixture_model, license_text):
    """After ``load_state`` a policy's statistics start over (README): AhaKV kept the head weights it had learned on
    the sequence before (the policy was truncated, not made afresh) and each group its reconstruction scores (which a
    question-agnostic /read folds in), so a used Llama and a fresh one continued a loaded state differently."""
    from ahakv_local import Llama

    words = license_text.split()

    def llama() -> Llama:
        # (caches with a reconstruction's room: the used one reads a sequence by reconstruction first)
        return Llama(str(fixture_model), kv_budget=64, kv_recent=8, kv_layer_budgets="shared", n_batch=32,
                     kv_query="reconstruct", n_threads=1, verbose=False)  # fmt: skip

    with llama() as src:
        src.eval(src.tokenize(" ".join(words[:300]).encode()))
        state = src.save_state()
        more = src.tokenize((" " + " ".join(words[300:420])).encode(), add_bos=False)
    runs = []
    for used in (False, True):
        with llama() as llm:
            if used:  # another sequence first, read question-agnostically: reconstruction scores, head weights
                llm.create_completion(" ".join(words[500:800]), max_tokens=2, temperature=0, kv_query="reconstruct")
                assert any(np.isfinite(g.best).any() for g in llm.kv_controller.groups)  # scored
            llm.load_state(state)
            assert not any(np.isfinite(g.best).any() for g in llm.kv_controller.groups)  # none scored
            # and the tap's sums over the cells start over (llama.cpp's whole-context load left the last sequence's
            # rows on the cells it wrote, where the one-sequence load zeroes them)
            e = llm.kv_engine
            assert e.stat_rows == 0 and not any(e.stat_by_cell("attn", il).any() for il in range(e.n_layer))
            llm.eval(more)
            runs.append((llm.kv_controller.live.copy(), np.array(llm.eval_logits[-1])))
    np.testing.assert_array_equal(runs[1][0], runs[0][0])
    np.testing.assert_array_equal(runs[1][1], runs[0][1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_budget": 64, "kv_sinks": "x"}, r"n_sink must be a whole number, not 'x'"),
        ({"kv_budget": 64, "kv_recent": 1.5}, r"n_recent must be a whole number, not 1\.5"),
        ({"kv_budget": 64, "kv_evict_every": "x"}, r"evict_every must be a whole number"),
        ({"kv_budget": 64, "kv_pinned": "x"}, r"pinned must be a \(start, end\) pair of positions"),
        ({"kv_budget": "auto", "kv_min_ratio": "a"}, r"min_ratio must be a number in \(0, 1\], not 'a'"),
        ({"kv_budget": "auto", "kv_error_tol": "x"}, r"error_tol must be a number in \(0, 1\]"),
        ({"kv_budget": "auto", "kv_error_tol": -1}, r"error_tol must be a number in \(0, 1\], not -1"),
        ({"kv_budget": "auto", "kv_min_ratio": 0.9, "kv_max_ratio": 0.1}, r"min_ratio 0\.9 is more than max_ratio"),
        ({"kv_budget": 128, "n_ubatch": 0}, r"n_ubatch must be 1 or more, not 0"),
        ({"n_batch": -1}, r"n_batch must be 1 or more, not -1"),
    ],
)
def test_bad_keyword_arguments_are_refused_by_name(fixture_model, kwargs, message):
    """What the command line range-checks, the Python API took as given: "x" and 1.5 failed deep in numpy with a
    TypeError, an error_tol of "x" or -1 ran (auto kept 67 cells), min_ratio above max_ratio was taken, n_ubatch=0
    was a ZeroDivisionError's cousin in range(), and n_batch=-1 failed in llama.cpp, then crashed the interpreter as
    the half-made object was freed."""
    with pytest.raises(AhakvError, match=message):
        Llama(str(fixture_model), verbose=False, **kwargs)


def test_a_refused_batch_size_leaves_a_process_that_exits_cleanly(fixture_model):
    script = (
        "from ahakv_local import Llama\n"
        "try:\n"
        f"    Llama({str(fixture_model)!r}, n_batch=-1, verbose=False)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "refused: n_batch must be 1 or more" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    ("arch", "layout"), [("llama", "shared"), ("gemma3", "shared"), ("gemma3", "natural"), ("gemma3", "adaptive")]
)
def test_a_reused_compressed_history_is_read_on_from_a_prefix_that_ends_among_evicted_positions(
    license_text, arch, layout
):
    """``kv_reuse_compressed``: a prompt sharing a prefix of the cached sequence reuses it, and llama.cpp takes the next
    token at the newest cached position + 1. Where the positions just before the prefix's end were evicted, the read
    failed in llama_decode ("the last position stored ... is X = 5 ... Y = 13"), and so did every later call until
    ``reset()``. It now goes back to the newest position every group holds below the prefix's end and reads the
    tokens from there again: that position is checked here against the native cell maps, position by position. (On
    the Gemma 3 fixture, whose window is short, llama.cpp asks the sliding cache, which holds nothing that far back:
    the llama fixture's one cache is what failed.)"""
    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    path = fixture_path(FixtureSpec(arch=arch, n_layer=6))  # gemma3: sliding-window and full-attention layers
    kw = {"kv_budget": 64, "kv_recent": 8, "kv_reuse_compressed": True, "kv_layer_budgets": layout, "verbose": False}
    with Llama(str(path), n_batch=32, **kw) as llm:
        text = llm.tokenize(license_text[:3000].encode(), add_bos=True)[:400]
        llm.create_completion(text, max_tokens=4, temperature=0)
        kv, e = llm.kv_controller, llm.kv_engine
        gap = kv.first_gap()
        assert gap is not None and gap + 3 < kv.live[-1]  # evicted positions well before the newest
        n = gap + 2  # the new prompt shares the first n tokens: positions n - 2 and n - 1 were evicted
        assert n - 1 not in kv.live
        maps = [e.live_positions(g.map_layer) for g in kv.groups]

        def resumes_at(r: int) -> bool:  # every cache holding a position below r holds r - 1
            return all(m[m < r].size == 0 or m[m < r][-1] == r - 1 for m in maps)

        expected = max(r for r in range(n + 1) if r == 0 or resumes_at(r))
        assert kv.resume_point(n) == expected < n
        prompt = text[:n] + llm.tokenize(b" something else entirely", add_bos=False)
        first = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
        again = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
        assert first == again
        for g in kv.groups:  # the cells and the bookkeeping agree, and the newest position is the last one read
            np.testing.assert_array_equal(g.live, g.read_live(e))
        assert int(kv.live[-1]) == e.n_past - 1 == llm.n_tokens - 1


@pytest.mark.parametrize("budget", [64, None], ids=["bounded", "full cache"])
@pytest.mark.parametrize("n_tokens", [0, 10])
def test_a_state_whose_token_list_disagrees_with_its_cache_is_refused(fixture_model, budget, n_tokens):
    """A state (a saved chat's JSON edited, or damaged) whose n_tokens did not end where its cache does loaded, and
    every later decode failed ("inconsistent sequence positions"), /reset included: refused, the Llama as before."""
    kw = dict(n_ctx=512, verbose=False) | (dict(kv_budget=budget, kv_recent=8) if budget else {})
    with Llama(str(fixture_model), **kw) as a:
        a("the quick brown fox jumps over the lazy dog " * 8, max_tokens=4, temperature=0)
        state = a.save_state()
    assert state.n_tokens > 60
    with Llama(str(fixture_model), **kw) as b:
        b("hello there", max_tokens=2, temperature=0)
        expected = b("and then", max_tokens=4, temperature=0)["choices"][0]["text"]
        before = b.n_tokens
        state.n_tokens, state.input_ids = n_tokens, state.input_ids[:n_tokens]
        with pytest.raises(
            ValueError, match=rf"damaged: its cache holds positions up to \d+, its token list {n_tokens} "
        ):
            b.load_state(state)
        assert b.n_tokens == before
        assert b("and then", max_tokens=4, temperature=0)["choices"][0]["text"] == expected
        b.reset()  # and a reset empties the cells whatever the count said
        assert b("and then", max_tokens=4, temperature=0)["choices"][0]["text"] is not None


@pytest.mark.parametrize("budget", [64, None], ids=["bounded", "full cache"])
def test_a_state_whose_cache_data_is_short_is_refused_before_anything_changes(fixture_model, budget):
    """A state whose llama_state held fewer bytes than its llama_state_size was refused by numpy's copy, after the
    caches had been resized and the token list and the counts replaced by the refused state's."""
    kw = dict(n_ctx=512, verbose=False) | (dict(kv_budget=budget, kv_recent=8) if budget else {})
    with Llama(str(fixture_model), **kw) as a:
        a("the quick brown fox jumps over the lazy dog " * 8, max_tokens=4, temperature=0)
        state = a.save_state()
    with Llama(str(fixture_model), **kw) as b:
        b("hello there", max_tokens=2, temperature=0)
        before = (b.n_tokens, list(b.input_ids[: b.n_tokens]), b.kv_stats().tokens_seen, b.kv_stats().kv_cells)
        state.llama_state = state.llama_state[:-100]
        with pytest.raises(ValueError, match=r"^this state is damaged: its cache data holds \d+ bytes of the \d+"):
            b.load_state(state)
        after = (b.n_tokens, list(b.input_ids[: b.n_tokens]), b.kv_stats().tokens_seen, b.kv_stats().kv_cells)
        assert after == before


@pytest.mark.parametrize("layer_budgets", ["natural", "adaptive"])
def test_a_state_with_a_position_past_its_token_list_in_any_cache_is_refused(license_text, layer_budgets):
    """A crafted state: one cell's position in one of the per-layer caches moved past the token list. llama.cpp's
    seq_pos_max reads one cache, so such a state loaded where the cell was in another, and the next message failed in
    the policy's arrays (an IndexError: chat printed a traceback and quit). Refused now in every cache, naming the
    newest position, and the Llama goes on as before. The cell is found by its record in llama.cpp's state (its
    position, one sequence id, sequence 0), one per cache."""
    import struct

    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    kw = dict(kv_budget=96, kv_recent=8, kv_layer_budgets=layer_budgets, n_batch=32, n_ctx=512, verbose=False)
    model = str(fixture_path(FixtureSpec(arch="gemma3")))  # a sliding-window and a full-attention cache, at least
    with Llama(model, **kw) as a:
        a.eval(a.tokenize(license_text[:300].encode())[:60])
        state = a.save_state()
    saved = bytes(state.llama_state)
    record = struct.pack("<iIi", state.n_tokens - 3, 1, 0)  # a position every cache holds (the window is 24)
    records = [i for i in range(len(saved)) if saved.startswith(record, i)]
    with Llama(model, **kw) as b:
        assert len(records) == len(b.kv_engine.caches) >= 2
        b.eval(b.tokenize(license_text[400:700].encode())[:40])
        before = b.n_tokens
        for at in records:
            blob = bytearray(saved)
            struct.pack_into("<i", blob, at, 2000)
            state.llama_state = bytes(blob)
            with pytest.raises(ValueError, match=r"damaged: its cache holds positions up to 2000, its token list 60 "):
                b.load_state(state)
            assert b.n_tokens == before
        b.eval(b.tokenize(b" and then", add_bos=False))  # goes on (it failed in the policy's arrays)
        for g in b.kv_controller.groups:
            np.testing.assert_array_equal(g.live, g.read_live(b.kv_engine))


def test_generating_from_no_tokens_with_no_logits_is_refused():
    """``generate([], reset=False)`` samples the next token from the last decode's logits: right after a decode it
    continues the sequence, as llama_cpp.Llama does. A fresh Llama, or one that just loaded a state (llama.cpp's state
    holds no logits), has none: llama.cpp aborted the process (GGML_ASSERT, llama_cpp.Llama too). A ValueError now;
    after a decode it still continues. In a child process: the old code's abort would end the suite."""
    code = """
import sys
from ahakv_local import Llama
from ahakv_local.models import fixture_path
budget = None if sys.argv[1] == "none" else 64
a = Llama(str(fixture_path()), kv_budget=budget, n_ctx=512, verbose=False)
try:
    a.generate([], temp=0.0, reset=False).send(None)
    print("sampled")
except ValueError as e:
    print("fresh:", e)
a.eval(a.tokenize(b"The quick brown fox jumps over the lazy dog. " * 4))
state = a.save_state()
ref = [t for _, t in zip(range(4), a.generate([], temp=0.0, reset=False))]
a.load_state(state)
try:
    a.generate([], temp=0.0, reset=False).send(None)
    print("sampled")
except ValueError as e:
    print("loaded:", e)
print("after a decode:", ref)
"""
    for budget in ("none", "64"):
        proc = subprocess.run([sys.executable, "-c", code, budget], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-500:]
        lines = proc.stdout.splitlines()
        assert [line.split(":")[0] for line in lines[:2]] == ["fresh", "loaded"], proc.stdout
        assert all("no logits to sample from" in line for line in lines[:2])
        assert lines[2].startswith("after a decode: [") and len(lines[2].split(",")) == 4


def test_a_cache_type_or_token_id_llama_cpp_cannot_take_is_a_value_error():
    """type_k=99 and detokenize([10**7]) (or [-1]) aborted the process in llama.cpp, as they do under
    llama_cpp.Llama; a ggml type llama.cpp's tools offer for a cache still loads. In a child process: the old code's
    abort would end the suite."""
    code = """
from ahakv_local import Llama
from ahakv_local.models import fixture_path
for kw in ({"type_k": 99}, {"type_v": 4}):
    try:
        Llama(str(fixture_path()), verbose=False, **kw)
        print("loaded")
    except ValueError as e:
        print("refused:", e)
llm = Llama(str(fixture_path()), verbose=False, type_k=0, type_v=0)  # f32: a cache type llama.cpp offers
print("f32:", llm.n_vocab())
for ids in ([10**7], [5, -1]):
    try:
        llm.detokenize(ids)
        print("detokenized")
    except ValueError as e:
        print("refused:", e)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("refused: type_k must be a ggml type llama.cpp keeps a KV cache in: 0 (f32)")
    assert lines[0].endswith("not 99") and lines[1].endswith("not 4") and lines[2] == "f32: 312"
    assert lines[3:] == [
        "refused: token id 10000000 is outside the model's vocabulary of 312 tokens",
        "refused: token id -1 is outside the model's vocabulary of 312 tokens",
    ]


def test_sample_at_a_row_llama_cpp_does_not_hold_is_a_value_error():
    """sample(idx=0) after a three-token eval asked llama.cpp for logits it keeps for the last token only: it aborted
    the process (GGML_ASSERT, as under llama_cpp.Llama). In a child process: the old code's abort would end the
    suite."""
    code = """
from ahakv_local import Llama
from ahakv_local.models import fixture_path
for budget in (None, 64):
    llm = Llama(str(fixture_path()), kv_budget=budget, verbose=False)
    llm.eval([1, 5, 6])
    try:
        llm.sample(idx=0)
        print("sampled")
    except ValueError as e:
        print("refused:", e)
    print("last:", 0 <= llm.sample(idx=2, temp=0.0) < llm.n_vocab())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
    refused = "refused: sample(idx=0): llama.cpp holds the logits of the last token only (idx 2); open the Llama"
    assert [line[: len(refused)] for line in proc.stdout.splitlines()] == [refused, "last: True"] * 2


def test_a_stream_sends_the_text_the_completion_has_unstreamed(gemma_model):
    """llama-cpp-python 0.3.36 flushes what its stream held back token by token: a character split over tokens held
    back because it could begin a stop string came out as nothing (the answer lost its last hieroglyph); and after
    one byte that is no UTF-8 its stream sent nothing more and dropped every character after it (chat, generate and
    the one-at-a-time server stream through it). Each chunk's text is now made from every byte sampled so far: the
    chunks joined are the unstreamed text, for the same greedy completion, with and without a budget."""
    byte = 366  # Gemma's token of the lone byte 0x80: a UTF-8 continuation byte with nothing to continue

    def forced(ids, scores):  # the 4th sampled token is that byte (ids: the prompt and what was sampled)
        if len(ids) - forced.n_prompt == 3:
            scores = np.full_like(scores, -1e9)
            scores[byte] = 0
        return scores

    cases = [
        ("𓀀𓀁𓀂𓀃𓀄𓀅𓀆𓀇𓀈𓀉𓀊𓀋𓀌𓀍𓀎𓀏", {"max_tokens": 40, "stop": ["𓀏Z"]}),  # held back at the end: lost
        ("龘靐齉龘靐齉龘靐齉龘靐齉", {"max_tokens": 30, "logits_processor": llama_cpp.LogitsProcessorList([forced])}),
    ]
    for budget in (None, 40):
        with Llama(str(gemma_model), n_ctx=512, kv_budget=budget, verbose=False) as llm:
            assert llm.detokenize([byte]) == b"\x80"
            for prompt, kwargs in cases:
                forced.n_prompt = len(llm.tokenize(prompt.encode()))
                whole = llm.create_completion(prompt, temperature=0, **kwargs)["choices"][0]
                llm.reset()
                chunks = list(llm.create_completion(prompt, temperature=0, stream=True, **kwargs))
                assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"] != ""
                assert [c["choices"][0]["finish_reason"] for c in chunks[-1:]] == [whole["finish_reason"]]
                assert all(c["choices"][0]["text"] for c in chunks[:-1])  # (no empty pieces before the last)


def test_one_token_bringing_two_stop_strings_is_cut_at_the_first_in_the_text_streamed_or_not(fixture_model):
    """llama-cpp-python cuts an unstreamed completion at the first of its stop strings in the list's order, its
    stream (and the parallel server) at the first in the text: where one token brought both, the stream's pieces,
    joined, were not the completion's text. Both cut at the first in the text now."""
    with Llama(str(fixture_model), kv_budget=64, verbose=False) as llm:
        pieces = {t: llm.detokenize([t]).decode(errors="ignore") for t in range(llm.n_vocab())}
        token, piece = next((t, p) for t, p in pieces.items() if len(set(p)) >= 2)  # (" a" in the fixture's)
        first, later = piece[0], next(c for c in piece if c != piece[0])
        stop = [later, first]  # the later one listed first

        def forced(ids, scores):
            scores = np.full_like(scores, -1e9)
            scores[token] = 0
            return scores

        kwargs = {
            "max_tokens": 3,
            "temperature": 0,
            "stop": stop,
            "logits_processor": llama_cpp.LogitsProcessorList([forced]),
        }
        whole = llm.create_completion("hello", **kwargs)["choices"][0]
        llm.reset()
        streamed = "".join(c["choices"][0]["text"] for c in llm.create_completion("hello", stream=True, **kwargs))
        assert whole["text"] == streamed == "" and whole["finish_reason"] == "stop"


@pytest.mark.parametrize("budget", [None, 64])
def test_an_empty_stop_string_stops_at_once_streamed_or_not(gemma_model, budget):
    """An empty stop string is in every text: llama_cpp.Llama answers "" at once, streamed or not. The drop-in's
    stream left it out of the stops it cut by (as the servers do) and sent the first token's text before the stop
    (Gemma's ","; the fixture's first token is held back by upstream's stream, which hid it); unstreamed it said "",
    as upstream."""
    kwargs = {"max_tokens": 8, "temperature": 0}
    stock = llama_cpp.Llama(str(gemma_model), n_ctx=256, verbose=False)  # (no context manager in 0.3.36)
    try:
        for stop in ("", [""], ["zzz", ""]):
            assert stock.create_completion("hello", stop=stop, **kwargs)["choices"][0]["text"] == ""
    finally:
        stock.close()
    with Llama(str(gemma_model), n_ctx=256, kv_budget=budget, verbose=False) as llm:
        assert llm.create_completion("hello", **kwargs)["choices"][0]["text"] != ""  # (something to stop)
        for stop in ("", [""], ["zzz", ""]):
            whole = llm.create_completion("hello", stop=stop, **kwargs)["choices"][0]
            chunks = [c["choices"][0] for c in llm.create_completion("hello", stop=stop, stream=True, **kwargs)]
            assert (whole["text"], whole["finish_reason"]) == ("", "stop"), stop
            assert "".join(c["text"] for c in chunks) == "" and chunks[-1]["finish_reason"] == "stop", (stop, chunks)


def test_arguments_given_by_position_are_read_as_by_name(fixture_model):
    """The overrides read ``sample``'s ``idx`` and ``create_chat_completion``'s ``response_format`` by name alone:
    ``sample(..., idx)`` by position was a TypeError (llama_cpp.Llama takes it), and a json_schema format given by
    position skipped its translation (the answer came in prose, where by name it is refused for want of its
    "json_schema")."""
    import inspect

    def positional(method: str, **given) -> list:
        """upstream's defaults, in order, up to the last parameter ``given`` names, with ``given``'s values"""
        params = list(inspect.signature(getattr(llama_cpp.Llama, method)).parameters.values())[1:]
        last = max(i for i, p in enumerate(params) if p.name in given)
        return [given.get(p.name, p.default) for p in params[: last + 1]]

    with Llama(str(fixture_model), kv_budget=64, verbose=False) as llm:
        llm.eval([1, 5, 6])
        by_name = llm.sample(temp=0.0, idx=2)
        assert llm.sample(*positional("sample", temp=0.0, idx=2)) == by_name
        with pytest.raises(ValueError, match=r"sample\(idx=0\): llama.cpp holds the logits of the last token only"):
            llm.sample(*positional("sample", idx=0))
        messages = [{"role": "user", "content": "hello"}]
        fmt = {"type": "json_schema"}  # no "json_schema": refused, however given
        for args, kwargs in (
            ((), {"response_format": fmt}),
            (positional("create_chat_completion", response_format=fmt)[1:], {}),
        ):
            with pytest.raises(ValueError, match="response_format of type json_schema needs"):
                llm.create_chat_completion(messages, *args, max_tokens=2, **kwargs)


def test_under_a_budget_logprobs_are_refused_and_a_failed_decode_is_a_runtime_error_too(fixture_model):
    """logprobs under a budget got upstream's "not supported for models created with logits_all=False", whose advice
    a budget refuses; a failed llama_decode was an AhakvError (a ValueError) where llama_cpp.Llama raises a
    RuntimeError, which an app's ``except RuntimeError`` missed. The Llama answers as a fresh one afterwards."""
    with Llama(str(fixture_model), kv_budget=64, kv_query=False, verbose=False) as llm:
        with pytest.raises(ValueError, match="logprobs need every prompt token's logits .* without kv_budget"):
            llm.create_completion("the cat", max_tokens=2, logprobs=1)
        # a token id outside the vocabulary: refused before llama_decode, which failed on it ("llama_decode failed
        # with code -1"), by name, a RuntimeError still
        with pytest.raises(RuntimeError, match=r"cannot decode: token id 1000000 is outside the model's vocabulary"):
            llm.eval([1, 5, 10**6])
        llm.reset()
        again = llm("the cat", max_tokens=4, temperature=0)["choices"][0]["text"]
    with Llama(str(fixture_model), kv_budget=64, kv_query=False, verbose=False) as fresh:
        assert fresh("the cat", max_tokens=4, temperature=0)["choices"][0]["text"] == again


def test_a_pipe_as_the_model_path_is_refused_at_once(tmp_path):
    """The drop-in opened a named pipe given as its model and waited for a writer forever (the CLI checks first)."""
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    code = f"from ahakv_local import Llama; Llama({str(fifo)!r}, kv_budget=64, verbose=False)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"not a model file: {fifo} is a pipe or a device" in proc.stderr


@pytest.mark.parametrize("budget", [None, 64], ids=["no budget", "bounded"])
def test_a_pathlib_path_is_taken_as_the_model(fixture_model, budget):
    """``Llama(Path(...))`` (``models.default_model_path()`` returns one) stopped at an AttributeError on ``.encode``
    inside llama-cpp-python; it loads the model as its text does, and a path of another type is one TypeError."""
    with Llama(Path(fixture_model), kv_budget=budget, verbose=False) as llm:
        assert llm.model_path == str(fixture_model)
        by_path = llm("the cat", max_tokens=3, temperature=0)["choices"][0]["text"]
    with Llama(str(fixture_model), kv_budget=budget, verbose=False) as llm:
        assert llm("the cat", max_tokens=3, temperature=0)["choices"][0]["text"] == by_path
    with pytest.raises(TypeError, match="model_path must be a path"):
        Llama(42, kv_budget=budget, verbose=False)


@pytest.mark.parametrize("budget", [None, 64], ids=["no budget", "bounded"])
def test_numpy_s_whole_numbers_are_taken_as_upstream_takes_them(fixture_model, budget):
    """n_ctx=np.int64(512) (a size computed with numpy, read from a config) was refused, where llama_cpp.Llama takes
    it through ctypes; a bool or a float stays refused."""
    kw = dict(n_ctx=np.int64(512), n_batch=np.int32(64), n_ubatch=np.int64(32), n_threads=np.int64(1))
    with Llama(str(fixture_model), kv_budget=budget, verbose=False, **kw) as llm:
        assert llm.n_batch == 64 and llm.context_params.n_ubatch == 32 and llm.context_params.n_threads == 1
        assert llm("the cat", max_tokens=2, temperature=0)["usage"]["completion_tokens"] == 2
    for bad in (True, 512.0, "512"):
        with pytest.raises(ValueError, match="n_ctx must be 0"):
            Llama(str(fixture_model), n_ctx=bad, kv_budget=budget, verbose=False)


def test_a_draft_model_under_a_budget_is_refused_before_loading(fixture_model):
    """Speculative decoding samples a row of logits per draft token (upstream turns logits_all on for it): under a
    budget, llama.cpp aborted the process at the first draft ("invalid logits id -5")."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    with pytest.raises(ValueError, match=r"draft_model .* cannot be combined with kv_budget"):
        Llama(str(fixture_model), kv_budget=64, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4), verbose=False)
    with Llama(str(fixture_model), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4), verbose=False) as llm:
        assert llm("one two one two one two", max_tokens=4, temperature=0)["usage"]["completion_tokens"] == 4


def test_a_vocab_only_model_tokenizes_as_upstream(gemma_model):
    """``Llama(path, vocab_only=True)`` (a tokenizer alone, as apps load one) aborted the process: the engine view asked
    llama.cpp for the head count of a model without layers. It tokenizes as llama_cpp.Llama does; a budget, which
    needs the layers, is refused in one line."""
    text = "Hello world, a tokenizer alone: 𓀀 ünïcode"
    upstream_llm = llama_cpp.Llama(str(gemma_model), vocab_only=True, verbose=False)
    llm = Llama(str(gemma_model), vocab_only=True, verbose=False)
    try:
        tokens = llm.tokenize(text.encode())
        assert tokens == upstream_llm.tokenize(text.encode()) and len(tokens) > 5
        assert llm.detokenize(tokens).decode() == upstream_llm.detokenize(tokens).decode()
        with pytest.raises(ValueError, match="a vocab_only model has no layers and no KV cache"):
            llm.kv_stats()
        with pytest.raises(ValueError, match="a vocab_only model has no layers and no KV cache"):
            _ = llm.kv_laid_out_for  # (an AttributeError on None)
    finally:
        llm.close()
        upstream_llm.close()
    with pytest.raises(ValueError, match="vocab_only loads the tokenizer alone: a KV budget needs the model's layers"):
        Llama(str(gemma_model), vocab_only=True, kv_budget=256, verbose=False)


def test_a_reconstruction_asked_of_caches_without_its_room_is_refused(fixture_model):
    """A Llama opened for questions (its caches keep a question's room) and asked to reconstruct a prompt read most
    chunks plainly once the cache was full, without a word; a server refuses it as a 400. Refused here too, naming
    how to open a Llama that reconstructs (known answer: a chunk of 32 and a repetition of 32 tokens)."""
    with Llama(str(fixture_model), kv_budget=64, kv_recent=8, n_batch=32, verbose=False) as llm:
        with pytest.raises(AhakvError, match=r"kv_query 'reconstruct' decodes a repetition of 64 tokens beside each "):
            llm.create_completion("a prompt", max_tokens=1, kv_query="reconstruct")
        assert llm.create_completion("a prompt", max_tokens=1, kv_query="surprisal")["choices"]
    opened = dict(kv_budget=64, kv_recent=8, n_batch=32, kv_reuse_compressed=True, verbose=False)
    with Llama(str(fixture_model), **opened) as llm:
        assert llm.create_completion("a prompt", max_tokens=1, kv_query="reconstruct")["choices"]


@pytest.mark.parametrize("budget", [64, "25%", "auto"])
def test_an_exception_inside_a_prompt_piece_leaves_a_sequence_a_fresh_llama_would_have(fixture_model, budget):
    """A Ctrl-C (any exception) landing inside a piece of the prompt, after its compression ran: the engine had read
    the piece, evicted positions before it for it, and its token list had not moved. The same request then read on
    from that over-compressed cache and answered otherwise than a fresh Llama (7 of 30 retries, a hunt's random
    interrupts), and a state saved then did not load ("this state is damaged"). The sequence now starts over."""
    kw = dict(kv_budget=budget, n_batch=32, n_ctx=1024, kv_recent=8, verbose=False)
    prompt = "the quick brown fox jumps over the lazy dog and runs " * 40
    with Llama(str(fixture_model), **kw) as fresh:
        expected = fresh(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    with Llama(str(fixture_model), **kw) as llm:
        kv, evict, calls = llm.kv_controller, llm.kv_controller.evict, []

        def evict_then_interrupt(*args, **kwargs):
            n = evict(*args, **kwargs)
            calls.append(n)
            if len(calls) == 7:
                raise KeyboardInterrupt
            return n

        kv.evict = evict_then_interrupt
        with pytest.raises(KeyboardInterrupt):
            llm(prompt, max_tokens=8, temperature=0)
        kv.evict = evict
        assert llm.kv_engine.n_past == llm.n_tokens  # the engine ends where the token list does
        state = llm.save_state()
        with Llama(str(fixture_model), **kw) as other:
            other.load_state(state)  # (refused as damaged before)
        assert llm(prompt, max_tokens=8, temperature=0)["choices"][0]["text"] == expected


def test_a_second_thread_is_refused_while_one_decodes(fixture_model):
    """Two threads decoding with one Llama at once aborted the process or crashed it (as under llama_cpp.Llama). While
    one thread is inside a sampling step (held there by its logits processor), another's completion, eval, reset and
    save_state are each a RuntimeError, and the first answers as if alone; calls of several threads in turn (a stream
    consumed through a thread pool) work; close() waits for the running call. In a child process: the old code's
    crash would end the suite."""
    code = """
import threading
import numpy as np
from concurrent.futures import ThreadPoolExecutor
from ahakv_local import Llama
from ahakv_local.models import fixture_path
kw = dict(kv_budget=64, n_batch=32, kv_recent=8, verbose=False)
with Llama(str(fixture_path()), **kw) as fresh:
    expected = fresh("the cat sat on the mat", max_tokens=6, temperature=0)["choices"][0]["text"]
llm = Llama(str(fixture_path()), **kw)
inside, go = threading.Event(), threading.Event()
def hold(ids, logits):
    inside.set()
    go.wait(30)
    return logits
out = {}
t = threading.Thread(target=lambda: out.update(a=llm("the cat sat on the mat", max_tokens=6, temperature=0,
                                                      logits_processor=[hold])))
t.start()
assert inside.wait(30)
for name, call in [("completion", lambda: llm("a dog", max_tokens=2)), ("eval", lambda: llm.eval([1, 2])),
                   ("reset", llm.reset), ("save_state", llm.save_state)]:
    try:
        call()
        print(name, "ran")
    except RuntimeError as e:
        print(name, "refused" if "in use by another thread" in str(e) else repr(e))
go.set()
t.join(60)
print("alone", out["a"]["choices"][0]["text"] == expected)
stream = llm("the cat sat on the mat", max_tokens=6, temperature=0, stream=True)
with ThreadPoolExecutor(4) as pool:  # one next() per task, on whichever thread
    pieces = []
    while (piece := pool.submit(next, stream, None).result()) is not None:
        pieces.append(piece["choices"][0]["text"])
print("in turn", "".join(pieces) == expected)
# close() from another thread waits for the running call (it freed the context under its decode: a crash)
other = Llama(str(fixture_path()), **kw)
inside.clear()
go.clear()
t = threading.Thread(target=lambda: out.update(b=other("the cat sat on the mat", max_tokens=6, temperature=0,
                                                        logits_processor=[hold])))
t.start()
assert inside.wait(30)
closing = threading.Thread(target=other.close)
closing.start()
closing.join(0.5)
waited = closing.is_alive()
go.set()
t.join(60)
closing.join(60)
print("close waits", waited, out["b"]["choices"][0]["text"] == expected, not closing.is_alive())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split("\n")
    assert [f"{n} refused" for n in ("completion", "eval", "reset", "save_state")] == lines[:4], proc.stdout
    assert lines[4:7] == ["alone True", "in turn True", "close waits True True True"], proc.stdout


def test_a_reconstruction_with_a_policy_no_reading_guides_is_refused_in_its_own_words(fixture_model):
    """``Llama(kv_policy="h2o", kv_query="reconstruct")`` opened (caches without a repetition's room), and every call
    was refused with advice to open it with kv_query='reconstruct', as it had been. It is refused when it opens, as
    the CLI refuses --reading reconstruct with h2o, and so is a call's kv_query='reconstruct' on such a Llama."""
    with pytest.raises(
        AhakvError, match=r"^kv_query 'reconstruct' needs a policy a question can guide \(.*\), not h2o"
    ):
        Llama(str(fixture_model), kv_budget=64, kv_policy="h2o", kv_query="reconstruct", verbose=False)
    with Llama(str(fixture_model), kv_budget=64, kv_policy="h2o", verbose=False) as llm:
        with pytest.raises(AhakvError, match=r"needs a policy a question can guide .*, not h2o"):
            llm("the cat", max_tokens=2, kv_query="reconstruct")
        assert llm("the cat", max_tokens=2, kv_query="surprisal")["usage"]["completion_tokens"] >= 2  # (UTF-8 fix-up)


def test_a_byte_budget_its_caches_cannot_hold_names_the_cells_it_lays_out(gemma_model):
    """A server request's kv_budget of 8 MiB, below the 11.3 MiB a 512-cell server allocates, was refused as "budget
    8 MiB does not fit the 641 allocated cells", which read as a contradiction: laid out, those bytes hold more cells
    in a full-attention layer than 512 (the sliding layers are held at their window). The refusal names them."""
    from ahakv_local.budget import Budget

    with Llama(str(gemma_model), kv_budget=512, n_ctx=4096, n_batch=64, verbose=False) as llm:
        with pytest.raises(AhakvError) as refused:
            llm.kv_controller.check_budget(Budget.parse("8MiB"))
    m = re.fullmatch(
        r"budget 8 MiB \(laid out as (\d+) cells there\) does not fit the (\d+) allocated cells .*", str(refused.value)
    )
    assert m and int(m.group(1)) > 512 and int(m.group(2)) < int(m.group(1)), refused.value
