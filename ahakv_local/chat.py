"""``ahakv-local chat``: a terminal chat that keeps the conversation in a bounded KV cache.

Each turn re-renders the conversation with the model's chat template; llama-cpp-python's prefix
match then finds the cached (compressed) history and only the new message is decoded. The system
prompt is pinned. Ctrl-C stops an answer; a second Ctrl-C (before the next answer) exits.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import click

from . import upstream
from .budget import room_short
from .errors import AhakvError
from .llama import Llama, Stopped
from .paths import cache_dir
from .policies import POLICIES, make_policy
from .saved_chat import load_chat, model_identity, save_chat
from .textfile import read_text, shown_name, typed_text

HELP = """commands:
  /help             this text
  /reset            forget the conversation (keeps the system prompt)
  /stats            cache and speed statistics
  /policy NAME      switch the eviction policy ({policies})
  /budget N|R|auto  change the budget (cells, a ratio like 0.25, or auto), up to the allocated cells;
                    KV bytes (8MiB) give the caches that size
  /read FILE        read a document into the conversation (compressed to the budget, for any question)
  /save FILE        save the conversation and its cache
  /load FILE        restore a conversation saved with /save
  /exit             quit (also Ctrl-D, or Ctrl-C twice)
A line ending in \\ continues on the next line; \"\"\" starts and ends a multi-line block (a message,
even where its first line starts with /).""".format(policies=", ".join(POLICIES))


@dataclass
class ChatSession:
    llm: Llama
    system: str | None
    max_tokens: int = 512
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0
    messages: list[dict] = field(default_factory=list)
    said: str = field(default="", init=False)  # the last answer's text, as far as it went
    cut_by_context: bool = field(default=False, init=False)  # the last answer ended at the context's end

    def __post_init__(self) -> None:
        self.reset()
        with contextlib.suppress(AhakvError):  # (the model's identity while its file is where it was loaded from)
            model_identity(self.llm)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.llm.reset()
        self.llm.reset_timings()  # (/stats after /reset showed the last conversation's prompt tokens and speeds)
        self._pin_system_prompt()

    def _pin_system_prompt(self) -> None:
        """Pin the tokens that render the system prompt (none without one: a pin left from another system prompt, a
        loaded chat's, would keep the user's first tokens)."""
        kv = self.llm.kv_controller
        if kv is not None:
            kv.config.pinned = self._system_span(self.system)

    def _system_span(self, system: str | None) -> tuple[int, int] | None:
        """The tokens that render ``system``: the common prefix of two renderings that differ only in the user's
        message; checked to fit the budget beside the sinks and the recent tokens (nothing is changed)."""
        kv = self.llm.kv_controller
        if kv is None or not system:
            return None
        only = [{"role": "system", "content": system}]  # only the system prompt, whatever follows it
        a, b = (self._prompt_tokens(only + [{"role": "user", "content": x}]) for x in ("A", "B"))
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        pinned = kv.config.pinned
        kv.config.pinned = (0, n)
        try:  # never evicted: the budget must hold it beside the sinks and the recent tokens (a ratio: and a chunk)
            kv.check_floor(kv.config.budget)
            kv.fitted(kv.config.budget)
        except AhakvError as exc:
            raise AhakvError(f"the system prompt is {n} tokens, kept whole: {exc}") from None
        finally:
            kv.config.pinned = pinned
        return (0, n)

    def _prompt_tokens(self, messages: list[dict], generation_prompt: bool = True) -> list[int]:
        """The tokens the chat handler would decode for ``messages`` (the GGUF's own template, or a transcript)."""
        return upstream.chat_prompt_tokens(self.llm, messages, generation_prompt)

    def answer(self, text: str, out, stop=lambda: False) -> str:
        """Stream the reply to ``text`` until it ends or ``stop()`` says so; what was said is kept.
        A message the model refuses before answering (longer than its context) is taken back, so it
        does not make every later turn fail."""
        self.messages.append({"role": "user", "content": text})
        self.llm.reset_timings()
        self.llm.should_stop = stop  # a long message is read in chunks: a first Ctrl-C stops between two of them
        reply: list[str] | None = []
        self.cut_by_context = False
        try:
            stream = self.llm.create_chat_completion(
                messages=self.messages,
                stream=True,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                seed=self.seed,
            )
            for chunk in stream:
                piece = chunk["choices"][0]["delta"].get("content") or ""
                # "length" before max_tokens: llama-cpp-python cut the answer to the context, silently
                if chunk["choices"][0].get("finish_reason") == "length":
                    self.cut_by_context = self.llm.kv_stats().sampled_tokens < self.max_tokens
                reply.append(piece)
                out.write(piece)
                out.flush()
                if stop():
                    stream.close()  # between two decodes: the cache and the history stay consistent
                    break
        except Stopped:
            if "".join(reply):  # stopped just before the next token's decode: an answer stopped like any other
                return "".join(reply)
            self.messages.pop()  # stopped while the message was read: taken back, as if never sent
            reply = None
            if self.llm.kv_controller is not None:
                # the chunks read of it were compressed, evicting history for a message that is not sent, and their
                # rows are in the policy's statistics: the history is read again with the next message, as after a
                # stopped /read (the next answer differed from a fresh chat's, half the budget's history gone)
                self.llm.reset()
            raise
        except (AhakvError, ValueError):
            if not "".join(reply):
                self.messages.pop()  # nothing was answered: the conversation is as before this message
                reply = None
            raise
        finally:
            self.llm.should_stop = lambda: False
            self.said = "".join(reply or [])
            if reply is not None:  # what was said stays, also when a second Ctrl-C ends the chat
                self.messages.append({"role": "assistant", "content": "".join(reply)})
        return "".join(reply)

    def fits_alone(self, text: str) -> bool:
        """Whether ``text`` alone fits the model's trained context (else no conversation could take it)."""
        return len(self.llm.tokenize(text.encode("utf-8"), add_bos=False)) < self.llm.n_ctx()

    def stats_line(self) -> str:
        s = self.llm.kv_stats()
        budget = s.budget if s.budget is not None else "-"
        return (
            f"[prompt {s.prompt_tps:.1f} t/s | gen {s.generation_tps:.1f} t/s | "
            f"cache {s.cells_used}/{budget} cells of {s.kv_cells} | seen {s.tokens_seen} | evicted {s.evicted}]"
        )

    def stats_report(self) -> str:
        s = self.llm.kv_stats()
        kv = self.llm.kv_controller
        lines = []
        for k, v in s.as_dict().items():
            if k == "kv_kind_bytes":
                kinds = ", ".join(
                    f"{kind} {kv_size(u)} of {kv_size(a)} ({n} cache{'s' * (n > 1)})" for kind, (a, u, n) in v.items()
                )
                lines.append(f"{'kv by kind':18s} {kinds or '-'} (used of allocated)")
            elif k == "kv_group_bytes":  # one line a group, by layer (the caches come full-attention ones first)
                if not v:  # (a chat without a budget: a header over no rows)
                    continue
                lines.append(f"{'kv by group':18s} used of allocated")
                lines += [
                    f"  {name:16s} {kv_size(u)} of {kv_size(a)}" for name, (a, u) in sorted(v.items(), key=_by_layer)
                ]
            elif k == "kv_bytes":
                lines.append(f"{k:18s} {v} ({kv_size(v)})")
            elif v is None:  # (auto's budget before its first decision, as the stats line shows it)
                lines.append(f"{k:18s} -")
            else:
                lines.append(f"{k:18s} {v:.3f}" if isinstance(v, float) else f"{k:18s} {v}")
        if kv is not None:
            lines.insert(0, f"{'policy':18s} {kv.policy.name}")
            lines.insert(1, f"{'budget mode':18s} {kv.config.budget}")
            if kv.stats.retained_mass:
                mass = ", ".join(f"{m:.3f}" for m in kv.stats.retained_mass)
                lines.append(f"{'retained mass':18s} per layer: {mass}")
        return "\n".join(lines)

    # -- commands -----------------------------------------------------------------------------------

    def set_policy(self, name: str) -> str:
        kv = self._controller()
        kv.set_policy(make_policy(name))
        return f"policy: {name} (its statistics start now)"

    def set_budget(self, text: str) -> str:
        kv = self._controller()
        b = kv.config.budget.parsed(text)
        before = kv.engine.kv_bytes()
        # checks the floor, the allocated cells and the policy's capability; bytes re-size the caches to them
        evicted = kv.set_budget(b, resize=True)
        now = kv.engine.kv_bytes()
        caches = f", KV caches {kv_size(before)} -> {kv_size(now)}" if now != before else ""
        return f"budget: {kv.config.budget} (evicted {evicted} now{caches})"  # a ratio: at most what the cache holds

    def _controller(self):
        if self.llm.kv_controller is None:
            raise AhakvError("this chat runs without a budget (start it with --budget)")
        return self.llm.kv_controller

    def save(self, path: Path) -> str:
        save_chat(path, self.llm, self.messages, self.system)
        return f"saved {len(self.messages)} messages and {self.llm.kv_stats().cells_used} cached tokens to {path}"

    def load(self, path: Path) -> str:
        """Restore a chat saved with /save; a file that is not one (or of another model) changes nothing."""
        kv = self.llm.kv_controller
        before = kv.config.pinned if kv is not None else None

        def accept(system: str | None) -> None:
            # the loaded system prompt's span, checked before the cache is touched and pinned while the loaded cache
            # is held to this chat's budget (pinned after it, its tokens were the oldest, the first evicted)
            span = self._system_span(system)
            if kv is not None:
                kv.config.pinned = span

        try:
            messages, system, policy = load_chat(path, self.llm, accept=accept)
        except BaseException:
            if kv is not None:
                kv.config.pinned = before
            raise
        keep_transcript(self)  # the conversation it replaces, as on exit (it was lost when not /save'd first)
        self.messages, self.system = messages, system
        said = f"loaded {len(messages)} messages, {self.llm.kv_stats().cells_used} cached tokens"
        if kv is not None and policy in POLICIES and policy != kv.policy.name:  # (the file's was said nowhere)
            said += f" (saved under {policy}: this chat goes on with {kv.policy.name}; /policy {policy} to switch)"
        return said

    def read_document(self, path: Path, stop: Callable[[], bool] = lambda: False) -> str:
        """Put a document into the conversation now, before any question about it: it is read through the
        bounded cache question-agnostically (reconstruction, or surprisal for a policy no question can guide), so
        what is kept serves the questions to come. ``stop()`` ends the reading between two chunks (a first Ctrl-C):
        the document is then not added, and the conversation is as before."""
        if path.exists() and not path.is_dir() and not path.is_file():  # (a folder: read_text's own line)
            # a named pipe without a writer blocked the chat in open(), where a first Ctrl-C cannot stop it
            raise AhakvError(f"cannot read {path}: not a regular file (a pipe or a device)")
        text, name = read_text(path), shown_name(path)
        if not text.strip():
            raise AhakvError(f"{path} is empty")
        added = [
            {"role": "user", "content": f"Here is a document, {name}:\n\n{text}"},
            {"role": "assistant", "content": f"I have read {name}. What would you like to know?"},
        ]
        llm = self.llm
        tokens = self._prompt_tokens(self.messages + added, generation_prompt=False)  # the next message extends it
        n = llm.n_tokens
        if n and list(llm.input_ids[:n]) != tokens[:n]:  # the cache does not hold this history: read it all
            llm.reset()
            n = 0
        if (kv := llm.kv_controller) is not None:
            # a policy no question can guide reads it by surprisal (any policy can): better than plainly at 4x
            # (benchmarks/RESULTS.md, issue 12), the reconstruction stays for the others (better at 8x) where the caches
            # keep its repetition's room (the chat opens them so: kv_reuse_compressed; a Llama opened for questions
            # would refuse it)
            room = room_short("reconstruct", kv.engine.config.n_ubatch, kv.config.room) is None
            llm.set_kv_query("reconstruct" if kv.policy.reads_with_query and room else "surprisal")
        llm.should_stop = stop
        try:
            llm.eval(tokens[n:])
        except (AhakvError, ValueError, Stopped) as exc:
            if llm.n_tokens != n:  # read in part (compressed for it): the history is read again with the next message
                llm.reset()  # (a document refused before any of it was read left the cache as it was)
            if isinstance(exc, Stopped):
                raise AhakvError(f"/read stopped: {name} was not added") from None
            # a document past the trained context is the user's, not a bug
            raise AhakvError(str(exc) + full_context_hint(self, str(exc), added[0]["content"])) from None
        finally:
            llm.should_stop = lambda: False
            llm.set_kv_query(False)
        self.messages += added
        s = llm.kv_stats()
        return f"read {name}: {len(tokens) - n} tokens, {s.cells_used} cells kept of {s.tokens_seen} seen"

    def transcript(self) -> str:
        return json.dumps(self.messages, indent=1, ensure_ascii=False)


def full_context_hint(session: ChatSession, error: str, text: str) -> str:
    """What to do where a message failed because the conversation filled the positions it may take (the model's trained
    context, or without a budget the context asked for with -c), not because the message alone is too long."""
    if session.llm.n_tokens == 0 or not session.fits_alone(text):
        return ""
    if "trained context" in error:
        return " (this conversation is as long as the model reads: /save it, then /reset)"
    if "exceed context window" in error:  # (llama-cpp-python's words, the full cache's)
        return " (this conversation fills the context: /save it, then /reset, or open the chat with a larger -c)"
    return ""


class Typed(NamedTuple):
    text: str
    block: bool  # typed between two \"\"\" lines: a message, whatever its first line looks like
    lines: int  # lines typed (a continued line counts each): a /command is one line


def read_message(prompt: str) -> Typed:
    """One message: lines ending in a backslash continue; a \"\"\" line opens and closes a block. The input's end
    inside a block or after a backslash ends the message there (what was typed is sent, not dropped); prompts are
    shown to a terminal only (``chat < questions > answers`` keeps them out of the answers)."""
    if sys.stdin is None:  # closed (`<&-`): as the input's end
        raise EOFError
    more = "... " if sys.stdin.isatty() else ""

    def line(shown: str) -> str:
        # a line of CRLF input keeps its \r in input(): it went to the model, and a continued line ending "\\\r" ended
        return input(shown).removesuffix("\r")

    first = line(prompt if more else "")
    if first.strip() == '"""':
        lines = []
        with contextlib.suppress(EOFError):
            while (typed := line(more)).strip() != '"""':
                lines.append(typed)
        return Typed("\n".join(lines), block=True, lines=len(lines))
    lines = [first]
    with contextlib.suppress(EOFError):
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(line(more))
    return Typed("\n".join(lines), block=False, lines=len(lines))


def setup_history() -> None:
    try:
        import readline
    except ImportError:  # no readline (Windows): plain input
        return
    try:
        history = cache_dir() / "chat_history"
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists() and not history.is_file():  # (a FIFO: the chat waited in open() before its banner)
            return  # not ours: neither read nor written
        readline.read_history_file(history)
    except AhakvError:  # no cache folder at all (no home): the chat goes on without a history
        return
    except OSError:  # none yet, or a cache folder that cannot hold one: the chat goes on without it
        pass
    readline.set_history_length(1000)
    import atexit

    def keep() -> None:
        with contextlib.suppress(OSError):
            readline.write_history_file(history)

    atexit.register(keep)


def run_chat(session: ChatSession) -> None:
    with ExitOnHangup():
        try:
            _repl(session)
        finally:
            # the chat is ending: a Ctrl-C pressed on (a key held down) must not cut the transcript's writing short (one
            # landing in it kept no file, or printed a traceback)
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                keep_transcript(session)
            finally:
                signal.signal(signal.SIGINT, previous)


def keep_transcript(session: ChatSession) -> None:
    """Every conversation is written out on exit, so quitting never loses one."""
    if not any(m["role"] == "user" for m in session.messages):
        return
    text = session.transcript()
    stamp = time.strftime("chat-%Y%m%d-%H%M%S")
    try:
        folder = cache_dir() / "chats"
    except AhakvError as exc:
        click.echo(f"error: cannot keep the conversation: {exc}; here it is:", err=True)
        click.echo(text, err=True)
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):  # two chats ending in the same second each keep their own file
            path = folder / (f"{stamp}.json" if n == 1 else f"{stamp}-{n}.json")
            try:
                with path.open("x", encoding="utf-8") as f:
                    try:
                        f.write(text)
                        f.flush()
                    except OSError:
                        path.unlink(missing_ok=True)  # an empty file named like a transcript (a full disk) misleads
                        raise
                break
            except FileExistsError:
                continue
    except OSError as exc:  # no file to keep it in: the terminal gets it instead
        click.echo(f"error: cannot keep the conversation in {folder}: {exc.strerror or exc}; here it is:", err=True)
        click.echo(text, err=True)
        return
    click.echo(f"conversation saved to {path}", err=True)


# a Ctrl-C at the prompt this soon after one stopped an answer or a /read is the second of "twice to quit"; later, it
# warns first (a Ctrl-C minutes after a stopped answer, to clear a half-typed line, quit the chat)
QUIT_WINDOW = 2.0  # seconds


def _repl(session: ChatSession) -> None:
    out = sys.stdout
    setup_history()
    click.echo("ahakv-local chat - /help for commands, Ctrl-C stops an answer, twice to quit", err=True)
    warned, stopped_at = False, None  # the prompt said "again to quit"; when a Ctrl-C last stopped an answer
    while True:
        try:
            text, block, lines = read_message("> ")
        except EOFError:
            click.echo(err=True)  # (to the terminal: `chat < questions > answers` got an empty last line)
            return
        except KeyboardInterrupt:
            if warned or (stopped_at is not None and time.monotonic() - stopped_at < QUIT_WINDOW):
                click.echo(err=True)
                return
            warned = True
            click.echo("\n(Ctrl-C again to quit, or /exit)", err=True)
            continue
        warned, stopped_at = False, None
        if not text.strip():
            continue
        if text.startswith("/") and not block:  # (a block's "/etc/hosts maps names ..." is a message)
            stop = None
            cmd, _, arg = text.strip().partition(" ")
            cmd = cmd.lower()  # ("/HELP" was an unknown command)
            try:
                if lines > 1:  # "/save notes\" and "for monday.chat": a file name with a newline in it
                    raise AhakvError(f"{cmd} takes one line: a line ending in \\ continues a message, not a command")
                if cmd in ("/exit", "/quit"):
                    return
                with StopOnInterrupt() as stop:  # the first Ctrl-C stops a /read, a second one exits
                    msg = command(session, cmd, arg.strip(), stop)
            except AhakvError as exc:
                msg = f"error: {exc}"
            except Exception as exc:  # a bug must not end the session and lose the conversation
                msg = f"error: {cmd} failed: {exc.__class__.__name__}: {exc}"
            if stop is not None and stop():  # (a stopped /read is an error line: a Ctrl-C after it warned, not quit)
                stopped_at = time.monotonic()
            click.echo(msg, err=True)
            continue
        try:  # a terminal's bytes that are not UTF-8 (Python hands them on as surrogates; a command's file name may
            text = typed_text(text, "this message")  # have them): one line, nothing sent
        except AhakvError as exc:
            click.echo(f"error: {exc}", err=True)
            continue
        t0 = time.perf_counter()
        # the first Ctrl-C stops the answer, a second one exits; to the stats line, so that one landing as the answer
        # ends is a first one too (it quit the chat there)
        with StopOnInterrupt() as stop:
            stopped = "[answer stopped]"
            try:
                session.answer(text, out, stop)
            except Stopped:
                stopped = "[stopped while reading the message: not sent]"
            except (AhakvError, ValueError) as exc:  # e.g. the trained context is full
                # positions never shift: a conversation that reached the model's trained context goes no further,
                # and one without a budget none past its context (-c). Nothing was sent: one line, as a message
                # that is not UTF-8 (a stats line of "0.0 t/s" and an empty line in the answers followed it)
                if session.said:  # (part of an answer was written: its line ends)
                    out.write("\n")
                    out.flush()
                click.echo(f"error: {exc}{full_context_hint(session, str(exc), text)}", err=True)
                if stop():
                    stopped_at = time.monotonic()
                continue
            out.write("\n")
            out.flush()
            if stop():
                click.echo(stopped, err=True)
                stopped_at = time.monotonic()
            elif session.cut_by_context:  # (the answer stopped mid-sentence, and nothing said why)
                hint = full_context_hint(session, "exceed context window", text) or " (/save it, then /reset)"
                click.echo(f"[the context is full: the answer stops here{hint}]", err=True)
            click.echo(session.stats_line() + f" {time.perf_counter() - t0:.1f} s", err=True)


def kv_size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"  # (a test model's caches are KiB)


def _by_layer(item: tuple[str, object]) -> tuple[int, str]:
    """Sort key of a KV group's name: "layer 12" by its number, the others ("full", "sliding", "shared") first."""
    kind, _, number = item[0].partition(" ")
    return (int(number) if kind == "layer" and number.isdigit() else -1, item[0])


def command(session: ChatSession, cmd: str, arg: str, stop: Callable[[], bool] = lambda: False) -> str:
    """Run one /command; ``stop()`` (a first Ctrl-C) ends a long one, /read, early. A file name may be quoted."""
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "'\"":  # a file name quoted (a terminal's drag and drop)
        arg = arg[1:-1]
    if cmd in ("/help", "/reset", "/stats") and arg:  # ("/reset please" cleared the conversation)
        raise AhakvError(f"{cmd} takes no argument")
    if cmd == "/help":
        return HELP
    if cmd == "/reset":
        keep_transcript(session)  # as on exit and before a /load: the conversation it clears was lost
        session.reset()
        return "conversation cleared"
    if cmd == "/stats":
        return session.stats_report()
    if cmd == "/policy":
        if not arg and session.llm.kv_controller is None:
            return "policy: full (this chat runs without a budget)"
        return session.set_policy(arg) if arg else f"policy: {session._controller().policy.name}"
    if cmd == "/budget":
        return session.set_budget(arg) if arg else f"budget: {session._controller().config.budget}"
    if cmd == "/read":
        if not arg:
            raise AhakvError("usage: /read FILE")
        return session.read_document(Path(os.path.expanduser(arg)), stop)
    if cmd in ("/save", "/load"):
        if not arg:
            raise AhakvError(f"usage: {cmd} FILE")
        path = Path(os.path.expanduser(arg))
        return session.save(path) if cmd == "/save" else session.load(path)
    raise AhakvError(f"unknown command {cmd} (/help lists them)")


class StopOnInterrupt:
    """While active, the first SIGINT only raises a flag (checked between two tokens); a second one
    raises KeyboardInterrupt as usual."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> bool:
        return self.count > 0

    def _handler(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def __enter__(self) -> StopOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


class ExitOnHangup:
    """SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) end the chat like /exit: Python's
    default would kill the process without running ``finally``, losing the transcript."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

    def _handler(self, signum, frame) -> None:
        raise SystemExit(128 + signum)

    def __enter__(self) -> ExitOnHangup:
        self._previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def install_sigint_default() -> None:
    # Python raises KeyboardInterrupt on SIGINT only with the default handler; make sure it is there
    signal.signal(signal.SIGINT, signal.default_int_handler)
