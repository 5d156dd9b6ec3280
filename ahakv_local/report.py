"""Evaluation and benchmark outputs: every figure with its configuration and provenance (results.json),
results.csv, a Markdown table (results.md) and PNG plots."""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import click

from .atomic import write_text
from .bench import LongRow, SpeedRow
from .errors import AhakvError
from .evaluation import PplResult
from .longdoc import LongdocTrial
from .longdoc import accuracy_table as longdoc_table
from .models import file_sha256
from .needle import NeedleTrial, accuracy_table


def invocation() -> dict:
    """The command that is writing a report and the value of each of its options, environment and defaults
    included (``-t`` from AHAKV_THREADS, ``--rpc`` from AHAKV_RPC): enough to run it again. Empty outside a
    command (a report written from Python)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return {}
    plain = lambda v: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v  # noqa: E731
    return {"command": ctx.command_path, "options": {k: plain(v) for k, v in sorted(ctx.params.items())}}


def provenance(model: Path, text: str, tokens: int, files: Sequence[str] | None = None) -> dict:
    """What a result was made with: the model and text (their sha256: a relative path names no file; ``files``: the
    text files where ``text`` is a description of them, not their comma-separated paths), the tokens, this package,
    and the engine installed, by its key and the patch series it was built from (the source tree's patches, edited
    without a rebuild, said what the engine did not run)."""
    from . import __version__
    from .build import installed_marker, patch_hash_of

    engine = installed_marker()  # (its library hashed once)
    texts = list(files) if files is not None else [t for t in text.split(",") if t] if text else []
    return invocation() | {
        "model": str(model),
        "model_sha256": file_sha256(model),
        "text": text,
        "text_sha256": {t: file_sha256(Path(t)) for t in texts if Path(t).is_file()},
        "tokens": tokens,
        "ahakv_local": __version__,
        "engine_key": (engine or {}).get("key"),
        "patch_sha256": patch_hash_of(engine),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# every figure a report writes (results.json's config names the one it wrote)
FIGURES = ("ppl_vs_budget.png", "accuracy.png", "long_run.png")
TABLES = ("results.json", "results.csv", "results.md")


def _report_config(out: Path) -> dict | None:
    """The config of the report of ours in ``out`` (its results.json's config has our provenance, or names the figure
    it wrote); None where there is none, or the results.json is someone else's."""
    try:
        config = json.loads((out / "results.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return config if isinstance(config, dict) and ("patch_sha256" in config or "figure" in config) else None


def check_outputs(out: Path, figure: str | None = None, inputs: tuple[str, ...] = ()) -> None:
    """Refuse, before a run, what its report (the tables and ``figure``) could not write or must not replace: a folder
    where one of its files goes (a traceback after the run, its results lost), a file of those names in a folder
    without a report of ours (a user's results.md was replaced), or one of the run's own ``inputs``
    (``--text notes/results.md --out notes``)."""
    names = TABLES + ((figure,) if figure else ())
    for name in names:
        if (out / name).is_dir():
            raise AhakvError(f"cannot write the outputs to {out}: {out / name} is a folder")
    # (realpath: Path.resolve raised RuntimeError on a loop of links, a traceback; reading the loop says it in a line)
    written = {os.path.realpath(out / name) for name in names}
    for given in inputs:
        if os.path.realpath(given) in written:
            raise AhakvError(f"{given} is an input of this run and a file its report writes: give another --out")
    if _report_config(out) is None:
        theirs = [name for name in names if (out / name).exists()]
    else:  # a report of ours: its tables, and the figure it wrote (a user's long_run.png beside it was replaced)
        theirs = [figure] if figure and (out / figure).exists() and figure not in _figures_before(out) else []
    if theirs:
        raise AhakvError(
            f"{out / theirs[0]} was not written by a report of ahakv-local: not replaced (give another --out)"
        )


def _figures_before(out: Path) -> tuple[str, ...]:
    """The figures the report already in ``out`` may have written: the one its results.json names; every one for a
    report of ours from before results.json named it (its config has our provenance, no "figure"); none for a folder
    without a report of ours (a file of the user's of the same name stays)."""
    config = _report_config(out)
    if config is None:
        return ()
    if "figure" not in config:
        return FIGURES
    named = config["figure"]
    return (named,) if named in FIGURES else ()


class ReportNotWritten(AhakvError):
    """A run's report that could not be written (a full disk, a folder gone); ``lines``: its Markdown table, which the
    command still prints, so that a finished run is not lost with its files."""

    def __init__(self, message: str, lines: list[str]):
        super().__init__(message)
        self.lines = lines


def _write(
    out: Path,
    meta: dict,
    rows: list[dict],
    fields: list[str],
    lines: list[str],
    figure: str | None = None,
    draw: Callable[[Path], object] | None = None,
) -> None:
    """results.json/.csv/.md under ``out``, and no figure but this run's (``figure``, which ``draw`` makes at the
    path it is given): a run into the folder of another command removes the figure that command's report wrote there
    (it described results no longer there), and nothing else. A file that cannot be written is a ReportNotWritten
    naming it (the run had ended in "cannot write: No space left on device", its table unprinted)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        for before in _figures_before(out):
            if before != figure:
                (out / before).unlink(missing_ok=True)
        if figure and draw:
            draw(out / figure)
        meta = meta | {"figure": figure}
        # each file whole or as it was (``atomic``): a run that failed on a full disk had emptied the last run's
        # report, and a link left in the folder was written through (a user's file overwritten with the CSV)
        write_text(out / "results.json", json.dumps({"config": meta, "results": rows}, indent=1))
        table = io.StringIO(newline="")
        writer = csv.DictWriter(table, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        # a NUL in a text (a random fixture's answer) as \x00: Python 3.10's csv cannot write it unescaped ("need to
        # escape, but no escapechar set"), where 3.11 writes it raw, and many CSV readers stop at it (results.json
        # holds the text as it was)
        writer.writerows({k: v.replace("\0", "\\x00") if isinstance(v, str) else v for k, v in r.items()} for r in rows)
        write_text(out / "results.csv", table.getvalue())
        write_text(out / "results.md", "\n".join(lines) + "\n")
    except OSError as exc:
        where = exc.filename or out
        raise ReportNotWritten(f"cannot write the report to {where}: {exc.strerror or exc}", lines) from None


def write_ppl_report(
    out: Path,
    results: dict[str, PplResult],
    model: Path,
    text: str,
    tokens: int,
    step: int = 1,
    settings: dict | None = None,
) -> list[str]:
    """results.json/.csv/.md and ppl_vs_budget.png under ``out``; return the Markdown table's lines. ``settings``: what
    else the run was made with (prefix, sinks, recent, schedule, K/V type, layouts), into results.json's config."""
    from .plots import plot_ppl

    meta = provenance(model, text, tokens) | {"step": step} | (settings or {})
    rows = [{"label": label, **asdict(r), "budget": str(r.budget)} for label, r in results.items()]
    full = results["full"].ppl
    lines = [
        f"# streaming perplexity: {model.name}, {tokens} tokens of {text}, {step} token(s) per step",
        "",
        "| configuration | budget | compression | ppl | vs full | KL (nats) | top-1 | KV MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        name = label.split("@")[0]
        lines.append(
            f"| {name} | {r.budget} | {r.budget.compression(tokens):.1f}x | {r.ppl:.3f} | "
            f"{100 * (r.ppl / full - 1):+.1f}% | {r.kl:.4f} | {r.top1:.3f} | {r.kv_bytes / 2**20:.2f} |"
        )
    fields = [
        "label",
        "policy",
        "budget",
        "tokens",
        "ppl",
        "kl",
        "top1",
        "max_cells",
        "kv_bytes",
        "seconds",
        "evict_every",
    ]
    title = f"{model.name}: {Path(text).name}, {tokens} tokens"
    _write(out, meta, rows, fields, lines, "ppl_vs_budget.png", lambda path: plot_ppl(results, tokens, path, title))
    return lines


def write_needle_report(
    out: Path, trials: list[NeedleTrial], model: Path, filler: str, settings: dict | None = None
) -> list[str]:
    """results.json/.csv/.md of the passkey trials; return the Markdown table's lines. ``settings``: what the run was
    made with (lengths, depths, budgets, policies, trials, seed, sinks, recent), into results.json's config."""
    meta = provenance(model, filler, max(t.length for t in trials)) | (settings or {})
    lines = [f"# passkey retrieval: {model.name}, filler {filler}", "", *accuracy_table(trials)]
    fields = ["label", "policy", "budget", "length", "depth", "key", "answer", "solved", "max_cells"]
    _write(out, meta, [asdict(t) | {"budget": str(t.budget)} for t in trials], fields, lines)
    return lines


def write_longdoc_report(
    out: Path, trials: list[LongdocTrial], model: Path, filler: str, settings: dict | None = None
) -> list[str]:
    """results.json/.csv/.md and accuracy.png of the long-document suite; return the Markdown lines."""
    from .plots import plot_longdoc

    settings = settings or {}
    # (filler: "GPL-3 (then 13 more texts as a length needs)", which hashed no file)
    meta = provenance(model, filler, max(t.length for t in trials), settings.get("filler_files")) | settings
    n = max(Counter((t.label, t.task, t.length) for t in trials).values())
    lines = [
        f"# long documents: {model.name}, filler {filler}",
        "",
        f"Mean score per configuration, task and prompt length ({n} item(s) each: depths x trials); "
        "a configuration is <policy>@<compression> (cells = length / compression) [+<reading>] "
        "[<layer budgets>, outside the shared pool].",
        "",
        *longdoc_table(trials),
    ]
    fields = [
        "label", "policy", "budget", "reading", "task", "length", "depth", "trial", "expected", "answer", "score",
        "solved", "peak_cells", "prompt_seconds", "layer_budgets",
    ]  # fmt: skip
    rows = [asdict(t) | {"budget": str(t.budget)} for t in trials]
    title = f"{model.name}: long documents, mean score"
    _write(out, meta, rows, fields, lines, "accuracy.png", lambda path: plot_longdoc(trials, path, title))
    return lines


def write_speed_report(
    out: Path,
    app: list[SpeedRow],
    core: list[SpeedRow],
    long: list[LongRow],
    model: Path,
    texts: list[str],
    settings: dict,
) -> list[str]:
    """results.json/.csv/.md and long_run.png under ``out``; return the Markdown lines."""
    from .plots import plot_long_run

    meta = provenance(model, ",".join(texts), max([r.context for r in long], default=0)) | settings
    rows = [{"table": "generate", **asdict(r)} for r in app] + [{"table": "engine", **asdict(r)} for r in core]
    rows += [{"table": "long", **asdict(r)} for r in long]
    at = settings.get("memory_context")
    lines = [
        f"# speed: {model.name}, budget {app[0].budget} cells",
        "",
        "plain: llama-cpp-python's default (swa_full: the sliding-window cache as large as the full one); trimmed: "
        "llama.cpp's own tools (swa_full off: window + one ubatch); both without the tap. Ratios: decode tok/s over "
        "the baseline's in the same round, the median over rounds (and the lowest and highest). KV MiB: allocated for "
        "this " + (f"run; at {at:,}: allocated to read {at:,} tokens." if at else "run."),
        "",
    ]
    for title, table in (("through Llama.generate (greedy)", app), ("engine only (llama_decode, no sampling)", core)):
        lines += [
            f"## {title}",
            "",
            "| run | live cells | prompt tok/s | decode tok/s | ratio to plain | ratio to trimmed (rounds) | KV MiB |"
            + (f" KV MiB at {at:,} |" if at else ""),
            "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if at else ""),
        ]
        lines += [
            f"| {r.label} | {r.live_cells:.0f} | {r.prompt_tps:.1f} | {r.decode_tps:.2f} | {r.ratio:.3f} | "
            f"{r.ratio_trimmed:.3f} ({r.ratio_trimmed_range[0]:.3f}-{r.ratio_trimmed_range[1]:.3f}) | "
            f"{r.kv_bytes / 2**20:.1f} |" + (f" {r.kv_bytes_at_context / 2**20:.1f} |" if at else "")
            for r in table
        ]
        lines.append("")
    if long:
        lines += [
            "## long run: full cache vs budget",
            "",
            "KV in use and allocated at each context: llama.cpp allocates the full and trimmed caches once, up front, "
            "for the run's last context (their rows are flat).",
            "",
            "| run | context | prompt tok/s | decode tok/s | KV in use MiB | KV allocated MiB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r.label}{f' ({r.layer_budgets})' if r.layer_budgets else ''} | {r.context} | {r.prompt_tps:.1f} | "
            f"{r.decode_tps:.2f} | {r.kv_bytes_used / 2**20:.1f} | "
            f"{r.kv_bytes_allocated / 2**20:.1f} |"
            for r in long
        ]
    fields = sorted({k for r in rows for k in r if k != "decode_runs"}, key=lambda k: (k != "table", k))
    title = f"{model.name}: full cache vs {long[0].label}" if long else ""
    _write(
        out, meta, rows, fields, lines, "long_run.png" if long else None, lambda path: plot_long_run(long, path, title)
    )
    return lines
