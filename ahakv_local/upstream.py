"""The upstream boundary: every use of llama-cpp-python's private names goes through this module.

ahakv-local builds on llama-cpp-python 0.3.36 (the sdist ``ahakv-local build`` patches). Its public
API (``llama_cpp.Llama``, the ``llama_cpp.llama_*`` C bindings) is used directly; what is private
(``_internals``, ``_lib``, the attributes of a ``Llama`` the drop-in reads and writes, the Jinja chat
formatter) is named here only, checked against the pinned version, and listed in ``PRIVATE_NAMES`` so
that a test fails on an upgrade that renames one, instead of a user meeting an AttributeError.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .errors import EngineNotPatched

PINNED_VERSION = "0.3.36"

# module -> private names used from it; "Llama." entries are attributes of an initialized instance
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "llama_cpp._internals": ("LlamaModel", "LlamaContext", "LlamaBatch"),
    "llama_cpp._logger": ("set_verbose", "logger"),
    "llama_cpp.llama_cpp": ("_lib",),
    "llama_cpp.llama": ("LlamaState",),
    "llama_cpp._ggml": ("libggml",),
    "llama_cpp.llama_chat_format": (
        "Jinja2ChatFormatter",
        "ChatFormatterResponse",
        "chat_formatter_to_chat_completion_handler",
    ),
}
LLAMA_ATTRIBUTES = (
    "_model", "_ctx", "_batch", "_stack", "tokenizer_", "context_params", "model_params",  # native handles
    "input_ids", "_input_ids", "scores", "n_tokens", "_n_ctx", "_requires_eval", "_seed", "_logits_all",  # the state
    "_create_completion",  # the generator create_completion wraps (its error text is rewritten)
)  # fmt: skip


def check_version() -> None:
    """Refuse another llama-cpp-python than the one the patches and these names were written for."""
    import llama_cpp

    if llama_cpp.__version__ != PINNED_VERSION:
        raise EngineNotPatched(
            f"llama-cpp-python {llama_cpp.__version__} is installed, ahakv-local needs {PINNED_VERSION}: "
            "run `ahakv-local build`"
        )


def missing_names() -> list[str]:
    """Private names this module relies on that the installed llama-cpp-python lacks (empty: all there)."""
    missing = []
    for module, names in PRIVATE_NAMES.items():
        mod = importlib.import_module(module)
        missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    return missing


def cdll():
    """The loaded libllama, where the patch series' ``llama_ahakv_*`` functions live."""
    import llama_cpp.llama_cpp

    return llama_cpp.llama_cpp._lib


def ggml_cdll():
    """The loaded libggml (the backend registry: RPC devices are made there)."""
    from llama_cpp import _ggml

    return _ggml.libggml


GPU_DEVICE_TYPES = (1, 2)  # enum ggml_backend_dev_type: GPU, IGPU (0 is the CPU, 3 an accelerator such as BLAS)


def gpu_devices() -> int:
    """How many GPUs (discrete or integrated) the engine registered: where -ngl puts layers without RPC workers.
    (llama_supports_gpu_offload says yes for any engine built with RPC, whose workers may be absent or CPUs.)"""
    ggml = ggml_cdll()
    count, get, kind = ggml.ggml_backend_dev_count, ggml.ggml_backend_dev_get, ggml.ggml_backend_dev_type
    count.argtypes, count.restype = [], ctypes.c_size_t
    get.argtypes, get.restype = [ctypes.c_size_t], ctypes.c_void_p
    kind.argtypes, kind.restype = [ctypes.c_void_p], ctypes.c_int
    return sum(kind(get(i)) in GPU_DEVICE_TYPES for i in range(count()))


def offload_target(rpc_servers: Sequence[str] = ()) -> bool:
    """Whether layers offloaded with n_gpu_layers leave the CPU: RPC workers are given, or the engine has a GPU."""
    return bool(rpc_servers) or gpu_devices() > 0


# Loading a model has process-wide effects in llama-cpp-python: ``verbose=False`` points file descriptors 1 and 2 at
# /dev/null for the load (``suppress_stdout_stderr``), and ``model_params_hook`` swaps a module attribute. Two loads
# overlapping in threads left /dev/null as the process's stdout and stderr for good, and one instance's hook (its
# settings, and the instance itself) installed for every later load. Every load of ours holds this lock.
LOADING = threading.RLock()


@contextlib.contextmanager
def model_params_hook(adjust: Callable[[Any], None]) -> Iterator[None]:
    """While active, every model ``llama_cpp.Llama`` loads passes its ``llama_model_params`` through ``adjust``
    first: upstream's constructor has no argument for ``devices`` or ``use_extra_bufts``. One load at a time
    (``LOADING``), the rest of the constructor's load included."""
    from llama_cpp import _internals

    with LOADING:
        original = _internals.LlamaModel

        def load(*, path_model: str, params, verbose: bool = True):
            adjust(params)
            return original(path_model=path_model, params=params, verbose=verbose)

        _internals.LlamaModel = load
        try:
            yield
        finally:
            _internals.LlamaModel = original


def set_verbose(verbose: bool) -> None:
    from llama_cpp import _logger

    _logger.set_verbose(verbose)
    _format_debug_lines(verbose)


# The vendored ggml numbers its log levels NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (ggml.h).
# llama-cpp-python 0.3.36's callback still maps an older numbering (INFO 1, WARN 2, ERROR 3, DEBUG 4), so with
# verbose=False every warning printed (each command's model probe said "using full-size SWA cache", which is
# not what the command allocates) and every error was hidden. This callback maps them as ggml means them and
# prints what llama-cpp-python's logger lets through (verbose: everything; otherwise errors), as upstream's does.
GGML_LOG_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
GGML_LOG_DEBUG, GGML_LOG_INFO = 1, 2
GGML_LOG_CONT = 5  # a continuation of the previous message, at its level
_last_log_level = logging.CRITICAL
_log_callback = None  # the ctypes callback: llama.cpp keeps only its address, so this keeps it alive
# llama-cpp-python's logger, bound with the callback: importing it in the callback failed when llama.cpp freed a
# model as the interpreter shut down (a Llama left open), and Python printed that failure's traceback
_llama_logger: logging.Logger | None = None


_said_by_caller = threading.local()  # ``failures_said_by_caller``: this thread's llama.cpp lines are muted


@contextlib.contextmanager
def failures_said_by_caller():
    """Mute llama.cpp's log in this thread for the block (unless verbose): its caller states a failure in one line of
    its own. A damaged saved state made llama.cpp print one or two lines of how its reading went wrong
    ("state_read_meta: invalid seq_id, -65536 is out of range") before the chat's own line."""
    _said_by_caller.on = True
    try:
        yield
    finally:
        _said_by_caller.on = False


def _print_ggml_log(level: int, text: bytes, _user_data) -> None:
    global _interrupt_lost
    try:
        _log(level, text)
    except KeyboardInterrupt:  # (raised as it enters, ctypes reports it: ``_keep_lost_interrupt``)
        _interrupt_lost = True


def _log(level: int, text: bytes) -> None:
    global _last_log_level
    if level != GGML_LOG_CONT:
        _last_log_level = GGML_LOG_LEVELS.get(level, logging.ERROR)
    if getattr(_said_by_caller, "on", False) and _llama_logger is not None and _llama_logger.level > logging.DEBUG:
        return
    if _llama_logger is not None and _llama_logger.level <= _last_log_level:  # upstream's test: set_verbose sets it
        with contextlib.suppress(Exception):  # at shutdown sys.stderr may be gone
            print(text.decode("utf-8", errors="replace"), end="", flush=True, file=sys.stderr)


# a KeyboardInterrupt Python raised inside ``_print_ggml_log`` (a Ctrl-C while llama.cpp logs, as it does all through a
# model's load), which ctypes drops: ``interrupts_kept`` raises it when the call into llama.cpp returns
_interrupt_lost = False
_unraisable_hook = None  # the hook ``_keep_lost_interrupt`` passes everything else to


def _keep_lost_interrupt(unraisable) -> None:
    global _interrupt_lost
    # the callback is the report's object up to Python 3.12; from 3.13 it is named in its message only
    ours = unraisable.object is _print_ggml_log or _print_ggml_log.__name__ in (unraisable.err_msg or "")
    if unraisable.exc_type is KeyboardInterrupt and ours:
        _interrupt_lost = True
    elif _unraisable_hook is not None:
        _unraisable_hook(unraisable)


@contextlib.contextmanager
def interrupts_kept():
    """Raise at the end of the block a Ctrl-C that came while llama.cpp called back into Python to log: ctypes drops an
    exception raised in a callback, so a model went on loading and ``serve`` and ``chat`` ignored a Ctrl-C given
    while they loaded (they ran on, answering)."""
    global _interrupt_lost
    _interrupt_lost = False  # (one lost outside such a block, in a decode's log line, is not raised later here)
    yield
    if _interrupt_lost:
        _interrupt_lost = False
        raise KeyboardInterrupt


def use_ggml_log_levels() -> None:
    """Route llama.cpp's log through ``_print_ggml_log`` (once): from ``native.lib()``, which every command and
    every Engine binds first, and from the Llama drop-in's load, which may come before it."""
    global _log_callback, _llama_logger, _unraisable_hook
    if _log_callback is None:
        import llama_cpp
        from llama_cpp import _logger

        _unraisable_hook, sys.unraisablehook = sys.unraisablehook, _keep_lost_interrupt
        _llama_logger = _logger.logger
        _log_callback = llama_cpp.llama_log_callback(_print_ggml_log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        _format_debug_lines(_logger.logger.level <= logging.DEBUG)


def _format_debug_lines(verbose: bool) -> None:
    """Whether llama.cpp formats its debug lines at all (patch 0024): only for a verbose caller, since otherwise
    ``_print_ggml_log`` prints none, and a context with one cache per layer logs 1,345 of them as it is made, each
    formatted and passed into Python (benchmarks/context_log_lines.py). Info and above are formatted as before: a
    plain ``llama_cpp.Llama(verbose=True)`` in the same process, whose verbosity this module does not see, still
    prints those. (An unpatched library has no such switch; ``native.lib`` refuses it.)"""
    lib = cdll()
    if hasattr(lib, "llama_ahakv_set_log_level"):
        lib.llama_ahakv_set_log_level(GGML_LOG_DEBUG if verbose else GGML_LOG_INFO)


def load_model(path: str, params, verbose: bool):
    """A ``LlamaModel`` owning the native model (ValueError if llama.cpp cannot load it)."""
    from llama_cpp import _internals

    with LOADING, interrupts_kept():
        return _internals.LlamaModel(path_model=path, params=params, verbose=verbose)


def new_context(model, params, verbose: bool):
    """A ``LlamaContext`` (ValueError if llama.cpp cannot create it)."""
    from llama_cpp import _internals

    with interrupts_kept():
        return _internals.LlamaContext(model=model, params=params, verbose=verbose)


def new_batch(n_tokens: int, verbose: bool):
    from llama_cpp import _internals

    return _internals.LlamaBatch(n_tokens=n_tokens, embd=0, n_seq_max=1, verbose=verbose)


def bound_arguments(method: str, *args, **kwargs) -> inspect.BoundArguments:
    """``args`` and ``kwargs`` bound to ``llama_cpp.Llama.<method>``'s parameters (``self`` a placeholder): what an
    override reads by name (``arguments.get(name)``: None where the caller left it out), however the caller passed
    it (``response_format`` given by position skipped its translation, ``sample``'s ``idx`` by position was a
    TypeError). Upstream's TypeError for a call it would refuse."""
    return _signature(method).bind(None, *args, **kwargs)


@functools.cache
def _signature(method: str) -> inspect.Signature:
    """(once per method: ``sample`` binds at every sampled token, ~50 us a signature)"""
    import llama_cpp

    return inspect.signature(getattr(llama_cpp.Llama, method))


def call_bound(f: Callable, bound: inspect.BoundArguments) -> Any:
    """``f`` (a bound method) called with ``bound``'s arguments, ``self`` left out."""
    return f(*bound.args[1:], **bound.kwargs)


def handles(llm) -> tuple[Any, Any, Any]:
    """(model, context, batch) of a ``llama_cpp.Llama``, which keeps owning them."""
    return llm._model, llm._ctx, llm._batch


def replace_context(llm, ctx) -> None:
    """Make ``ctx`` (a ``LlamaContext`` of the same model) the context every later call of ``llm`` uses; the
    model frees it when it closes, as it does the context upstream made (``LlamaContext`` registers itself)."""
    llm._ctx = ctx


def free_context(ctx) -> None:
    """Free a ``LlamaContext`` now and drop its model's hold on it: each context registers its ``close`` on its
    model's exit stack, which kept every context a resize replaced (freed in llama.cpp, alive in Python, 800 after
    400 state loads of other sizes) until the model closed."""
    ctx.close()
    callbacks = ctx.model._exit_stack._exit_callbacks  # (is_sync, wrapper of the callback) pairs, in order
    for entry in [e for e in callbacks if getattr(e[1], "__wrapped__", None) == ctx.close]:
        callbacks.remove(entry)


def replace_handles(llm, stand_in) -> None:
    """After ``close()``: put ``stand_in`` where every later call would find a freed native pointer."""
    llm._model = llm._ctx = llm._batch = llm.tokenizer_ = stand_in


def is_initialized(llm) -> bool:
    """Whether upstream's __init__ got as far as owning native resources (close() needs them)."""
    return hasattr(llm, "_stack")


def make_state(input_ids, scores, n_tokens: int, llama_state: bytes, seed: int):
    from llama_cpp.llama import LlamaState

    return LlamaState(
        input_ids=input_ids,
        scores=scores,
        n_tokens=n_tokens,
        llama_state=llama_state,
        llama_state_size=len(llama_state),
        seed=seed,
    )


def chat_prompt_tokens(llm, messages: list[dict], generation_prompt: bool = True) -> list[int]:
    """The tokens ``create_chat_completion`` decodes for ``messages`` (``chat_prompt``)."""
    return chat_prompt(llm._model, messages, generation_prompt)[0]


# Where a GGUF has no chat template (the embedded Gemma 3 270M, a base model, has none), llama-cpp-python falls back
# to Llama 2's "[INST] <<SYS>>" format, whose markers that model echoes back, and Gemma's turn format makes it repeat
# the question; as a base model it continues a plain transcript. So ahakv-local's Llama renders a template-less
# model's chat as one (``use_transcript_without_template``), and ``chat_prompt`` renders it alike: chat's pinned
# system prompt, its /read and the parallel server decode exactly what create_chat_completion does.
TRANSCRIPT_ROLES = {"user": "User", "assistant": "Assistant"}
TRANSCRIPT_STOP = ("\nUser:", "\nAssistant:")  # a base model goes on to write the next turns itself


def message_text(content) -> str:
    """The text of a chat message's content: a string as it is, or the text of OpenAI's content parts joined as the
    chat templates render them, with nothing between (the parts without text, an image's, add nothing)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def transcript(messages: list[dict], generation_prompt: bool = True, **_):
    """A chat as a transcript: the system prompt as the first paragraph, then "User: ..." and "Assistant: ..."
    lines, ending in "Assistant:" for the model to continue (a reply's own leading space is kept as it came)."""
    from llama_cpp.llama_chat_format import ChatFormatterResponse

    lines = []
    for m in messages:
        content = message_text(m.get("content"))
        if m.get("role") == "system":
            lines.append(f"{content}\n")
            continue
        role = TRANSCRIPT_ROLES.get(m.get("role", ""), str(m.get("role", "")).capitalize())
        lines.append(f"{role}:{content}" if content[:1].isspace() else f"{role}: {content}")
    if generation_prompt:
        lines.append("Assistant:")
    return ChatFormatterResponse(prompt="\n".join(lines), stop=list(TRANSCRIPT_STOP))


def has_chat_template(metadata: dict) -> bool:
    """Whether llama-cpp-python renders a chat with the GGUF's own template (its rule: the key is there)."""
    return "tokenizer.chat_template" in metadata


TRANSCRIPT = "ahakv-transcript"  # the chat format of a model without a chat template


def use_transcript_without_template(llm, kwargs: dict) -> None:
    """After llama_cpp.Llama's constructor: a model without a chat template chats as a transcript, unless the
    caller chose a chat format or handler."""
    if has_chat_template(llm.metadata) or kwargs.get("chat_format") or kwargs.get("chat_handler"):
        return
    from llama_cpp.llama_chat_format import chat_formatter_to_chat_completion_handler

    llm.chat_format = TRANSCRIPT
    llm.chat_handler = chat_formatter_to_chat_completion_handler(transcript)


def chat_prompt(model, messages: list[dict], generation_prompt: bool = True) -> tuple[list[int], list[str]]:
    """(the tokens, the stop strings) of ``messages`` for a llama-cpp-python model handle (``_internals``), as
    ``create_chat_completion`` builds them: the GGUF's chat template, or the transcript where it has none.
    Without ``generation_prompt``: the conversation as it stands (a document put into it ends with the
    assistant's turn, which the next message's rendering extends)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    metadata = model.metadata()
    if has_chat_template(metadata):
        template = metadata["tokenizer.chat_template"]
        bos = model.token_get_text(model.token_bos())
        eos = model.token_get_text(model.token_eos())
        formatter = Jinja2ChatFormatter(template, eos, bos, add_generation_prompt=generation_prompt)
        result = formatter(messages=messages)
    else:
        result = transcript(messages, generation_prompt)
    tokens = model.tokenize(result.prompt.encode(), not result.added_special, True)
    stop = [result.stop] if isinstance(result.stop, str) else result.stop or []
    return tokens, [s for s in stop if s]


def set_position_bound(llm, n_positions: int) -> None:
    """Make ``n_positions`` the bound llama-cpp-python checks prompts and completions against, and size its
    per-position token array to it (upstream sizes it by the requested n_ctx, which llama.cpp pads)."""
    import numpy as np

    llm._n_ctx = n_positions
    if llm.input_ids.size < n_positions:
        grown = np.zeros(n_positions, dtype=np.intc)
        grown[: llm.input_ids.size] = llm.input_ids
        llm.input_ids = grown


def restore_positions(llm, input_ids, n_tokens: int, seed: int, scores) -> None:
    """Upstream's bookkeeping after a state load: the tokens the cache holds, the last rows of logits
    that were saved (a saved chat keeps none: the next decode makes them), and the sampler's seed."""
    rows = min(n_tokens, scores.shape[0])
    if rows:
        llm.scores[:rows] = scores[-rows:]
    llm.input_ids = input_ids
    llm.n_tokens = n_tokens
    llm._requires_eval = True
    llm._seed = seed
