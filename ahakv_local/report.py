"""Evaluation outputs: every figure with its configuration, as JSON, CSV and a Markdown table."""

from __future__ import annotations

import csv
import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from .evaluation import PplResult


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def provenance(model: Path, text: str, tokens: int) -> dict:
    from . import __version__
    from .build import installed_key, plan

    return {
        "model": str(model),
        "model_sha256": file_sha256(model),
        "text": text,
        "tokens": tokens,
        "ahakv_local": __version__,
        "engine_key": installed_key(),
        "patch_sha256": plan().patch_hash,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_ppl_report(out: Path, results: dict[str, PplResult], model: Path, text: str, tokens: int) -> list[str]:
    """Write results.json/.csv/.md under ``out``; return the Markdown table's lines."""
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance(model, text, tokens)
    rows = [{"label": label, **asdict(r)} for label, r in results.items()]
    (out / "results.json").write_text(json.dumps({"config": meta, "results": rows}, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        fields = ["label", "policy", "budget", "tokens", "ppl", "kl", "top1", "max_cells", "seconds"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    full = results["full"].ppl
    lines = [
        f"# streaming perplexity: {model.name}, {tokens} tokens of {text}",
        "",
        "| policy | budget | ppl | vs full | KL (nats) | top-1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results.values():
        lines.append(
            f"| {r.policy} | {r.budget} | {r.ppl:.3f} | {100 * (r.ppl / full - 1):+.1f}% | {r.kl:.4f} | {r.top1:.3f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return lines
