"""One Markdown table from the outputs of benchmarks/gpu_check.sh: the machine, every step's exit code and
time, the device tests (passed / failed / skipped and why each failure failed), the tap overhead and the
decode speeds of `bench speed` with every layer offloaded.

    python benchmarks/gpu_summary.py OUT     (OUT: the folder gpu_check.sh wrote)
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def steps(out: Path) -> dict[str, tuple[int, int]]:
    """step -> (exit code, seconds), from steps.tsv."""
    rows = {}
    for line in (out / "steps.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        rows[name] = (int(rc), int(seconds))
    return rows


def test_row(xml: Path) -> tuple[str, str]:
    """(counts, the first line of every failure) of one pytest junit file."""
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    counts = f"{n - failed - errors - skipped} passed, {failed + errors} failed, {skipped} skipped"
    notes = []
    for case in suite.iter("testcase"):
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is None:
                continue
            message = (node.get("message") or node.text or "").strip().splitlines()
            first = next((ln for ln in message if ln.strip()), "")
            what = "skipped" if kind == "skipped" else "FAILED"
            if kind != "skipped" or not any("skipped" in x for x in notes):  # one skip reason is enough
                notes.append(f"{what} {case.get('name')}: {first[:160]}")
    return counts, "<br>".join(notes)


def main() -> None:
    out = Path(sys.argv[1])
    ran = steps(out)
    print("# device check")
    print()
    for line in (out / "machine.txt").read_text().splitlines():
        print(f"- {line}")
    print()
    print("| check | result | seconds | detail |")
    print("|---|---|---:|---|")
    for name, (rc, seconds) in ran.items():
        xml = out / f"{name}.xml"
        if xml.exists():
            counts, notes = test_row(xml)
            print(f"| {name} | {counts} | {seconds} | {notes} |")
        elif name == "tap_overhead" and rc == 0:
            tap = json.loads((out / "tap_overhead.json").read_text())
            detail = "; ".join(
                f"{r['config']}: {r['median_tps']:.1f} tok/s ({r['ratio_to_off']:.3f}x)" for r in tap["rows"]
            )
            print(f"| tap overhead, {tap['context']} context, decode | ok | {seconds} | {detail} |")
        elif name == "bench_speed" and rc == 0:
            bench = json.loads((out / "bench" / "results.json").read_text())["results"]
            for table in ("generate", "engine", "long"):
                rows = [r for r in bench if r["table"] == table]
                if table == "long":
                    detail = "; ".join(f"{r['label']} @{r['context']}: {r['decode_tps']:.2f} tok/s" for r in rows)
                else:
                    detail = "; ".join(f"{r['label']}: {r['decode_tps']:.2f} tok/s ({r['ratio']:.3f}x)" for r in rows)
                print(f"| bench speed ({table}), decode | ok | {seconds if table == 'generate' else ''} | {detail} |")
        else:
            log = {"tap_overhead": "tap_overhead.md", "bench_speed": "bench_speed.txt"}.get(name, f"{name}.txt")
            lines = [ln for ln in (out / log).read_text(errors="replace").splitlines() if ln.strip()]
            print(f"| {name} | {'ok' if rc == 0 else f'exit {rc}'} | {seconds} | {(lines or [''])[-1][:200]} |")


if __name__ == "__main__":
    main()
