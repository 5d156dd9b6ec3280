"""``ahakv-local eval`` and ``ahakv-local bench``: what a budget costs in quality and buys in speed and memory.

Every command writes results.json (each figure with its configuration and provenance), results.csv and
results.md under --out, and a PNG plot (all but eval needle), and shows a progress bar on stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import click

from .cli_options import (
    TRIALS,
    Positive,
    eval_rpc_option,
    evict_every_option,
    layouts_option,
    n_gpu_layers_option,
    observe_steps_option,
    parse_rpc,
    policies_option,
    recent_option,
    sinks_option,
    threads_option,
)
from .errors import AhakvError
from .extras import require
from .info import KV_CACHE_TYPES
from .textfile import LICENSES, license_files, read_text


def _bar(desc: str, total: int, unit: str = "tok"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)


def _advance(bar) -> Callable[[int, int], None]:
    """A run's ``progress(done, total)`` on ``bar``, with the run's own total, which leaves out what it does not run
    (eval needle's budget that holds a length's prompt: the bar stopped at 10/12)."""

    def advance(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    return advance


def _out(out_dir: str, figure: str | None = None, inputs: tuple[str, ...] = ()) -> Path:
    """The outputs' folder, tried now: one that cannot be written fails in one line before the run, not in a
    traceback after it (the results lost), and so does one whose report would replace a file not of a report
    (``report.check_outputs``: its tables and ``figure``; ``inputs``: the run's text files). What the try makes goes
    again: a run refused later leaves nothing."""
    import tempfile

    from .report import check_outputs

    if not out_dir.strip():  # Path("") is the working folder: every output landed there, unasked
        raise AhakvError("--out is empty: name the folder for the outputs")
    out = Path(out_dir)
    check_outputs(out, figure, inputs)
    made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise AhakvError(f"cannot write the outputs to {out}: {exc.strerror or exc}") from None
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
    return out


def _print_report(write: Callable[[], list[str]]) -> None:
    """Write a finished run's report and print its Markdown table; where the report cannot be written (a full disk)
    the table is still printed, then the error names the folder: the run's results are not lost with the files."""
    from .report import ReportNotWritten

    try:
        lines = write()
    except ReportNotWritten as exc:
        for line in exc.lines:
            click.echo(line)
        raise
    for line in lines:
        click.echo(line)


def _model(model: str | None) -> Path:
    from .models import resolve_model
    from .native import lib

    lib()  # refuse an unpatched engine with one line
    return resolve_model(model, progress=True)


def _policies(policies: str) -> list[str]:
    """The evicting policies to measure ("all": every one); the full cache is always measured beside them."""
    from .policies import POLICIES, make_policy

    names = [p for p in POLICIES if p != "full"] if policies == "all" else [p.strip() for p in policies.split(",")]
    for name in names:
        make_policy(name)  # a clear error for an unknown name, before any model is loaded
    if "full" in names:  # refused when its budgeted run opened, after the full cache's
        raise bad_value("--policies", "full is the reference every run is measured beside: name evicting policies")
    return list(dict.fromkeys(names))  # each once: a policy named twice ran twice into one row


def _layer_budgets(layouts: str) -> tuple[str, ...]:
    """'shared,adaptive' -> the layouts, refused in one line if one is unknown."""
    from .budget import check_layer_budgets

    names = tuple(dict.fromkeys(n.strip() for n in layouts.split(",") if n.strip()))  # each once
    try:
        for name in names or ("",):  # none named: refused as an empty name
            check_layer_budgets(name)
    except AhakvError as exc:
        raise bad_value("--layer-budgets", str(exc)) from None
    return names


def _cells(budgets: str, n_tokens: int, floor: int) -> list[int]:
    """'256,512' -> cells; '0.125' or '12.5%' -> that fraction of the text (0.125 = 8x compression), at least
    ``floor``. Parsed by Budget.parse, the one grammar of budgets."""
    from .budget import Budget

    cells = []
    for text in budgets.split(","):
        budget = Budget.parse(text)
        if budget.mode in ("auto", "bytes"):
            raise AhakvError(f"evaluation budgets are cells or fractions of the text, not {text!r}")
        target = budget.target(n_tokens)
        cells.append(target if budget.mode == "cells" else max(floor, target))
    return list(dict.fromkeys(cells))  # each once: a budget named twice ran twice into one row


def _say_raised(budgets: str, n_tokens: int, floor: int) -> None:
    """Say which fractions ``_cells`` raised to ``floor`` (after every refusal: an error stays one line). Their rows
    state the compression the floor allows, and several such fractions are one row: without a word, "0.05,0.06" gave
    one row of 10.8x."""
    from .budget import Budget

    raised = [t for t in budgets.split(",") if (b := Budget.parse(t)).mode == "ratio" and b.target(n_tokens) < floor]
    if raised:
        click.echo(
            f"note: {', '.join(raised)} of {n_tokens} tokens is less than sinks + recent + one eviction period: "
            f"raised to {floor} cells",
            err=True,
        )


def _below_trained(cells: list[int], trained: int) -> None:
    """Refuse a budget of more cells than the model has positions (``trained``), as generate does (it ran, and
    reported a "compression" below 1x)."""
    from .budget import Budget, check_trained_context

    check_trained_context(Budget.parse(max(cells)), trained)


def _lengths_fit(lengths: list[int], answer_tokens: int, trained: int) -> None:
    """Refuse a prompt length that, with its answer, runs past the model's trained context (it failed there, after
    the full cache's run)."""
    if trained and max(lengths) + answer_tokens > trained:
        raise AhakvError(
            f"length {max(lengths)} (+{answer_tokens} answer tokens) is past the model's trained context {trained}"
        )


def bad_value(option: str, message: str) -> click.BadParameter:
    """A bad option value found past click's own types (a comma-separated list): exit code 2 and one line, as
    click's are (README: a bad option value)."""
    return click.BadParameter(message, param_hint=f"'{option}'")


def _lengths_and_depths(lengths: str, depths: str) -> tuple[list[int], list[float]]:
    """--lengths '1024,2048' and --depths '0.1,0.5' checked: whole token counts, fractions in [0, 1]."""
    try:
        lens = [int(n) for n in lengths.split(",")]
    except ValueError:
        raise bad_value("--lengths", f"token counts, comma-separated, not {lengths!r}") from None
    try:
        deps = [float(d) for d in depths.split(",")]
    except ValueError:
        raise bad_value("--depths", f"fractions, comma-separated, not {depths!r}") from None
    if min(lens) < 64:  # (eval needle's 0 or -5 was "budget 100 cells holds every prompt (0 tokens at most)")
        raise bad_value("--lengths", f"a length must be at least 64 tokens, not {min(lens)}")
    if any(not 0 <= d <= 1 for d in deps):
        raise bad_value("--depths", f"each must lie between 0 and 1, not {depths!r}")
    return list(dict.fromkeys(lens)), list(dict.fromkeys(deps))  # each once: a repeat ran its items twice


@click.group("eval")
def eval_group() -> None:
    """Measure what a budget costs in quality on your own model and text."""


@eval_group.command("ppl")
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@click.option("--text", "text_file", default=str(LICENSES / "GPL-3"), show_default=True, help="Text to stream.")
@click.option("--tokens", type=Positive, default=1024, show_default=True, help="Tokens of the text to use.")
@click.option(
    "--prefix",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Tokens decoded in chunks before stepping (perplexity scores them too; KL and top-1 only the steps after).",
)
@click.option(
    "--budgets",
    default="128",
    show_default=True,
    help="Comma-separated cells (128) or fractions of the text (0.125 = 8x compression).",
)
@policies_option
@click.option("--ablations", is_flag=True, help="Also AhaKV with each component off, at every budget.")
@click.option("--ablations-at", default="", help="The same, at these budgets only (comma-separated).")
@click.option(
    "--step",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Tokens per decode after the prefix (1: token by token; at most one prompt chunk, 64).",
)
@evict_every_option("Token by token: steps between evictions (default 32, less for small budgets, 1 for fractions).")
@observe_steps_option("Token by token: observed steps (0: all).")
@sinks_option
@recent_option
@click.option(
    "--kv-type",
    type=click.Choice(KV_CACHE_TYPES),
    default="f16",
    show_default=True,
    help="K and V type of the budgeted runs (a quantized one: flash attention on); the full cache stays f16.",
)
@layouts_option(
    "Comma-separated layouts each policy runs in (shared, natural, uniform, pyramid, adaptive: the product's "
    'default on Gemma 3); a configuration is "<policy> <layout>@<budget>" outside the shared pool.',
)
@click.option("--out", "out_dir", default="eval-out", show_default=True, help="Folder for the outputs.")
@eval_rpc_option
@threads_option
def eval_ppl(
    model, text_file, tokens, prefix, budgets, policies, ablations, ablations_at, step, evict_every, observe_steps,
    sinks, recent, kv_type, layer_budgets, out_dir, rpc, threads,
) -> None:  # fmt: skip
    """Streaming perplexity, KL from the full cache and top-1 agreement per policy and budget; for a model with a
    sliding-window cache also llama.cpp's own baseline, every position kept in a trimmed sliding cache."""
    require("eval")  # here, not in the group: --help needs no extra
    from .evaluation import TRIMMED, check_floors, evaluate, text_tokens
    from .info import check_kv_types, read_info
    from .policies.ahakv import ABLATIONS
    from .report import write_ppl_report

    rpc_servers = parse_rpc(rpc)
    out = _out(out_dir, "ppl_vs_budget.png", (text_file,))
    from .budget import Budget, check_layer_kinds, parse_schedule
    from .session import SessionSpec

    names = _policies(policies)  # the user's own mistakes before the model is read
    if ablations and ablations_at:  # (--ablations-at was dropped: its rows ran at every budget, its own at none)
        raise AhakvError("give --ablations (at every budget) or --ablations-at (at these budgets), not both")
    for given in filter(None, (budgets, ablations_at)):  # their grammar now; their cells once the text's length is
        _cells(given, 1, 1)
    layouts = _layer_budgets(layer_budgets)
    evict_every, observe_steps = parse_schedule(evict_every, observe_steps)
    path = _model(model)
    ids = text_tokens(path, read_text(text_file))
    if min(len(ids), tokens) <= prefix + 1:
        what = f"--tokens {tokens}" if tokens < len(ids) else f"{text_file} has only {len(ids)} tokens"
        raise AhakvError(f"{what}; need more than --prefix {prefix} + 1")
    info = read_info(path)
    if kv_type in KV_CACHE_TYPES:  # (a row of 16 values as q8_0 was found once the bar had started)
        check_kv_types(info, kv_type, kv_type)
    read = min(tokens, len(ids))
    if info.n_ctx_train and read > info.n_ctx_train:  # (it failed there, after the full cache's whole run)
        raise AhakvError(
            f"{read} tokens of text are past the model's trained context of {info.n_ctx_train}: give --tokens "
            f"{info.n_ctx_train} or fewer"
        )
    if tokens > len(ids):  # the run goes on over the whole text, the report states its length (after every refusal)
        click.echo(f"--tokens {tokens}: {text_file} has {len(ids)} tokens; every one is read", err=True)
    ids = ids[:tokens]
    for layout in layouts:  # before the full cache's run, not after it
        check_layer_kinds(layout, info.n_layer_swa, info.n_layer)
    schedule = dict(
        n_sink=sinks, n_recent=recent, evict_every=evict_every, observe_steps=observe_steps, kv_type=kv_type
    )
    floor = sinks + recent + (step if step > 1 else evict_every or 1)  # a fraction of a short text: at least this
    cells = _cells(budgets, len(ids), floor)
    ablated = cells if ablations else _cells(ablations_at, len(ids), floor) if ablations_at else []
    _below_trained(cells + ablated, info.n_ctx_train)  # --ablations-at too: it ran "0.0x compression" rows
    if (most := max(cells + ablated)) >= len(ids):
        what = f"budget {most} cells"
        if most == floor and most not in (int(Budget.parse(b).value) for b in budgets.split(",")):
            # a fraction raised to the floor: "budget 305 cells" named a cell count nobody gave
            what = f"a fraction of the text holds at least sinks + recent + one period ({floor} cells), which"
        raise AhakvError(f"{what} holds the whole text ({len(ids)} tokens): nothing is evicted")
    # named specs: llama.cpp's trimmed full cache, every policy at every budget in every layout, then AhaKV without
    # each component
    configs = [TRIMMED] if info.n_layer_swa else []
    for c in dict.fromkeys(cells + ablated):
        runs = [(p, p, {}) for p in names] if c in cells else []
        runs += [(k, "ahakv", v) for k, v in ABLATIONS.items()] if c in ablated else []
        configs += [
            SessionSpec.bounded(
                p, c, label=f"{label}{'' if lay == 'shared' else ' ' + lay}@{c}", params=kw, layer_budgets=lay,
                **schedule,
            )
            for label, p, kw in runs
            for lay in layouts
        ]  # fmt: skip
    check_floors(path, len(ids), configs, step=step)  # (evaluate does too: here before the bar starts)
    _say_raised(",".join(filter(None, (budgets, ablations_at))), len(ids), floor)
    with _bar("eval ppl", len(ids) * (len(configs) + 1)) as bar:  # the full cache, then each alone
        results = evaluate(
            path,
            ids,
            configs,
            prefix=prefix,
            step=step,
            progress=_advance(bar),
            rpc_servers=rpc_servers,
            n_threads=threads,
        )
    settings = schedule | {"prefix": prefix, "layer_budgets": list(layouts)}  # which results.json keeps
    _print_report(lambda: write_ppl_report(out, results, path, text_file, len(ids), step, settings))


@eval_group.command("needle")
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@click.option("--filler", "filler_file", default=str(LICENSES / "GPL-3"), show_default=True, help="Filler text.")
@click.option("--lengths", default="1024,2048", show_default=True, help="Prompt lengths in tokens.")
@click.option("--depths", default="0.1,0.5,0.9", show_default=True, help="Where the key sits (fractions).")
@click.option("--budgets", default="256", show_default=True, help="Comma-separated cells.")
@policies_option
@click.option("--trials", type=TRIALS, default=1, show_default=True, help="Keys per length and depth.")
@click.option("--seed", default=0, show_default=True)
@sinks_option
@recent_option
@click.option("--out", "out_dir", default="needle-out", show_default=True, help="Folder for the outputs.")
@eval_rpc_option
@threads_option
def eval_needle(
    model, filler_file, lengths, depths, budgets, policies, trials, seed, sinks, recent, out_dir, rpc, threads
) -> None:
    """Passkey retrieval: a number hidden in filler text at several lengths and depths, per policy."""
    require("eval")  # here, not in the group: --help needs no extra
    from .needle import ANSWER_TOKENS as NEEDLE_ANSWER_TOKENS
    from .needle import run_needle
    from .report import write_needle_report

    rpc_servers = parse_rpc(rpc)
    names = _policies(policies)  # the options before the model is read (a missing default one is assembled first)
    lens, deps = _lengths_and_depths(lengths, depths)
    floor = sinks + recent + 1
    from .budget import Budget

    if any(Budget.parse(b).mode != "cells" for b in budgets.split(",")):  # (a fraction of the longest, at each)
        raise AhakvError("eval needle budgets are cells: for a share of each prompt, eval longdoc --compressions")
    cells = _cells(budgets, max(lens), floor)
    if min(cells) < floor:
        raise AhakvError(f"a budget is smaller than sinks + recent + newest ({floor})")
    out = _out(out_dir, None, (filler_file,))
    path = _model(model)
    filler = read_text(filler_file)
    if not filler.strip():  # (found once the model was loaded and the bar had started: "the filler text has 0 tokens")
        raise AhakvError(f"{filler_file} is empty: a needle is hidden in filler text")
    from .info import read_info

    trained = read_info(path).n_ctx_train
    _below_trained(cells, trained)
    if max(cells) >= max(lens):  # (as eval ppl refuses it: a row of the full cache under a budget's name)
        raise AhakvError(
            f"budget {max(cells)} cells holds every prompt ({max(lens)} tokens at most): nothing is evicted"
        )
    _lengths_fit(lens, NEEDLE_ANSWER_TOKENS, trained)
    from .session import SessionSpec

    schedule = dict(n_sink=sinks, n_recent=recent)
    configs = [SessionSpec()] + [SessionSpec.bounded(p, c, **schedule) for c in cells for p in names]
    with _bar("eval needle", len(configs) * len(lens) * len(deps) * trials, unit="trial") as bar:
        try:
            trials_ = run_needle(
                path,
                filler,
                lens,
                deps,
                configs,
                trials=trials,
                seed=seed,
                progress=_advance(bar),
                rpc_servers=rpc_servers,
                n_threads=threads,
            )
        except ValueError as exc:
            raise AhakvError(str(exc)) from None
    settings = dict(lengths=lens, depths=deps, budgets=cells, policies=names, trials=trials, seed=seed, **schedule)
    _print_report(lambda: write_needle_report(out, trials_, path, filler_file, settings))


def _say_unguided(names: list[str], readings: list[str]) -> None:
    """One line on stderr where a policy has no question score and so reads plainly in the guided modes asked for:
    its rows are then one plain row (``longdoc.specs_rule``), which a table otherwise showed without a word."""
    from .policies import make_policy

    guided = [r for r in readings if r in ("query", "reconstruct")]
    plain = [p for p in names if not make_policy(p).reads_with_query]
    if guided and plain:
        click.echo(
            f"--reading {','.join(guided)}: {', '.join(plain)} cannot be guided by a question; they read plainly "
            f"(one row each{'' if 'plain' in readings else ', labelled plain'})",
            err=True,
        )


@eval_group.command("longdoc")
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@click.option("--tasks", default="single,multikey,multivalue,vartrack,fact", show_default=True, help="Tasks.")
@click.option("--lengths", default="2048,4096", show_default=True, help="Prompt lengths in tokens.")
@click.option("--depths", default="0.1,0.5,0.9", show_default=True, help="Where the asked fact sits (fractions).")
@click.option(
    "--compressions",
    default="4,8",
    show_default=True,
    help="Tokens per kept cell: a budget of length / compression cells (the cache holds a prompt chunk of 64 more "
    "while it reads, and a guided reading the question's room too).",
)
@policies_option
@click.option(
    "--reading",
    default="plain,query,reconstruct",
    show_default=True,
    help="How the prompt is read: plain, query (guided by the question), reconstruct or surprisal (question-agnostic); "
    "a policy without a question score (streaming, h2o, scissorhands, random) reads plainly for query and reconstruct.",
)
@click.option("--trials", type=TRIALS, default=1, show_default=True, help="Items per task, length and depth.")
@click.option("--seed", default=0, show_default=True)
@click.option("--filler", "filler_files", multiple=True, help="Filler text (default: GPL-3, then other licenses).")
@sinks_option
@recent_option
@layouts_option(
    "Comma-separated layouts each configuration runs in (shared, natural, uniform, pyramid, adaptive); a "
    'configuration is "<policy>@<compression>[+<reading>] <layout>" outside the shared pool.',
)
@click.option("--out", "out_dir", default="longdoc-out", show_default=True, help="Folder for the outputs.")
@eval_rpc_option
@threads_option
def eval_longdoc(
    model, tasks, lengths, depths, compressions, policies, reading, trials, seed, filler_files, sinks, recent,
    layer_budgets, out_dir, rpc, threads,
) -> None:  # fmt: skip
    """Long documents (RULER-style, generated locally): retrieval, multi-key, multi-value, variable tracking
    and a fact, per policy, compression and reading mode, beside the full cache."""
    require("eval")  # here, not in the group: --help needs no extra
    from .longdoc import ANSWER_TOKENS, TASKS, default_filler_files, parse_compressions, run_longdoc, specs_rule
    from .report import write_longdoc_report

    rpc_servers = parse_rpc(rpc)
    task_list = list(dict.fromkeys(t.strip() for t in tasks.split(",") if t.strip()))
    unknown = [t for t in task_list if t not in TASKS]
    if unknown or not task_list:
        raise bad_value("--tasks", f"unknown task {','.join(unknown)!r}; choose from {', '.join(TASKS)}")
    readings = list(dict.fromkeys(r.strip() for r in reading.split(",") if r.strip()))
    from .budget import READINGS

    if not readings or any(r not in READINGS for r in readings):
        raise bad_value("--reading", f"{', '.join(READINGS)}, comma-separated, not {reading!r}")
    lens, deps = _lengths_and_depths(lengths, depths)
    try:
        factors = parse_compressions(compressions)
    except ValueError as exc:
        raise bad_value("--compressions", str(exc)) from None
    floor = sinks + recent + 1
    if any(int(n / c) < floor for n in lens for c in factors):
        raise AhakvError(f"a length / compression is smaller than sinks + recent + newest ({floor} cells)")
    names = _policies(policies)
    layouts = _layer_budgets(layer_budgets)
    from .budget import check_layer_kinds
    from .info import read_info

    out = _out(out_dir, "accuracy.png", tuple(filler_files))
    path = _model(model)
    info = read_info(path)
    trained = info.n_ctx_train
    for name in layouts:  # before the full cache's runs, not after them
        check_layer_kinds(name, info.n_layer_swa, info.n_layer)
    answer = max(ANSWER_TOKENS[t] for t in task_list)
    _lengths_fit(lens, answer, trained)
    files = [str(f) for f in filler_files] or [str(p) for p in default_filler_files()]
    texts = [read_text(f) for f in files]
    if not any(t.strip() for t in texts):  # (found once the bar had started: "the filler texts have 0 tokens")
        raise AhakvError(f"{', '.join(files)}: no text to fill the prompts with")
    rule = specs_rule(names, factors, readings, layouts, n_sink=sinks, n_recent=recent)
    n_items = len(task_list) * len(deps) * trials
    with _bar("eval longdoc", sum(len(rule(n)) for n in lens) * n_items, unit="trial") as bar:
        try:
            results = run_longdoc(
                path,
                rule,
                task_list,
                lens,
                deps,
                trials=trials,
                seed=seed,
                filler_texts=texts,
                progress=_advance(bar),
                rpc_servers=rpc_servers,
                n_threads=threads,
            )
        except ValueError as exc:
            raise AhakvError(str(exc)) from None
    _say_unguided(names, readings)  # after the run: an input found wrong in it (a short filler) stays one line
    settings = dict(tasks=task_list, lengths=lens, depths=deps, compressions=factors, readings=readings,
                    trials=trials, seed=seed, sinks=sinks, recent=recent, layer_budgets=layouts,
                    filler_files=files, threads=threads)  # fmt: skip
    filler = files[0] + (f" (then {len(files) - 1} more texts as a length needs)" if len(files) > 1 else "")
    _print_report(lambda: write_longdoc_report(out, results, path, filler, settings))


@click.group("bench")
def bench_group() -> None:
    """Measure what a budget buys in speed and memory."""


@bench_group.command("speed")
@click.argument("model", required=False, envvar="AHAKV_MODEL")
@click.option(
    "--text", "text_files", multiple=True, help="Text to read (default: every license in /usr/share/common-licenses)."
)
@click.option(
    "--budget",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Live cells for the side-by-side comparison.",
)
@policies_option
@click.option(
    "--decode-tokens",
    type=click.IntRange(min=2),
    default=64,
    show_default=True,
    help="Tokens generated per round (the first comes from the prompt's logits: at least 2).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Interleaved rounds (medians are reported).",
)
@evict_every_option("Decode steps between evictions (default: the product's).")
@observe_steps_option()
@layouts_option(
    "Comma-separated layouts each policy runs in (shared, natural, uniform, pyramid, adaptive); a row is "
    '"<policy> <layout>" outside the shared pool.',
)
@click.option(
    "--long-context",
    default="2048,4096,8192,16384,32768",
    show_default=True,
    help="Checkpoints of the long run, full cache vs budget (capped at the trained context; empty: skip).",
)
@click.option("--long-policy", default="ahakv", show_default=True)
@click.option(
    "--long-budget",
    default=None,
    help="The long run's budget: cells, or bytes like 8MiB (all caches' K+V; default: --budget cells).",
)
@click.option(
    "--memory-context",
    type=click.IntRange(min=1),
    default=None,
    help="Also state the KV memory each row allocates to read this many tokens (default: the trained context).",
)
@n_gpu_layers_option("Layers to offload to the GPU (-1: all), in every run alike.")
@click.option("--out", "out_dir", default="bench-out", show_default=True, help="Folder for the outputs.")
@threads_option
def bench_speed(
    model,
    text_files,
    budget,
    policies,
    decode_tokens,
    rounds,
    evict_every,
    observe_steps,
    layer_budgets,
    long_context,
    long_policy,
    long_budget,
    memory_context,
    n_gpu_layers,
    out_dir,
    threads,
) -> None:
    """Decode and prompt tokens/s: plain llama-cpp-python (swa_full, its default), plain llama.cpp with the
    sliding-window cache trimmed (swa_full off, as llama-server) and each policy at the same live cells; a long
    run to the trained context, full cache vs budget; KV memory of each, also at --memory-context tokens."""
    require("eval")  # here, not in the group: --help needs no extra
    from .bench import BATCH, SpeedSetup, engine_speed_at_budget, long_run, memory_at, speed_at_budget
    from .budget import parse_schedule
    from .evaluation import text_tokens
    from .info import read_info, reading_headers_once
    from .llama import product_layout
    from .report import write_speed_report
    from .session import SessionSpec

    out = _out(out_dir, "long_run.png", tuple(text_files))
    path = _model(model)
    names = _policies(policies)
    layouts = _layer_budgets(layer_budgets)
    try:
        long_points = [int(c) for c in long_context.split(",") if c.strip()]
    except ValueError:
        raise bad_value("--long-context", f"token counts, comma-separated, not {long_context!r}") from None
    if any(c < 1 for c in long_points):
        raise bad_value("--long-context", f"checkpoints of at least 1 token, not {long_context!r}")
    evict_every, observe = parse_schedule(evict_every, observe_steps)
    trained = read_info(path).n_ctx_train
    # every run's budget, policy and layout fail now, not after the baselines loaded or the speed tables ran: each
    # run opens the drop-in (n_ctx 512, chunks of BATCH), which reads 2x the budget and decodes past it
    if trained and 2 * budget + decode_tokens > trained:
        raise AhakvError(
            f"budget {budget} reads {2 * budget} tokens before it decodes {decode_tokens}: past the model's trained "
            f"context of {trained}; give a smaller --budget or --decode-tokens"
        )
    if trained and memory_context is not None and memory_context > trained:  # (it stated 24,414 MiB at 100M tokens)
        raise AhakvError(f"--memory-context {memory_context} is past the model's trained context of {trained}")
    specs = [
        SessionSpec.bounded(name, budget, evict_every=evict_every, observe_steps=observe, layer_budgets=layout)
        for name in names
        for layout in layouts
    ]
    if long_points:
        specs.append(
            SessionSpec.bounded(
                long_policy,
                long_budget or budget,
                evict_every=evict_every,
                observe_steps=observe,
                layer_budgets=product_layout(path, n_gpu_layers),  # the drop-in's, which the long run opens
                reading="query",  # as the drop-in reads by default: a guided reading's room on top of the budget
            )
        )
    with reading_headers_once():  # one read of the header for every check (each is ~45 ms on Gemma)
        for spec in specs:
            spec.check_drop_in(path, 512, BATCH, BATCH)
    files = list(text_files) or [str(p) for p in license_files("--text FILE")]
    ids = text_tokens(path, "\n".join(read_text(f) for f in files))
    setup = SpeedSetup(
        budget,
        tuple(names),
        layouts,
        decode_tokens=decode_tokens,
        rounds=rounds,
        evict_every=evict_every,
        observe_steps=observe,
        n_gpu_layers=n_gpu_layers,
        n_threads=threads,
    )
    if len(ids) < setup.tokens_needed:
        raise AhakvError(f"the text has {len(ids)} tokens; budget {budget} needs {setup.tokens_needed}")
    runs = rounds * (len(names) * len(layouts) + 2)
    with _bar("bench speed (generate)", runs) as bar:
        bar.unit = "run"
        app = speed_at_budget(path, ids, setup, progress=lambda _: bar.update(1))
    with _bar("bench speed (engine)", runs) as bar:
        bar.unit = "run"
        core = engine_speed_at_budget(path, ids, setup, progress=lambda _: bar.update(1))
    memory_context = memory_context or trained
    for rows in (app, core):
        memory_at(path, rows, memory_context, BATCH)  # the runs' n_ubatch
    settings = dataclasses.asdict(setup) | {"memory_context": memory_context}
    capped = sorted({min(c, trained - decode_tokens - 1) for c in long_points})
    checkpoints = [c for c in capped if c + decode_tokens <= len(ids)]
    if short := [c for c in capped if c not in checkpoints]:  # said, not dropped in silence
        click.echo(f"long run: checkpoints {short} need more than the text's {len(ids)} tokens: left out", err=True)
    long_rows = []
    if checkpoints:
        bars: dict[str, object] = {}

        def progress(label: str, n: int, total: int) -> None:
            bar = bars.get(label) or bars.setdefault(label, _bar(f"long run ({label})", total))
            bar.update(n - bar.n)

        long_rows = long_run(
            path,
            ids,
            checkpoints,
            long_budget or budget,
            long_policy,
            decode_tokens=decode_tokens,
            evict_every=evict_every,
            observe_steps=observe,
            n_gpu_layers=n_gpu_layers,
            progress=progress,
            n_threads=threads,
        )
        for bar in bars.values():
            bar.close()
    _print_report(lambda: write_speed_report(out, app, core, long_rows, path, files, settings))
