"""The command-line options several commands share, declared once (their types, defaults, AHAKV_* variables and
help), and what the ones about the engine's devices mean (-ngl, --rpc)."""

from __future__ import annotations

import math

import click

from .budget import KV_TYPE_AUTO, READINGS
from .info import KV_CACHE_TYPES
from .native import MAX_THREADS

Count = click.IntRange(min=0)  # click reports a value outside the range in one line, with the option's name
Positive = click.IntRange(min=1)
# a trial is a whole prompt read and answered (a second or more each); the items and keys of every trial are made
# before the first runs (a task that cannot be built fails before any), so --trials 2147483648 grew the memory by
# ~25 MB/s with no run started
TRIALS = click.IntRange(1, 100)


def rpc_option(f, every_layer: bool = False):
    """--rpc / AHAKV_RPC: the llama.cpp RPC workers of every command that loads a model (``every_layer``: a command
    without -ngl, whose workers hold every layer)."""
    from .rpc import OPTION_HELP, OPTION_HELP_EVERY_LAYER

    text = OPTION_HELP_EVERY_LAYER if every_layer else OPTION_HELP
    return click.option("--rpc", default=None, metavar="HOST:PORT,...", envvar="AHAKV_RPC", help=text)(f)


def eval_rpc_option(f):
    return rpc_option(f, every_layer=True)


def threads_option(f):
    """-t: CPU threads of the engine, also from AHAKV_THREADS (a bad value is click's one line; without either,
    ``engine.default_threads``: every core; on a machine shared with other jobs, 1 avoids the thread barriers'
    spinning)."""
    return click.option(
        "-t",
        "--threads",
        type=click.IntRange(1, MAX_THREADS),
        default=None,
        envvar="AHAKV_THREADS",
        help="CPU threads (default: AHAKV_THREADS, else every core).",
    )(f)


def n_gpu_layers_option(help: str, offload_by_default: bool = False):
    """-ngl / AHAKV_N_GPU_LAYERS: layers to offload (-1: all). With ``offload_by_default`` (the commands a user runs
    a model with) the default is None, which ``gpu_layers`` resolves once the engine is loaded; the measuring
    commands keep 0, so that a table means the same machine part wherever it ran."""
    if offload_by_default:
        help += " [default: every layer where the engine has a GPU or --rpc workers are given, else none]"
    return click.option(
        "-ngl",
        "--n-gpu-layers",
        type=click.IntRange(min=-1),
        default=None if offload_by_default else 0,
        show_default=not offload_by_default,
        envvar="AHAKV_N_GPU_LAYERS",
        help=help,
    )


def gpu_layers(n_gpu_layers: int | None, rpc: tuple[str, ...] | None = None) -> int:
    """The layers to offload: as given, or by default (None) every layer where the loaded engine has a GPU
    (``upstream.gpu_devices``) or RPC workers are given, else none, as llama.cpp's own tools and ollama do (a
    ``build --cuda`` engine ran on the CPU unless told)."""
    if n_gpu_layers is not None:
        return n_gpu_layers
    from .upstream import offload_target

    return -1 if offload_target(rpc or ()) else 0


def offloads_by_default(n_gpu_layers: int | None = None, rpc: tuple[str, ...] = ()) -> bool:
    """Whether chat, generate and serve with these -ngl and --rpc put layers off the CPU (``gpu_layers``), as ``info``
    states their layout; without workers, False where the engine does not load (``info`` reads GGUF headers only)."""
    if n_gpu_layers == 0:
        return False
    if rpc:
        return True
    try:
        return gpu_layers(None) != 0
    except (ImportError, OSError, AttributeError):  # no engine, or a libggml without the device registry
        return False


def parse_rpc(rpc: str | None) -> tuple[str, ...]:
    """--rpc's workers, checked (a malformed address is one line, before the model is read); () without it."""
    from .rpc import parse_servers

    return parse_servers(rpc) if rpc is not None and rpc.strip() else ()  # --rpc "": none (over AHAKV_RPC)


class FiniteRange(click.FloatRange):
    """A float range that refuses nan and infinities (click's range checks are all false for nan: --temp nan ran)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


kv_type_option = click.option(  # the commands that load a model, and info, which states what they would allocate
    "--kv-type",
    type=click.Choice((KV_TYPE_AUTO, *KV_CACHE_TYPES)),
    default=KV_TYPE_AUTO,
    show_default=True,
    envvar="AHAKV_KV_TYPE",
    help="KV cache type of K and V (q8_0 about half the bytes of f16, q4_0 a quarter; flash attention on). "
    "auto: f16, except a byte budget below the trimmed cache for the context as this engine lays it out (the "
    "window plus one prompt chunk): q8_0, below a fifth of it q5_0.",
)


class PolicyOption(click.Option):
    """--policy, whose help lists the registry's names; read only when help is shown (importing the
    policies pulls numpy, which a command like `info` does not need)."""

    def get_help_record(self, ctx: click.Context):
        from .policies import POLICIES

        self.help = "Eviction policy: " + ", ".join(POLICIES) + "."
        return super().get_help_record(ctx)


# the options that shape what a budget allocates: generate's, chat's and serve's (engine_options), and info's, which
# states what they would allocate with the same options and variables
policy_option = click.option("--policy", cls=PolicyOption, default="ahakv", show_default=True, envvar="AHAKV_POLICY")
sinks_option = click.option(
    "--sinks", type=Count, default=4, show_default=True, envvar="AHAKV_SINKS", help="Protected first tokens."
)
recent_option = click.option(
    "--recent", type=Count, default=32, show_default=True, envvar="AHAKV_RECENT", help="Protected last tokens."
)


EVICT_EVERY_HELP = "Decode steps between evictions (default 32, less for small budgets, 1 for ratio and auto ones)."


def evict_every_option(help: str = EVICT_EVERY_HELP):
    return click.option("--evict-every", type=Positive, default=None, envvar="AHAKV_EVICT_EVERY", help=help)


def observe_steps_option(help: str = "Observed steps before each eviction (0: all)."):
    return click.option(
        "--observe-steps", type=Count, default=1, show_default=True, envvar="AHAKV_OBSERVE_STEPS", help=help
    )


# the measuring commands' lists: every policy or layout named runs beside the others
policies_option = click.option(
    "--policies", default="all", show_default=True, help="Comma-separated policy names, or all."
)


def layouts_option(help: str):
    return click.option("--layer-budgets", default="shared", show_default=True, help=help)


reading_option = click.option(
    "--reading",
    type=click.Choice(READINGS),
    default="query",
    show_default=True,
    envvar="AHAKV_READING",
    help="How a prompt longer than the budget is read: guided by its question (ahakv, snapkv, tova), "
    "by the policy alone, or question-agnostic: by reconstruction (about 2x the prompt time) or by each "
    "phrase's surprisal (the logits of every prompt token).",
)
n_gpu_layers_default = n_gpu_layers_option("Layers to offload to the GPU (-1: all).", offload_by_default=True)
