"""``ahakv-local``: build the patched engine, fetch models, run a generation.

User mistakes end in one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import AhakvError


class Group(click.Group):
    """Turns AhakvError into ``error: ...`` and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AhakvError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=Group)
@click.version_option(__version__, prog_name="ahakv-local")
def main() -> None:
    """Long conversations and documents through local GGUF models with a bounded KV cache."""


@main.command()
@click.option("--cuda", is_flag=True, help="Build the CUDA backend (-DGGML_CUDA=ON).")
@click.option("--metal", is_flag=True, help="Build the Metal backend (-DGGML_METAL=ON).")
@click.option("--cmake-args", default="", metavar="ARGS", help="Extra CMake arguments (also read from $CMAKE_ARGS).")
@click.option("--force", is_flag=True, help="Rebuild even if a matching engine is installed or cached.")
def build(cuda: bool, metal: bool, cmake_args: str, force: bool) -> None:
    """Download llama-cpp-python 0.3.36, apply patches/, compile and install it."""
    from .build import ensure_engine

    click.echo(ensure_engine(cuda=cuda, metal=metal, cmake_args=cmake_args, force=force))


@main.command("model-path")
@click.argument("model", required=False)
def model_path(model: str | None) -> None:
    """Print the GGUF path of MODEL (default: the embedded Gemma 3 270M; 'fixture': the test model)."""
    from .models import resolve_model

    click.echo(resolve_model(model, progress=True))


def engine_options(f):
    """Options shared by the commands that load a model (llama.cpp's names, mirrored by AHAKV_* variables)."""
    options = [
        click.option(
            "-c",
            "--ctx-size",
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
            help="KV budget: cells (512), a ratio of the tokens seen (0.25 or 25%), or auto.",
        ),
        click.option(
            "--policy",
            default="ahakv",
            show_default=True,
            envvar="AHAKV_POLICY",
            help="Eviction policy: " + ", ".join(POLICY_NAMES) + ".",
        ),
        click.option("--sinks", default=4, show_default=True, envvar="AHAKV_SINKS", help="Protected first tokens."),
        click.option("--recent", default=32, show_default=True, envvar="AHAKV_RECENT", help="Protected recent tokens."),
        click.option(
            "--error-tol",
            default=0.05,
            show_default=True,
            envvar="AHAKV_ERROR_TOL",
            help="Auto budget: tolerated predicted relative output change.",
        ),
        click.option(
            "--evict-every",
            type=int,
            default=None,
            envvar="AHAKV_EVICT_EVERY",
            help="Decode steps between evictions (default 32, less for small budgets; 1 = every token).",
        ),
        click.option(
            "--observe-steps",
            default=1,
            show_default=True,
            envvar="AHAKV_OBSERVE_STEPS",
            help="Steps before each eviction whose full statistics the policy reads (0 = every step).",
        ),
        click.option("-t", "--threads", type=int, default=None, envvar="AHAKV_THREADS", help="CPU threads."),
        click.option(
            "-ngl",
            "--n-gpu-layers",
            default=0,
            show_default=True,
            envvar="AHAKV_N_GPU_LAYERS",
            help="Layers to offload to the GPU.",
        ),
        click.option(
            "--batch-size",
            type=int,
            default=None,
            help="Prompt tokens per decode call (default: 64 with a budget, to keep the cells near it; 512).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


POLICY_NAMES = ("full", "streaming", "random", "h2o", "scissorhands", "tova", "snapkv", "ahakv")


def load_llama(
    model, ctx_size, budget, policy, sinks, recent, error_tol, evict_every, observe_steps, threads, n_gpu_layers,
    batch_size, **extra,
):  # fmt: skip
    """Resolve, check and load a model as an ahakv_local.Llama; every user mistake is an AhakvError."""
    from .controller import Budget, parse_schedule
    from .info import read_info
    from .models import resolve_model
    from .policies import make_policy

    path = resolve_model(model, progress=True)
    read_info(path)  # a clear error for an unsupported architecture before llama.cpp tries
    make_policy(policy)  # a clear error for an unknown policy
    if budget is not None:
        Budget.parse(budget)  # a clear error for a malformed budget; the controller checks its size
    evict_every, observe_steps = parse_schedule(evict_every, observe_steps)
    from .native import lib

    lib()  # refuse an unpatched or missing engine with one line, before llama_cpp is imported
    from .llama import Llama

    batch_size = batch_size or (64 if budget is not None else 512)
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
            kv_budget=budget,
            kv_policy=policy,
            kv_sinks=sinks,
            kv_recent=recent,
            kv_error_tol=error_tol,
            kv_evict_every=evict_every,
            kv_observe_steps=observe_steps,
            **extra,
        )
    except ValueError as exc:
        raise AhakvError(f"cannot load {path}: {exc}") from None


@main.command()
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@engine_options
@click.option("-sys", "--system", default="You are a helpful assistant.", show_default=True, help="System prompt.")
@click.option("-n", "--n-predict", default=512, show_default=True, help="Most tokens per answer.")
@click.option("--temp", default=0.7, show_default=True)
@click.option("--top-k", default=40, show_default=True)
@click.option("--top-p", default=0.95, show_default=True)
@click.option("--seed", default=0, show_default=True)
def chat(model, system, n_predict, temp, top_k, top_p, seed, **engine) -> None:
    """Chat in the terminal; the conversation stays in the (bounded) cache across turns."""
    from .chat import ChatSession, install_sigint_default, run_chat

    if engine["budget"] is None:
        engine["budget"] = "1024"  # the chat is the product: bounded by default
    llm = load_llama(model, kv_reuse_compressed=True, **engine)
    install_sigint_default()
    session = ChatSession(llm, system or None, n_predict, temp, top_k, top_p, seed)
    run_chat(session)


@main.command()
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@engine_options
@click.option("-p", "--prompt", default=None, help="Prompt text (else --file, else standard input).")
@click.option("-f", "--file", "prompt_file", default=None, help="Read the prompt from this file.")
@click.option("-n", "--n-predict", default=128, show_default=True, help="Tokens to generate.")
@click.option("--temp", default=0.0, show_default=True, help="Sampling temperature (0 = greedy).")
@click.option("--top-k", default=40, show_default=True)
@click.option("--top-p", default=0.95, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--stats", is_flag=True, help="Print prompt/generation speed and cache figures to stderr.")
def generate(model, prompt, prompt_file, n_predict, temp, top_k, top_p, seed, stats, **engine) -> None:
    """Generate a continuation of a prompt."""
    if prompt is None:
        if prompt_file:
            try:
                prompt = open(prompt_file, encoding="utf-8").read()
            except OSError as exc:
                raise AhakvError(f"cannot read {prompt_file}: {exc.strerror}") from None
        elif not sys.stdin.isatty():
            prompt = sys.stdin.read()
        else:
            raise AhakvError("give a prompt with -p, --file or on standard input")
    llm = load_llama(model, **engine)
    generated = 0
    for chunk in llm.create_completion(
        prompt, max_tokens=n_predict, temperature=temp, top_k=top_k, top_p=top_p, seed=seed, stream=True
    ):
        click.echo(chunk["choices"][0]["text"], nl=False)
        generated += chunk["choices"][0]["finish_reason"] is None  # one chunk per token, then a final one
    click.echo()
    if stats:
        s = llm.kv_stats()
        budget = s.budget if s.budget is not None else "-"
        click.echo(
            f"prompt {s.prompt_tokens} tok at {s.prompt_tps:.1f} t/s | generated {generated} tok at "
            f"{s.generation_tps:.1f} t/s | cache {s.cells_used}/{budget} cells ({s.kv_cells} allocated, "
            f"{s.kv_bytes / 2**20:.1f} MiB KV) | seen {s.tokens_seen} | evicted {s.evicted}",
            err=True,
        )


@main.command()
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@click.option("-b", "--budget", default=512, show_default=True, help="Budget to compare with the full cache.")
@click.option("-c", "--ctx-size", type=int, default=None, help="Context length to compare at (default: trained).")
def info(model, budget, ctx_size) -> None:
    """Architecture, heads, sliding window, trained context and KV bytes of MODEL."""
    from .info import describe, read_info
    from .models import resolve_model

    if budget < 1:
        raise AhakvError("--budget must be at least 1 cell")
    click.echo(describe(read_info(resolve_model(model, progress=True)), budget, ctx_size))


@main.command()
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, envvar="AHAKV_HOST")
@click.option("--port", default=8000, show_default=True, envvar="AHAKV_PORT")
def serve(model, host, port, **engine) -> None:
    """An OpenAI-compatible server (completions, chat completions, streaming)."""
    import uvicorn

    from .server import create_app

    llm = load_llama(model, **engine)
    app = create_app(llm, model_name=llm.model_path.rsplit("/", 1)[-1])
    click.echo(f"serving {llm.model_path} on http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


from .cli_eval import bench_group, eval_group  # noqa: E402  (the subcommands need `main` defined first)

main.add_command(eval_group)
main.add_command(bench_group)
