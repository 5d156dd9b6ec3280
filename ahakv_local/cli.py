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


@main.command()
@click.argument("model", required=False)
@click.option("-p", "--prompt", default=None, help="Prompt text (default: the start of the GPL-3 text).")
@click.option("-n", "--n-predict", default=64, show_default=True, help="Tokens to generate.")
@click.option("-c", "--ctx-size", default=4096, show_default=True, help="KV cells to allocate.")
@click.option("--budget", type=int, default=None, help="Keep at most this many cells: 4 sinks + the most recent.")
@click.option("--temp", default=0.0, show_default=True, help="Sampling temperature (0 = greedy).")
@click.option("--seed", default=0, show_default=True)
@click.option("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores).")
@click.option("-ngl", "--n-gpu-layers", default=0, show_default=True, help="Layers to offload to the GPU.")
def run(model, prompt, n_predict, ctx_size, budget, temp, seed, threads, n_gpu_layers) -> None:
    """Generate from MODEL and report tokens/s and KV cache occupancy."""
    from .engine import Engine, EngineConfig
    from .generate import GenerationStats, stream_tokens
    from .models import resolve_model

    if prompt is None:
        with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
            prompt = f.read()[:1500]
    if budget is not None and budget < 8:
        raise AhakvError("--budget must be at least 8 cells (4 sinks + recent tokens)")

    path = resolve_model(model, progress=True)
    config = EngineConfig(n_ctx=ctx_size, n_threads=threads, n_gpu_layers=n_gpu_layers)
    with Engine(path, config) as engine:
        tokens = engine.tokenize(prompt)
        stats = GenerationStats()
        hook = _sink_recent_eviction(budget) if budget else None
        generated: list[int] = []
        shown = 0
        for token in stream_tokens(engine, tokens, n_predict, temp, seed, stats, hook):
            generated.append(token)
            text = engine.detokenize(generated)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                click.echo(text[shown:], nl=False)
                shown = len(text)
        click.echo()
        used, cells = engine.n_used(), engine.n_cells()
        click.echo(
            f"prompt {stats.n_prompt} tok at {stats.prompt_tps:.1f} t/s | "
            f"generated {stats.n_generated} tok at {stats.decode_tps:.1f} t/s | "
            f"cache {used}/{cells} cells, {engine.kv_bytes() / 2**20:.1f} MiB KV | evicted {stats.evicted}",
            err=True,
        )


def _sink_recent_eviction(budget: int, n_sink: int = 4):
    """Keep the first n_sink positions and the most recent ones (the full policies come with the controller)."""

    def evict(engine) -> int:
        live = engine.live_positions()
        excess = live.size - budget
        if excess <= 0:
            return 0
        return engine.evict(live[n_sink : n_sink + excess])

    return evict
