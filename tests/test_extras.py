"""Optional parts are extras: a command whose extra is missing says which pip command installs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ahakv_local.errors import AhakvError
from ahakv_local.extras import EXTRAS, require


def test_installed_extras_pass():
    for extra in EXTRAS:  # `make` installs every extra
        require(extra)


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_a_missing_extra_is_one_line(extra, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m: None if m == EXTRAS[extra][0] else real(m))
    with pytest.raises(AhakvError, match=rf"pip install 'ahakv-local\[{extra}\]'"):
        require(extra)


@pytest.mark.parametrize(("extra", "args"), [("eval", "['eval', 'ppl', '--tokens', '10']"), ("serve", "['serve']")])
def test_a_command_without_its_extra_is_one_line_from_the_cli(extra, args):
    # hide the extra's modules from a real process: they fail to import
    hidden = EXTRAS[extra]
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({hidden!r})); "
        "import importlib.util as u; f = u.find_spec; "
        f"u.find_spec = lambda m: None if m in {hidden!r} else f(m); "
        f"from ahakv_local.cli import main; main({args})"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: this needs the {extra!r} extra ({', '.join(hidden)} not installed): pip install 'ahakv-local[{extra}]'"
    ], proc.stderr


def _run_hidden(hidden: tuple[str, ...], args: list[str]) -> subprocess.CompletedProcess:
    """``ahakv-local ARGS`` in a process where these modules do not import (a pip install without them)."""
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({hidden!r})); "
        "import importlib.util as u; f = u.find_spec; "
        f"u.find_spec = lambda m: None if m in {hidden!r} else f(m); "
        f"from ahakv_local.cli import main; main({args!r})"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["eval", "ppl"], ["eval", "needle"], ["eval", "longdoc"], ["bench", "speed"]])
def test_a_command_s_help_needs_no_extra(args):
    """The eval and bench groups checked their extra before the subcommand read --help: help exited 1."""
    proc = _run_hidden(EXTRAS["eval"], [*args, "--help"])
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: ") and "--help" in proc.stdout, proc.stderr


@pytest.mark.parametrize(
    "args",
    [["chat", "{fixture}"], ["serve", "{fixture}", "--port", "1"], ["eval", "ppl", "{fixture}"], ["bench", "speed"]],
)
def test_a_command_before_the_engine_is_built_is_one_line(args, fixture_model):
    """A pip install without the engine: chat, serve, eval and bench imported llama_cpp on their way and ended in a
    ModuleNotFoundError traceback (generate said it in one line)."""
    proc = _run_hidden(("llama_cpp",), [a.format(fixture=fixture_model) for a in args])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: llama-cpp-python is not installed; run `ahakv-local build`"), lines[0]
