"""The upstream boundary: the private llama-cpp-python names ahakv-local relies on exist in the pinned
version, and another version is refused with one line."""

from __future__ import annotations

import subprocess
import sys

import llama_cpp
import pytest

from ahakv_local import Llama, upstream
from ahakv_local.errors import EngineNotPatched


def test_the_pinned_version_is_installed():
    assert llama_cpp.__version__ == upstream.PINNED_VERSION
    upstream.check_version()


def test_every_private_name_exists():
    assert upstream.missing_names() == []


@pytest.mark.parametrize("budget", [None, 64])
def test_every_llama_attribute_the_drop_in_uses_exists(fixture_model, budget):
    with Llama(str(fixture_model), n_ctx=256, n_batch=64, kv_budget=budget, verbose=False) as llm:
        missing = [name for name in upstream.LLAMA_ATTRIBUTES if not hasattr(llm, name)]
        assert missing == []
        model, ctx, batch = upstream.handles(llm)
        assert model.model is not None and ctx.ctx is not None and batch.batch is not None


def test_another_version_is_refused(monkeypatch):
    monkeypatch.setattr(llama_cpp, "__version__", "0.3.99")
    with pytest.raises(EngineNotPatched, match=r"llama-cpp-python 0\.3\.99 is installed, ahakv-local needs 0\.3\.36"):
        upstream.check_version()


def test_transcript_renders_a_chat_for_a_model_without_a_template():
    """Known answer: the system prompt as a paragraph, one line per turn, a reply's own leading space kept (so the
    next turn's rendering extends what was decoded), OpenAI's list of parts read as its text."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": " Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    result = upstream.transcript(messages)
    assert result.prompt == "Be brief.\n\nUser: Hi there\nAssistant: Hello.\nUser: Name a colour.\nAssistant:"
    assert result.stop == ["\nUser:", "\nAssistant:"]


@pytest.mark.parametrize("budget", [None, 64])
def test_a_chat_decodes_what_chat_prompt_renders(fixture_model, budget):
    """chat's pinned system prompt, its /read and the parallel server render a conversation with
    ``upstream.chat_prompt``: create_chat_completion must decode exactly those tokens (the fixture has no chat
    template, like the embedded default: before, it decoded llama-cpp-python's Llama 2 fallback instead)."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": " Hello."},
        {"role": "user", "content": "Name a colour."},
    ]
    with Llama(str(fixture_model), n_ctx=256, n_batch=64, kv_budget=budget, verbose=False) as llm:
        tokens, stop = upstream.chat_prompt(llm._model, messages)
        assert tokens == llm.tokenize(upstream.transcript(messages).prompt.encode(), True, True)
        llm.create_chat_completion(messages, max_tokens=1, temperature=0)
        assert list(llm.input_ids[: len(tokens)]) == tokens and stop == ["\nUser:", "\nAssistant:"]
    with Llama(str(fixture_model), n_ctx=256, chat_format="chatml", verbose=False) as llm:
        assert llm.chat_format == "chatml" and llm.chat_handler is None  # the caller's choice wins


def test_llama_cpp_log_follows_ggmls_own_levels(capsys):
    """The vendored ggml numbers its levels DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (ggml.h); llama-cpp-python
    0.3.36 maps an older numbering and so printed warnings and hid errors when not verbose. Known answer: not
    verbose, an error and its continuation print and nothing else; verbose, everything in order."""
    from llama_cpp import _logger

    upstream.use_ggml_log_levels()
    level = _logger.logger.level
    log = [(1, b"debug\n"), (2, b"info\n"), (3, b"warn "), (5, b"more warn\n"), (4, b"error "), (5, b"more error\n")]
    try:
        for verbose, printed in (
            (False, "error more error\n"),
            (True, "debug\ninfo\nwarn more warn\nerror more error\n"),
        ):
            upstream.set_verbose(verbose)
            capsys.readouterr()
            for lvl, text in log:
                upstream._log_callback(lvl, text, None)
            assert capsys.readouterr().err == printed
    finally:
        _logger.logger.setLevel(level)


def test_debug_lines_are_formatted_only_for_a_verbose_caller(fixture_model):
    """Patch 0024: not verbose, llama.cpp drops its debug lines before formatting them (the callback would print
    none; a context with a cache per layer logs ~1,340 as it is made); verbose, they reach the callback as before,
    and info lines reach it either way. Known answer: a counting callback sees no debug line from a quiet context
    and some from a verbose one, and info lines from both."""
    from llama_cpp import _logger

    from ahakv_local.engine import Engine, EngineConfig

    upstream.use_ggml_log_levels()
    level = _logger.logger.level
    seen: list[int] = []
    counting = llama_cpp.llama_log_callback(lambda lvl, _text, _data: seen.append(lvl))
    llama_cpp.llama_log_set(counting, None)
    try:
        by_level = {}
        for verbose in (False, True):
            seen.clear()
            with Engine(fixture_model, EngineConfig(n_ctx=256, verbose=verbose)):
                pass
            by_level[verbose] = {lvl: seen.count(lvl) for lvl in (upstream.GGML_LOG_DEBUG, upstream.GGML_LOG_INFO)}
        assert by_level[False][upstream.GGML_LOG_DEBUG] == 0 and by_level[True][upstream.GGML_LOG_DEBUG] > 0
        assert by_level[False][upstream.GGML_LOG_INFO] > 0 and by_level[True][upstream.GGML_LOG_INFO] > 0
    finally:
        llama_cpp.llama_log_set(upstream._log_callback, None)
        upstream.set_verbose(False)
        _logger.logger.setLevel(level)


def test_a_quiet_model_says_nothing_on_stderr(gemma_model, capfd):
    """The embedded model read under a budget, not verbose: llama.cpp's warnings (the model probe's full-size
    sliding-window cache among them) stay quiet, and the Llama drop-in's own load too."""
    capfd.readouterr()
    with Llama(str(gemma_model), n_ctx=1024, kv_budget=512, verbose=False) as llm:
        llm.create_completion("The GPL is", max_tokens=2)
    assert capfd.readouterr().err == ""


def test_a_replaced_context_is_let_go_by_its_model(fixture_model):
    """Each LlamaContext registers its close on its model's exit stack: a context an adaptive resize replaced stayed
    alive there until the model closed (800 after 400 state loads of other sizes). The stack keeps one entry per
    live context, and the replaced context is freed (``free_context``)."""
    import gc
    import weakref

    from ahakv_local.fixture import FixtureSpec
    from ahakv_local.models import fixture_path

    path = fixture_path(FixtureSpec(arch="gemma3", n_layer=6))
    with Llama(str(path), kv_budget=64, n_ctx=512, n_batch=32, verbose=False) as llm:
        model, ctx, _ = upstream.handles(llm)
        before = len(model._exit_stack._exit_callbacks)
        replaced = []
        for sizes in [(70, 40, 40, 70, 40, 70), (80, 45, 45, 80, 45, 80), llm.kv_engine.cache_sizes()]:
            replaced.append(weakref.ref(upstream.handles(llm)[1]))
            llm.kv_engine.resize_caches(sizes)
            assert llm.kv_engine.cache_sizes() == sizes
        gc.collect()
        assert len(model._exit_stack._exit_callbacks) == before
        assert all(r() is None or r().ctx is None for r in replaced) and upstream.handles(llm)[1].ctx is not None
        # the first was upstream's own, which its Llama holds until it closes (one, not one per resize); nothing
        # holds those the engine made
        assert all(r() is None for r in replaced[1:])


def test_the_drop_in_s_call_is_its_create_completion_as_upstream_s_is():
    """``Llama.__call__`` hands its arguments to ``create_completion`` as they come (with ``kv_query``): right only
    while upstream's two take the same parameters, in the same order, with the same defaults."""
    import inspect

    called = inspect.signature(llama_cpp.Llama.__call__).parameters
    completion = inspect.signature(llama_cpp.Llama.create_completion).parameters
    assert [(p.name, p.default, p.kind) for p in called.values()] == [
        (p.name, p.default, p.kind) for p in completion.values()
    ]


def test_a_ctrl_c_while_llama_cpp_logs_interrupts_the_load(fixture_model):
    """Python raises a Ctrl-C at its next bytecode, which during a model's load is in llama.cpp's log callback; ctypes
    drops an exception raised there ("Exception ignored on calling ctypes callback function", hidden by the quiet
    load), so the load went on and `serve` and `chat` ignored a Ctrl-C given while they loaded. Here the first line
    llama.cpp logs comes with a SIGINT (deterministic, unlike a timed signal): the drop-in's load and an engine's each
    end in KeyboardInterrupt. In a child process: the interrupt is the process's."""
    script = f"""
import signal, sys
from ahakv_local import Llama
from ahakv_local.engine import Engine, EngineConfig

class Tripwire:
    def __init__(self, real):
        self.real, self.armed = real, True
    def write(self, s):
        if self.armed:
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return self.real.write(s)
    def flush(self):
        self.real.flush()

# (Python takes no SIGINT where the parent ignores it, as a shell does for a command it runs in the background)
signal.signal(signal.SIGINT, signal.default_int_handler)
path = {str(fixture_model)!r}
for name, load in (("drop-in", lambda: Llama(path, n_ctx=64, verbose=True)),
                   ("engine", lambda: Engine(path, EngineConfig(n_ctx=64, verbose=True)))):
    sys.stderr = Tripwire(sys.__stderr__)  # (verbose: llama.cpp's lines go through it)
    try:
        load()
        print(name, "loaded")
    except KeyboardInterrupt:
        print(name, "interrupted")
    finally:
        sys.stderr = sys.__stderr__
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["drop-in interrupted", "engine interrupted"]
