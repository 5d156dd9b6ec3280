"""``ahakv-local``: build the patched engine, fetch models, run a generation.

User mistakes end in one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

import click
from click.core import ParameterSource

from . import __version__
from .budget import DEFAULT_LAYER_BUDGETS, KV_TYPE_AUTO, LAYER_BUDGETS, kv_query_of
from .cli_options import (
    Count,
    FiniteRange,
    Positive,
    evict_every_option,
    gpu_layers,
    kv_type_option,
    n_gpu_layers_default,
    observe_steps_option,
    offloads_by_default,
    parse_rpc,
    policy_option,
    reading_option,
    recent_option,
    rpc_option,
    sinks_option,
    threads_option,
)
from .errors import AhakvError
from .extras import require
from .native import BUILD_HINT, MAX_THREADS
from .textfile import read_stream, read_text, typed_text

ROOMS = {"query": "a question's room", "reconstruct": "a reconstruction pass's room"}  # what info says a reading holds
BUDGETED_BATCH = 64  # prompt tokens per decode call under a budget: the cache stays within one chunk of it


class Group(click.Group):
    """Turns AhakvError (and an engine not installed yet) into ``error: ...`` and exit code 1, a bad option into one
    line and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AhakvError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except click.UsageError as exc:  # a bad option value: one line too, not click's usage block
            hint = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            click.echo(f"error: {exc.format_message()}{hint}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:  # on a line of its own in a terminal (an answer or a progress bar may be open there)
            click.echo("\ninterrupted" if sys.stderr.isatty() else "interrupted", err=True)
            sys.exit(130)
        except ModuleNotFoundError as exc:  # a command importing the engine's bindings (chat, serve, eval) before build
            if (exc.name or "").partition(".")[0] != "llama_cpp":
                raise
            click.echo(f"error: llama-cpp-python is not installed; {BUILD_HINT}", err=True)
            sys.exit(1)

    def main(self, *args, **kwargs):
        try:  # (around click's own main: --help and --version write to standard output before any command runs)
            return super().main(*args, **kwargs)
        except OSError as exc:  # a full disk, a folder that cannot be written, stdout on /dev/full: the machine's
            if isinstance(exc, BrokenPipeError):  # (a closed pipe: a quiet exit 1, as click's own)
                sys.exit(1)
            click.echo(f"error: {os_error_text(exc)}", err=True)
            sys.exit(1)


def os_error_text(exc: OSError) -> str:
    """What failed, in one line: the file and the reason where the error names it; a write to a file already open (a
    results file, standard output on /dev/full) names none. Standard output that cannot take what is still buffered
    is given up: Python's own last flush at exit would print the error again, as an "Exception ignored" block."""
    try:
        sys.stdout.flush()
    except OSError:
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {reason}"
    return f"cannot write: {reason}" if exc.errno in WRITE_ERRORS else reason


WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


@click.group(cls=Group)
@click.version_option(__version__, prog_name="ahakv-local")
def main() -> None:
    """Long conversations and documents through local GGUF models with a bounded KV cache."""


@main.command()
@click.option("--cuda", is_flag=True, help="Build the CUDA backend (-DGGML_CUDA=ON).")
@click.option("--metal", is_flag=True, help="Build the Metal backend (-DGGML_METAL=ON).")
@click.option("--vulkan", is_flag=True, help="Build the Vulkan backend (-DGGML_VULKAN=ON).")
@click.option("--cmake-args", default="", metavar="ARGS", help="Extra CMake arguments (also read from $CMAKE_ARGS).")
@click.option("--rpc", is_flag=True, help="Add llama.cpp's RPC backend and its worker (-DGGML_RPC=ON; see rpc-server).")
@click.option("--force", is_flag=True, help="Rebuild even if a matching engine is installed or cached.")
def build(cuda: bool, metal: bool, vulkan: bool, cmake_args: str, rpc: bool, force: bool) -> None:
    """Download llama-cpp-python 0.3.36, apply patches/, compile and install it."""
    from .build import ensure_engine

    click.echo(ensure_engine(cuda=cuda, metal=metal, vulkan=vulkan, cmake_args=cmake_args, force=force, rpc=rpc))


@main.command("rpc-server")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (trusted networks only).")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option(
    "-t",
    "--threads",
    type=click.IntRange(1, MAX_THREADS),  # ggml's most: -t 100000 crashed the worker (and aborted its client)
    default=None,
    envvar="AHAKV_THREADS",
    help="CPU threads (default: AHAKV_THREADS, else cores / 2).",
)
def rpc_server(host: str, port: int, threads: int | None) -> None:
    """Run a llama.cpp RPC worker from this engine's build (`build --rpc`) for `--rpc HOST:PORT` clients.

    The protocol is unauthenticated and unencrypted: anyone who reaches the port can use the worker."""
    from .rpc import serve

    serve(host, port, threads)


@main.command("model-path")
@click.argument("model", required=False, envvar="AHAKV_MODEL")
def model_path(model: str | None) -> None:
    """Print the GGUF path of MODEL (default: the embedded Gemma 3 270M; 'fixture': the test model)."""
    from .models import resolve_model

    click.echo(resolve_model(model, progress=True))


def check_query_reading(engine: dict) -> None:
    """--query guides the reading of a prompt longer than the budget: refused where nothing would read it (no budget,
    another reading, a policy without a question score)."""
    from .policies import make_policy, query_readers

    if engine["reading"] != "query":
        raise AhakvError(f"--query guides a reading; it cannot be combined with --reading {engine['reading']}")
    if asked_budget(engine["budget"], engine["policy"]) is None:  # (none, or none but AHAKV_BUDGET's)
        raise AhakvError("--query guides the reading of a prompt longer than the budget: give a --budget too")
    if engine["batch_size"] == 1:
        raise AhakvError("--query guides a prompt read in chunks: --batch-size 1 reads it a token at a time")
    if not make_policy(engine["policy"]).reads_with_query:  # (an unknown name: refused by make_policy)
        readers = query_readers()
        raise AhakvError(f"--query needs a policy that reads with a question ({readers}), not {engine['policy']}")


def engine_options(f):
    """Options shared by the commands that load a model (llama.cpp's names, mirrored by AHAKV_* variables)."""
    options = [
        click.option(
            "-c",
            "--ctx-size",
            type=Count,
            default=4096,
            show_default=True,
            envvar="AHAKV_CTX_SIZE",
            help="Context size without a budget; with a ratio or auto budget, the KV cells to allocate.",
        ),
        click.option(
            "-b",
            "--budget",
            default=None,
            envvar="AHAKV_BUDGET",
            help="KV budget: cells of a full-attention layer (512), a ratio of the tokens seen (0.25 or 25%), "
            "auto, allocated KV bytes over every layer (16MiB), or none (over AHAKV_BUDGET: the full cache). "
            "Default: chat 1024, the others none.",
        ),
        click.option(
            "--layer-budgets",
            type=click.Choice(LAYER_BUDGETS),
            default=None,
            envvar="AHAKV_LAYER_BUDGETS",
            help=f"How the budget is laid out on the layers [default: {DEFAULT_LAYER_BUDGETS} on a model with "
            "sliding-window and full-attention layers run on the CPU, else natural; serve --parallel: shared]: "
            "shared, one pool for "
            "every layer; natural, one group per KV cache (sliding-window models: the sliding layers keep their "
            "window, the full-attention layers the rest); uniform, pyramid and adaptive, one KV cache per layer, each "
            "layer keeping its own tokens (pyramid: lower layers keep more, as PyramidKV; adaptive: layers whose "
            "attention spreads wider keep more, re-decided every 256 tokens).",
        ),
        policy_option,
        sinks_option,
        recent_option,
        click.option(
            "--error-tol",
            type=FiniteRange(min=0, min_open=True, max=1),
            default=0.05,
            show_default=True,
            envvar="AHAKV_ERROR_TOL",
            help="Auto budget: tolerated predicted relative output change.",
        ),
        evict_every_option(),
        observe_steps_option("Steps before each eviction whose full statistics the policy reads (0 = every step)."),
        threads_option,
        n_gpu_layers_default,
        rpc_option,
        batch_size_option,
        kv_type_option,
        reading_option,
    ]
    for option in reversed(options):
        f = option(f)
    return f


batch_size_option = click.option(
    "--batch-size",
    type=Positive,
    default=None,
    help="Prompt tokens per decode call (default: 64 with a budget, to keep the cells near it; 512).",
)


def refuse_guide_token_by_token(reading: str, batch_size: int | None) -> None:
    """Refuse a --reading given for a prompt read a token at a time: that is decode steps, which no question or
    reconstruction guides (it was ignored)."""
    if batch_size == 1 and reading != "plain" and given("reading"):
        raise AhakvError(f"--reading {reading} guides a prompt read in chunks: --batch-size 1 reads a token at a time")


def check_model(path, batch_size: int | None) -> None:
    """One-line errors before llama.cpp reads the model: an unsupported architecture, a batch past the trained context
    (llama-cpp-python holds batch x vocabulary logits: Gemma 3's --batch-size 100000 asked for 97.7 GiB)."""
    from .info import read_info

    trained = read_info(path).n_ctx_train  # (a file cut short: the engine and the drop-in refuse it before loading)
    if batch_size is not None and batch_size > trained:
        raise AhakvError(f"--batch-size {batch_size} is more than the model's trained context ({trained} tokens)")


def argument_text(text: str, option: str) -> str:
    """An option's text as UTF-8, or one line of error (a shell passes any bytes; Python escapes what is not UTF-8)."""
    return typed_text(text, f"the text of {option}")


def source(option: str) -> ParameterSource | None:
    """Where the running command's ``option`` came from: the command line, the environment, its default."""
    ctx = click.get_current_context(silent=True)
    return ctx.get_parameter_source(option) if ctx is not None else None


def given(option: str) -> bool:
    """Whether the command line or the environment set ``option`` (not its default)."""
    return source(option) not in (None, ParameterSource.DEFAULT)


def means_none(budget: str) -> bool:
    """Whether --budget's text asks for no budget (``none``: over AHAKV_BUDGET, the full cache)."""
    return budget.strip().lower() == "none"


def asked_budget(budget: str | None, policy: str) -> str | None:
    """--budget as the command runs with it: ``none`` is no budget, and so is one AHAKV_BUDGET set (or a command's
    default budget) where the command line asks for --policy full (which keeps every token): an environment's budget
    had no way out but unsetting it."""
    if budget is not None and means_none(budget):
        return None
    if policy == "full" and source("budget") in (ParameterSource.ENVIRONMENT, ParameterSource.DEFAULT):
        return None  # (info's default of 512 too: `info --policy full` was refused for a budget nobody gave)
    return budget


# the options of a bounded cache: without a budget every token is kept and none of them does anything
BOUNDED_ONLY = ("policy", "layer_budgets", "sinks", "recent", "error_tol", "evict_every", "observe_steps", "reading")


def refuse_unbounded_options(policy: str) -> None:
    """Refuse an option of the bounded cache given on the command line where the command runs without a budget: it was
    ignored without a word (``generate --policy h2o`` kept every token). The environment's (AHAKV_*) and the defaults
    stay quiet: they are set for every command."""
    for name in BOUNDED_ONLY:
        if source(name) is ParameterSource.COMMANDLINE and not (name == "policy" and policy == "full"):
            raise AhakvError(
                f"--{name.replace('_', '-')} applies to a bounded KV cache: give a --budget too (without one every "
                "token is kept)"
            )


def load_llama(
    model, ctx_size, budget, policy, sinks, recent, error_tol, evict_every, observe_steps, threads, n_gpu_layers,
    batch_size, reading="query", layer_budgets=None, rpc=None, **extra,
):  # fmt: skip
    """Resolve, check and load a model as an ahakv_local.Llama; every user mistake is an AhakvError."""
    from .budget import Budget, parse_schedule
    from .models import resolve_model
    from .policies import make_policy

    # the user's own mistakes first, before the model is assembled or read
    make_policy(policy)  # (a clear error for an unknown policy)
    budget = asked_budget(budget, policy)
    if budget is None:
        refuse_unbounded_options(policy)
    else:
        refuse_unguided_reading(policy, reading)
        refuse_guide_token_by_token(reading, batch_size)
    if budget is not None:
        Budget.parse(budget)  # a clear error for a malformed budget; the controller checks its size
    evict_every, observe_steps = parse_schedule(evict_every, observe_steps)
    rpc = parse_rpc(rpc)  # reachability when the model loads
    path = resolve_model(model, progress=True)
    check_model(path, batch_size)
    from .engine import default_threads
    from .native import lib

    lib()  # refuse an unpatched or missing engine with one line, before llama_cpp is imported
    threads = threads or default_threads()  # llama-cpp-python's own default would be half the cores
    n_gpu_layers = gpu_layers(n_gpu_layers, rpc)
    from .llama import BOUNDED_SETTINGS, Llama

    batch_size = batch_size or (BUDGETED_BATCH if budget is not None else 512)
    bounded = dict(
        kv_budget=budget,
        kv_policy=policy,
        kv_sinks=sinks,
        kv_recent=recent,
        kv_error_tol=error_tol,
        kv_evict_every=evict_every,
        kv_observe_steps=observe_steps,
        kv_query=kv_query_of(reading),
        kv_layer_budgets=layer_budgets,  # None: the product's layout for the model (budget.default_layer_budgets)
        **{k: extra.pop(k) for k in list(extra) if k in BOUNDED_SETTINGS},  # (chat's kv_reuse_compressed)
    )
    try:
        return Llama(
            str(path),
            n_ctx=ctx_size,
            n_batch=batch_size,
            n_ubatch=batch_size,
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=n_gpu_layers,
            verbose=False,
            rpc_servers=rpc,
            **(bounded if budget is not None else {}),  # (without one the environment's policy would be warned of)
            **extra,
        )
    except AhakvError:
        raise  # (a ValueError too) already says what is wrong
    except ValueError as exc:
        raise AhakvError(f"cannot load {path}: {exc}") from None
    except MemoryError:  # llama-cpp-python holds batch x vocabulary logits (1 MiB a token on Gemma 3's 262,144)
        raise AhakvError(
            f"not enough memory to load {path.name} with a batch of {batch_size} tokens: lower --batch-size"
        ) from None


def sampling_options(temp: float):
    """The sampling options of chat and generate (``temp``: the command's default temperature)."""

    def add(f):
        for option in reversed(
            [
                click.option("--temp", type=FiniteRange(min=0), default=temp, show_default=True,
                             help="Sampling temperature (0 = greedy)."),
                click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0: off."),
                click.option("--top-p", type=FiniteRange(0, 1), default=0.95, show_default=True),
                click.option("--seed", default=0, show_default=True),
            ]
        ):  # fmt: skip
            f = option(f)
        return f

    return add


@main.command()
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@engine_options
@click.option("-sys", "--system", default="You are a helpful assistant.", show_default=True, help="System prompt.")
@click.option("-n", "--n-predict", type=Positive, default=512, show_default=True, help="Most tokens per answer.")
@sampling_options(temp=0.7)
def chat(model, system, n_predict, temp, top_k, top_p, seed, **engine) -> None:
    """Chat in the terminal; the conversation stays in the (bounded) cache across turns."""
    from .chat import ChatSession, install_sigint_default, run_chat

    if engine["budget"] is None and engine["policy"] != "full":
        engine["budget"] = "1024"  # the chat is the product: bounded by default (--policy full: every token, to -c)
    system = argument_text(system, "-sys") if system.strip() else None  # before the model loads; "  " is none
    llm = load_llama(model, kv_reuse_compressed=True, **engine)
    install_sigint_default()
    session = ChatSession(llm, system, n_predict, temp, top_k, top_p, seed)
    run_chat(session)


@main.command()
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@engine_options
@click.option("-p", "--prompt", default=None, help="Prompt text (else --file, else standard input).")
@click.option("-f", "--file", "prompt_file", default=None, help="Read the prompt from this file (-: standard input).")
@click.option("-n", "--n-predict", type=Positive, default=128, show_default=True, help="Tokens to generate.")
@sampling_options(temp=0.0)
@click.option("--stats", is_flag=True, help="Print prompt/generation speed and cache figures to stderr.")
@click.option("--query", default=None, help="The question to read a long prompt with (default: its last paragraph).")
def generate(model, prompt, prompt_file, n_predict, temp, top_k, top_p, seed, stats, query, **engine) -> None:
    """Generate a continuation of a prompt."""
    source = "the prompt"
    if prompt is not None and prompt_file is not None:  # (-p won and the file went unread, without a word)
        raise AhakvError("give the prompt with -p or with --file, not both")
    if prompt_file == "":  # (an empty name read standard input, as "-" does)
        raise AhakvError("--file needs a file name (- for standard input)")
    if prompt is not None:  # argv's bytes that are not UTF-8 come as surrogates, which failed at the tokenizer
        prompt = argument_text(prompt, "-p")
    if query is not None:
        query = argument_text(query, "--query")
        if not query.strip():  # (it fell back to the prompt's last paragraph without a word)
            raise AhakvError("--query is empty: give the question's text, or leave --query out (the prompt's last "
                             "paragraph guides the reading)")  # fmt: skip
    if prompt is None:
        stdin = sys.stdin  # None where it was closed (`<&-`): said so, not "give a prompt ... on standard input"
        if prompt_file == "-" or (not prompt_file and (stdin is None or not stdin.isatty())):  # "-": stdin's name
            source = "standard input"
            if stdin is None:
                raise AhakvError("standard input is closed: give the prompt with -p or --file")
            prompt = read_stream(stdin.buffer, source)
        elif prompt_file:
            source = prompt_file
            prompt = read_text(prompt_file)
        else:
            raise AhakvError("give a prompt with -p, --file or on standard input")
    if not prompt.strip():  # llama-cpp-python would continue from nothing but the BOS token
        raise AhakvError(f"{source} is empty")
    if query is not None:  # refused rather than ignored: the reading would go on without the question
        check_query_reading(engine)
    llm = load_llama(model, **engine)
    stream = llm.create_completion(
        prompt, max_tokens=n_predict, temperature=temp, top_k=top_k, top_p=top_p, seed=seed, stream=True,
        kv_query=query,
    )  # fmt: skip
    finish = None
    try:
        for chunk in stream:
            choice = chunk["choices"][0]
            click.echo(choice["text"], nl=False)
            finish = choice["finish_reason"] or finish
    except ValueError as exc:  # llama-cpp-python's request errors: the prompt does not fit the context
        raise AhakvError(str(exc)) from None
    except OSError as exc:  # stdout on a full disk (> /dev/full) was a traceback; a closed pipe is click's (exit 1)
        if isinstance(exc, BrokenPipeError):
            raise
        raise AhakvError(f"cannot write the answer to standard output: {exc.strerror or exc}") from None
    click.echo()
    s = llm.kv_stats()
    if finish == "length" and s.sampled_tokens < n_predict:  # llama-cpp-python cuts max_tokens to the context, silently
        bounded = "" if llm.kv_controller else ": raise -c, or give a --budget to keep the cache bounded"
        click.echo(f"stopped after {s.sampled_tokens} of {n_predict} tokens: the context holds {llm.n_ctx()} positions"
                   f"{bounded}", err=True)  # fmt: skip
    if stats:
        budget = s.budget if s.budget is not None else "-"
        click.echo(
            f"prompt {s.prompt_tokens} tok at {s.prompt_tps:.1f} t/s"
            # a guided reading decodes its question behind each chunk: what the prompt's speed paid for
            + (f" ({s.guide_tokens} more decoded to guide it)" if s.guide_tokens else "")
            + f" | generated {s.sampled_tokens} tok at "
            f"{s.generation_tps:.1f} t/s | cache {s.cells_used}/{budget} cells ({s.kv_cells} allocated, "
            f"{s.kv_bytes / 2**20:.1f} MiB KV, {s.kv_type}"
            + (f", {s.layer_budgets}" if s.layer_budgets else "")
            + f") | seen {s.tokens_seen} | evicted {s.evicted}"
            + "".join(
                f" | {kind} {u / 2**20:.2f}/{a / 2**20:.2f} MiB" + (f" in {n} caches" if n > 1 else "")
                for kind, (a, u, n) in s.kv_kind_bytes.items()
            ),
            err=True,
        )


@main.command()
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@click.option(
    "-b",
    "--budget",
    default="512",
    show_default=True,
    envvar="AHAKV_BUDGET",
    help="Budget to compare with the full cache: cells of a full-attention layer (512), KV bytes over all layers "
    "(8MiB), a ratio of the tokens seen (25%), auto, or none (the full caches alone), as generate takes it.",
)
@click.option(
    "-c",
    "--ctx-size",
    type=click.IntRange(min=0),
    default=None,
    envvar="AHAKV_CTX_SIZE",
    help="Context length to compare at and to lay a budget out in (default or 0: trained; generate's default is 4096).",
)
@click.option(
    "-ub",
    "--ubatch-size",
    type=Positive,
    default=512,
    show_default=True,
    help="llama.cpp's n_ubatch: a trimmed sliding-window cache holds the window plus one ubatch.",
)
@click.option(
    "--layer-budgets",
    type=click.Choice(LAYER_BUDGETS),
    default=None,
    envvar="AHAKV_LAYER_BUDGETS",
    help="The layout whose allocation at --budget to state [default: generate's for the model].",
)
@kv_type_option
@policy_option
@sinks_option
@recent_option
@evict_every_option()
@reading_option
@batch_size_option
@n_gpu_layers_default
@rpc_option
def info(model, budget, ctx_size, ubatch_size, layer_budgets, kv_type, batch_size, **engine) -> None:
    """Architecture, heads, sliding window, trained context and KV bytes of MODEL, per KV cache for
    swa_full on (llama-cpp-python's default) and off (llama.cpp's own tools: the sliding cache trimmed); with a
    budget, what generate allocates for it with the same options."""
    from .budget import Budget, default_layer_budgets
    from .info import BudgetAllocation, check_kv_types, describe, read_info
    from .models import resolve_model
    from .policies import make_policy
    from .session import SessionSpec

    ctx_size = ctx_size or None  # 0: the trained context, as llama.cpp (and generate) take it
    # none (or --policy full over AHAKV_BUDGET, as generate takes them): the full caches alone; else one line for a
    # malformed budget or policy, before the model is read
    make_policy(engine["policy"])  # (an unknown one with no budget too, as generate refuses it)
    budget = asked_budget(budget, engine["policy"])
    budget = None if budget is None else Budget.parse(budget)
    if budget is None:
        refuse_unbounded_options(engine["policy"])  # as generate refuses them (they were ignored)
    else:
        refuse_unguided_reading(engine["policy"], engine["reading"])  # as generate refuses it
        refuse_guide_token_by_token(engine["reading"], batch_size)
    rpc = parse_rpc(engine["rpc"])
    path = resolve_model(model, progress=True)
    check_model(path, batch_size)
    model_info = read_info(path)
    if model_info.cut_short is not None:  # what its header says is still worth stating; loading it is not possible
        click.echo(f"note: {model_info.cut_short}: no command can load it", err=True)
    if budget is None:  # the full caches, in the K/V type a run without a budget would allocate (auto: f16)
        full_type = kv_type if kv_type not in (None, KV_TYPE_AUTO) else "f16"
        check_kv_types(model_info, full_type, full_type)  # as a run refuses it (a budget's plan checks its own)
        click.echo(describe(model_info, ctx_size, ubatch_size, None, full_type))
        return
    # what generate and serve allocate for that budget (Llama.__init__'s plan: their chunk, a question's room, their
    # K/V type, the layout for where their layers run)
    layer_budgets = layer_budgets or default_layer_budgets(
        model_info.n_layer_swa, model_info.n_layer, offloads_by_default(engine["n_gpu_layers"], rpc)
    )
    context = min(ctx_size or model_info.n_ctx_train, model_info.n_ctx_train)  # (no position past it: plan_on)
    spec = SessionSpec.bounded(
        engine["policy"],
        budget,
        n_sink=engine["sinks"],
        n_recent=engine["recent"],
        evict_every=engine["evict_every"],
        layer_budgets=layer_budgets,
        reading=engine["reading"],
        kv_type=kv_type,
    )
    chunk = batch_size or BUDGETED_BATCH  # generate's n_batch and n_ubatch under a budget
    plan, cells = spec.check_drop_in(path, context, chunk, chunk)  # what generate refuses
    room = (
        "" if not plan.spec.room(plan.chunk) else ROOMS.get(plan.spec.reading, f"a {plan.spec.reading} reading's room")
    )
    at = BudgetAllocation(budget, layer_budgets, cells, plan.chunk, plan.spec.kv_type, room)
    click.echo(describe(model_info, ctx_size, ubatch_size, at))


@main.command()
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, envvar="AHAKV_HOST")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, envvar="AHAKV_PORT")
@click.option(
    "--max-tokens-limit",
    type=Positive,
    default=2048,
    show_default=True,
    envvar="AHAKV_MAX_TOKENS_LIMIT",
    help="Most tokens one answer generates; a request's max_tokens of 0, null or more is cut to it.",
)
@click.option(
    "--parallel",
    type=click.IntRange(1, 256),  # llama.cpp's LLAMA_MAX_SEQ
    default=1,
    show_default=True,
    envvar="AHAKV_PARALLEL",
    help="Requests served at once: sequences sharing one context, one token each per decode (needs a cell budget).",
)
def serve(model, host, port, max_tokens_limit, parallel, **engine) -> None:
    """An OpenAI-compatible server (completions, chat completions, streaming; /health, /v1/kv/stats)."""
    require("serve")
    from .server import create_app, listen_socket, run_server

    sock = listen_socket(host, port)  # before the model loads: an address in use is refused at once
    if parallel > 1:
        pool = load_pool(model, parallel, **engine)
        path = pool.engine.path
        app = create_app(
            pool, model_name=path.name, max_tokens_limit=max_tokens_limit, default_query=kv_query_of(engine["reading"])
        )
    else:
        llm = load_llama(model, **engine)
        path = llm.model_path
        app = create_app(llm, model_name=llm.model_path.rsplit("/", 1)[-1], max_tokens_limit=max_tokens_limit)
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address is bracketed in a URL
    click.echo(f"serving {path} on http://{shown}:{port}/v1", err=True)
    run_server(app, sock)


def refuse_unguided_reading(policy: str, reading: str) -> None:
    """--reading (or AHAKV_READING) query or reconstruct asked for a policy no question guides: refused in one line,
    as the server refuses a request's kv_query (it was read plainly, silently); the default reading is not asked."""
    from .policies import check_guided

    if given("reading") and reading in ("query", "reconstruct"):
        check_guided(policy, f"--reading {reading}", "--reading plain or surprisal")


def load_pool(
    model, parallel, ctx_size, budget, policy, sinks, recent, error_tol, evict_every, observe_steps, threads,
    n_gpu_layers, batch_size, reading="query", layer_budgets=None, rpc=None, **extra,
):  # fmt: skip
    """``parallel`` sequence slots of one context for ``serve --parallel``; every user mistake is an AhakvError."""
    from .budget import Budget, parse_schedule
    from .policies import make_policy
    from .session import SessionSpec

    budget = asked_budget(budget, policy)
    if budget is None or Budget.parse(budget).mode != "cells":
        raise AhakvError("--parallel needs --budget in cells: each sequence holds its own budget in one context")
    if not make_policy(policy).evicts:  # (it started, then refused every request that named no kv_policy)
        raise AhakvError(f"--parallel needs a policy that evicts: {policy} keeps every token, and each sequence "
                         "holds at most its budget in the context they share")  # fmt: skip
    refuse_unguided_reading(policy, reading)
    # (it was ignored: each sequence reaches the model's trained context, as its prompt can); AHAKV_CTX_SIZE, set for
    # the other commands, is not asked of this one
    if source("ctx_size") == ParameterSource.COMMANDLINE:
        raise AhakvError(
            "--parallel sizes its context by --budget and --parallel, and a request reaches the model's trained "
            "context: drop -c"
        )
    if layer_budgets not in (None, "shared"):  # its default: the sequences of one context share one pool each
        raise AhakvError("--parallel needs --layer-budgets shared")
    if extra.get("kv_type") not in (None, KV_TYPE_AUTO, "f16"):  # auto: f16 for a budget in cells
        raise AhakvError(f"--parallel keeps K and V in f16: drop --kv-type {extra['kv_type']}")
    if parallel > (batch := batch_size or BUDGETED_BATCH):  # llama.cpp aborted the process (n_outputs_max)
        raise AhakvError(
            f"--parallel {parallel} is more than the batch size {batch}: a step decodes one token of every sequence "
            f"in one batch (give --batch-size {parallel} or more)"
        )
    evict_every, observe_steps = parse_schedule(evict_every, observe_steps)
    spec = SessionSpec.bounded(
        policy, budget, n_sink=sinks, n_recent=recent, evict_every=evict_every, observe_steps=observe_steps,
        reading=reading,
    )  # fmt: skip
    rpc = parse_rpc(rpc)  # reachability when the model loads
    from .models import resolve_model
    from .native import lib

    path = resolve_model(model, progress=True)
    check_model(path, batch_size)
    lib()  # refuse an unpatched or missing engine with one line
    from .engine import Engine, EngineConfig
    from .parallel import SequencePool

    n_gpu_layers = gpu_layers(n_gpu_layers, rpc)
    batch_size = batch_size or BUDGETED_BATCH
    cells = SequencePool.context_cells(spec.budget, parallel, batch_size, spec.room(batch_size))
    # before llama.cpp allocates, as the one-at-a-time server checks (it printed four lines of allocation failures, and
    # a context between the free and the total memory would have been allocated and zeroed)
    from .info import N_PAD
    from .llama import check_cells

    check_cells(str(path), -(-cells // N_PAD) * N_PAD, spec.budget)  # (llama.cpp pads this context, every layer's)
    config = EngineConfig(
        n_ctx=cells, n_batch=batch_size, n_ubatch=batch_size, n_threads=threads, n_gpu_layers=n_gpu_layers,
        n_seq=parallel, rpc_servers=rpc,
    )  # fmt: skip
    engine = Engine(path, config)
    try:
        return SequencePool(engine, spec)
    except BaseException:
        engine.close()
        raise


from .cli_eval import bench_group, eval_group  # noqa: E402  (the subcommands need `main` defined first)

main.add_command(eval_group)
main.add_command(bench_group)
