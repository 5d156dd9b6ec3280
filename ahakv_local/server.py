"""``ahakv-local serve``: an OpenAI-compatible HTTP server over one bounded-cache ``Llama``.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (``stream: true`` sends
server-sent events, ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the token
counts before it), GET /v1/kv/stats, GET /health (200 when the model is
free, 503 while a request holds it). Besides the OpenAI fields a request may carry ``kv_budget`` and
``kv_policy``; they apply to that request only and are checked together before anything changes. ``kv_query``
is the question a prompt longer than the budget is read with (see ``Llama``'s ``kv_query``).

One request runs at a time. Each is a Job that one worker thread runs from start to end: wait for the
model (503 after ``busy_timeout``), check and apply its settings, generate, restore the server's settings
and release the model - on every exit path. With ``--parallel N`` (``ParallelRunner``) N requests run at
once, each in a sequence slot of one context (parallel.py): one scheduler thread reads each new prompt into
a free slot and decodes one token for every running request per llama_decode; ``/v1/kv/stats`` then
reports every sequence. The generation stops at the next token when the client
leaves, streamed or not, and when the server is told to stop. ``max_tokens`` 0, null or above
``max_tokens_limit`` (``--max-tokens-limit``) generates at most that limit. Every error is an
OpenAI-shaped JSON body: 400 for a bad request, 503 when busy, 500 only for a bug. An OpenAI field that asks for
something this server does not do (``NOT_SUPPORTED``: several choices, log probabilities, tools, a completion's JSON
format...) is a 400 naming it, not ignored: the client would take the answer for what it asked. A chat's
``response_format`` JSON (of a schema) is sampled under llama-cpp-python's grammar (``ResponseFormat``; not with
``--parallel``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from .budget import Budget, check_room
from .errors import AhakvError
from .llama import Llama, Stopped, llama_response_format
from .parallel import RANDOM_SEED, Generation, Sampling, SequencePool, prompt_of
from .policies import Policy, make_policy, query_readers
from .session import check_kv_query
from .stream_text import stop_strings

log = logging.getLogger("ahakv_local.server")

GRACE_S = 3  # after a stop signal, how long open responses get to finish (a prompt being read cannot be cut)


# OpenAI fields that ask for what this server does not do: field -> (whether a value asks for nothing, what the
# server does instead). A request asking for one is refused; one that sends the field switched off (n 1, logprobs
# null, tool_choice "none", response_format text, as some clients always do) is served.
NOT_SUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v is None or v == 1, "one choice per request"),
    "best_of": (lambda v: v is None or v == 1, "one choice per request"),
    "echo": (lambda v: v is None or v is False, "the answer without the prompt"),
    "logprobs": (lambda v: v is None or v is False, "no log probabilities"),
    "top_logprobs": (lambda v: v is None or v == 0, "no log probabilities"),
    "logit_bias": (lambda v: not v, "no biased logits"),
    "suffix": (lambda v: not v, "no insertion"),
    "tools": (lambda v: not v, "no tool calls"),
    "functions": (lambda v: not v, "no function calls"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "no tool calls"),
    "function_call": (lambda v: v in (None, "none", "auto"), "no function calls"),
    # a completion's (a chat's is a field: ChatRequest.response_format)
    "response_format": (lambda v: v is None or v == {"type": "text"}, "plain text, not a JSON format"),
    # llama-cpp-python's own server takes these too
    "grammar": (lambda v: not v, "no GBNF grammar (a chat's response_format samples a JSON schema)"),
    "mirostat_mode": (lambda v: v in (None, 0), "no mirostat sampling"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # as the top level's ("include_usage": "yes" was true)
    include_usage: bool = False  # a last chunk, before [DONE], with no choice and the request's token counts


NULL_IS_DEFAULT = (
    "stream", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p", "typical_p",
    "repeat_penalty",
)  # fmt: skip


KV_FIELDS = ("kv_budget", "kv_policy", "kv_query")  # a request's own settings of the bounded cache


class KVFields(BaseModel):
    # other OpenAI fields (user, metadata, ...) change nothing in the answer: accepted and ignored; NaN and
    # infinities (Python's JSON reader takes them) are refused, and so is a value of another JSON type ("stream": "yes",
    # "max_tokens": "5"), as OpenAI refuses it; a whole number is a number
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    model: str | None = None
    # null is the default, as OpenAI takes it (its clients send null for a None they were given)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # 0 or null: up to the server's limit; left out, llama-cpp-python's server's (and OpenAI's) defaults: a chat's
    # answer up to the limit, a completion 16 tokens (``CompletionRequest``); both were 256
    max_tokens: int | None = Field(None, ge=0)
    # OpenAI's newer name for max_tokens (its clients send only this one now): the same, and refused with another
    # max_tokens
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(0.8, ge=0, le=2)  # OpenAI's ranges
    top_p: float | None = Field(0.95, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    # llama-cpp-python's sampling fields (its server takes them; they were accepted and ignored), at its defaults
    top_k: int | None = Field(40, ge=0)  # 0: every token
    min_p: float | None = Field(0.05, ge=0, le=1)
    typical_p: float | None = Field(1.0, gt=0, le=1)
    repeat_penalty: float | None = Field(1.0, gt=0)
    kv_budget: int | float | str | None = None
    kv_policy: str | None = None
    # the question a prompt longer than the budget is read with: text, true (chat: the last user message;
    # completion: the prompt's last paragraph), false (plainly), "reconstruct" or "surprisal" (no question);
    # null: the server's default
    kv_query: bool | str | None = None

    @field_validator("max_tokens", "max_completion_tokens", "seed", "top_k", mode="before")
    @classmethod
    def _whole_floats(cls, value):
        """A whole number written as a float (Python's json writes ``2.0`` for ``float(2)``) is that number, as
        llama-cpp-python's server and OpenAI take it; ``2.5`` stays refused."""
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @model_validator(mode="after")
    def _nulls_are_defaults(self):
        for name in NULL_IS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, type(self).model_fields[name].default)
        return self

    @model_validator(mode="after")
    def _usage_of_a_stream(self):
        if self.stream_options is not None and not self.stream:  # as OpenAI answers it
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @model_validator(mode="after")
    def _one_length(self):
        if "max_completion_tokens" in self.model_fields_set:
            given = "max_tokens" in self.model_fields_set and self.max_tokens is not None  # null: not given
            if given and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError(
                    f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens}: give one"
                )
            if not given or self.max_completion_tokens is not None:
                self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _refuse_what_is_not_done(self):
        for name, value in (self.model_extra or {}).items():
            if name.startswith("kv_"):  # this server's own fields: a misspelt or unknown one changed nothing, silently
                raise ValueError(f"{name} is not a field of this server: a request may set {', '.join(KV_FIELDS)}")
            if name in NOT_SUPPORTED and not NOT_SUPPORTED[name][0](value):
                shown = json.dumps(value)
                asked = f"{name}={shown}" if len(shown) <= 40 else name  # (tools: a long schema)
                raise ValueError(f"{asked} is not supported: this server gives {NOT_SUPPORTED[name][1]}")
        return self

    @model_validator(mode="after")
    def _text_is_unicode(self):
        """A lone surrogate (JSON's "\\ud800") in any field is refused by name: a prompt's or a message's was a 400
        in the codec's words, and a stop string's one server refused so and the other (--parallel) ignored."""
        for name in type(self).model_fields:
            if (bad := _lone_surrogate(getattr(self, name))) is not None:
                raise ValueError(f"{name} holds {bad!r}, half of a UTF-16 pair: not a character (give the pair whole)")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def response_json(self) -> dict | None:
        """The JSON ``response_format`` the drop-in samples under (a chat's; None: plain text)."""
        return None


def _lone_surrogate(value) -> str | None:
    """The first lone surrogate in a request field's strings (lists, dicts and models walked), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return value[exc.start]
        return None
    if isinstance(value, BaseModel):
        value = dict(value)
    # (a dict's keys too: a schema's property named "\ud800" was taken)
    items = [*value, *value.values()] if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((bad for v in items if (bad := _lone_surrogate(v)) is not None), None)


class CompletionRequest(KVFields):
    prompt: str = ""
    max_tokens: int | None = Field(16, ge=0)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text(cls, value):
        """OpenAI also takes a list of prompts (one choice each) and token ids: one text here, a list of one as it."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            raise ValueError("token ids are not supported: send the prompt as text")
        if isinstance(value, list) and len(value) > 1:
            raise ValueError(f"{len(value)} prompts in one request are not supported: send one request per prompt")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None  # None: an assistant's turn that called a tool (OpenAI's history)

    @field_validator("role", mode="before")
    @classmethod
    def _no_tools(cls, role):
        if role in ("tool", "function"):  # (pydantic's "Input should be 'system', ..." said nothing of why)
            raise ValueError(f"messages of role '{role}' are not supported: this server calls no tools")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        parts = content if isinstance(content, list) else []
        if kind := next((p.get("type") for p in parts if isinstance(p, dict) and p.get("type") != "text"), None):
            # (pydantic gave three errors, one for each form the content could have had)
            raise ValueError(f"content parts of type {kind!r} are not supported: this server reads text only")
        return content

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content")
        return self

    def as_dict(self) -> dict[str, str]:
        """The plain form every chat template reads (parts joined; 'developer' is OpenAI's new 'system')."""
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # optional, as OpenAI's: without it any JSON object


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format`` of a chat: text, a JSON object, or a JSON object of a ``json_schema``
    (llama-cpp-python's ``json_object`` with a ``schema`` is taken too). The serial server samples JSON under
    llama-cpp-python's grammar for it (``llama.llama_response_format``), so every token keeps the answer a prefix of
    such JSON (an answer cut by ``max_tokens`` is cut JSON)."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None
    schema_: dict | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _has_its_schema(self):
        llama_response_format(self.as_dict())  # refused here, before the request waits for the model
        return self

    def as_dict(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class ChatRequest(KVFields):
    messages: list[Message] = Field(min_length=1)
    response_format: ResponseFormat | None = None

    @property
    def response_json(self) -> dict | None:
        fmt = self.response_format
        return fmt.as_dict() if fmt is not None and fmt.type != "text" else None


def error_body(status: int, message: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def error(status: int, message: str) -> Response:
    # json.dumps escapes to ASCII: a message may quote a lone surrogate from the request, which UTF-8 cannot encode
    return Response(json.dumps(error_body(status, message)), status, media_type="application/json")


class Job:
    """One request. Its worker thread posts events - ("error", (status, message)), ("result", body),
    ("chunk", chunk), ("done", None) - to a queue the event loop reads."""

    FINAL = ("error", "result", "done")

    def __init__(self, shutdown: threading.Event):
        self.cancelled = threading.Event()
        self.finished = False
        self._shutdown = shutdown
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()  # unbounded: the worker never waits for the client

    def stopped(self) -> bool:
        return self.cancelled.is_set() or self._shutdown.is_set()

    @property
    def server_stopping(self) -> bool:
        return self._shutdown.is_set()

    def post(self, kind: str, payload: Any = None) -> None:
        self.finished |= kind in self.FINAL
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: nobody listens any more
            self.cancelled.set()

    async def next(self, request: Request | None = None) -> tuple[str, Any] | None:
        """The next event; with ``request``, None as soon as its client has gone."""
        get = asyncio.ensure_future(self._events.get())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=0.25 if request else None)
                if done:
                    return get.result()
                if await request.is_disconnected():
                    return None
        finally:
            get.cancel()


class EventStream(StreamingResponse):
    """A Job's chunks as server-sent events. Whatever ends the response - the last event, the client
    leaving (Starlette then cancels it), the server stopping - stops the Job: its generator's ``finally``
    alone would not run if the cancellation came while it was suspended at a ``yield``."""

    def __init__(self, job: Job, first: tuple[str, Any]):
        self.job = job
        super().__init__(self._events(first), media_type="text/event-stream")

    async def _events(self, event: tuple[str, Any]):
        while True:
            kind, payload = event
            if kind == "chunk":
                yield f"data: {json.dumps(payload)}\n\n"
            else:
                if kind == "error":  # after the 200: the error goes in the stream, as OpenAI's does
                    yield f"data: {json.dumps(error_body(*payload))}\n\n"
                yield "data: [DONE]\n\n"
                return
            event = await self.job.next()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled.set()


async def respond(job: Job, request: Request) -> Response:
    """The Job's answer: JSON, an error, or a stream (which then owns the Job)."""
    streaming = False
    try:
        event = await job.next(request)
        if event is None:
            return error(499, "the client closed the connection")  # nginx's code; nobody reads it
        kind, payload = event
        if kind == "error":
            return error(*payload)
        if kind == "result":
            return JSONResponse(payload)
        streaming = True
        return EventStream(job, event)
    except asyncio.CancelledError:
        if not job.server_stopping:
            raise
        # uvicorn cancels what is still open GRACE_S after a stop signal: a prompt chunk read for longer (a big model
        # on a CPU) cannot stop sooner, and its client got uvicorn's plain-text 500 "Internal Server Error"
        return error(503, "the server is shutting down")
    finally:
        if not streaming:
            job.cancelled.set()  # a no-op after the end; stops the worker if this coroutine was cancelled


def usage_chunk(last: dict, usage: dict) -> dict:
    """The chunk ``stream_options.include_usage`` asks for after a stream's ``last``: its id, no choice, the usage."""
    return {**{k: last[k] for k in ("id", "object", "created", "model")}, "choices": [], "usage": usage}


def check_request_query(query: bool | str | None, policy: Policy | None, room: int = 0, chunk: int = 0) -> None:
    """Refuse a request's kv_query that nothing would read (a 200 that dropped it, as the CLI refuses --query): any
    without a budget, a question or a reconstruction with a policy that has no question score, a reconstruction in
    caches that keep no room for its repetition (``room``: what they keep beside a chunk of ``chunk``; read plainly
    once the cache was full, most chunks went without it). surprisal reads with any policy."""
    check_kv_query(query)  # one of its forms (``session.guide_of`` reads it)
    if query is None or query is False:
        return
    if policy is None:
        raise AhakvError("this server runs without a KV budget: kv_query is not available")
    if query != "surprisal" and not policy.reads_with_query:
        shown = json.dumps(query)
        shown = shown if len(shown) <= 40 else "a question"
        raise AhakvError(
            f"kv_query {shown} needs a policy that reads with a question ({query_readers()}), not {policy.name}"
        )
    if query == "reconstruct":
        check_room(
            query, chunk, room, shown='kv_query "reconstruct"', caches="this server's",
            advice="start it with --reading reconstruct",
        )  # fmt: skip


# llama-cpp-python's sampling fields the --parallel sampler (parallel.Sampling) does not have, and their defaults
PARALLEL_SAMPLES_NOT = {"typical_p": 1.0, "repeat_penalty": 1.0}


def sampling_of(req: KVFields, limit: int) -> dict:
    """The sampling arguments of a request (``max_tokens`` 0, null or above ``limit`` is cut to it)."""
    kw = {
        "max_tokens": min(req.max_tokens or limit, limit),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": stop_strings(req.stop),
        # llama.cpp's seeds are uint32; ctypes would wrap the same way, or fail past 64 bits. None: one drawn at random
        # (llama.cpp's LLAMA_DEFAULT_SEED), as OpenAI's and the --parallel server's. llama-cpp-python draws it from
        # random.Random(the last seed given), so unseeded requests repeated the same answers on every fresh server,
        # and a request's seed decided the next unseeded ones
        "seed": RANDOM_SEED if req.seed is None else req.seed & 0xFFFFFFFF,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "typical_p": req.typical_p,
        "repeat_penalty": req.repeat_penalty,
        "kv_query": req.kv_query,
    }
    return {k: v for k, v in kw.items() if v is not None}


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's (none on macOS or musl)
    except (AttributeError, OSError):
        return None


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system after a request. A request frees what it allocated, but glibc
    keeps freed blocks (a row of logits is 1 MiB) in its heap: the one-at-a-time server's RSS grew by 71 MiB from its
    20th request to its 120th, 38 with this and the model thread, level over the last 40 (benchmarks/serve_rss.py,
    RESULTS.md)."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


MAX_CONNECTIONS = 512  # open at once (a request, a stream, a client that never finishes sending); under ulimit -n 1024


class FifoLock:
    """A lock its waiters take in the order they came. Requests polling a ``threading.Lock`` were served in no order
    (25 sent 30 ms apart: 97 of 300 pairs out of order), and the first to come could wait past the busy timeout while
    later ones ran."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: collections.deque[object] = collections.deque()
        self._held = False

    def acquire(self, timeout: float | None = None, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Wait for the lock in turn; False past ``timeout`` seconds or once ``give_up()`` says so (checked every
        0.1 s: a client that left, a stop signal), the place in the line given up then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        me = object()
        with self._cond:
            self._waiting.append(me)
            try:
                while self._held or self._waiting[0] is not me:
                    left = None if deadline is None else deadline - time.monotonic()
                    if give_up() or (left is not None and left <= 0):
                        return False
                    self._cond.wait(0.1 if left is None else min(0.1, left))
                self._held = True
                return True
            finally:
                self._waiting.remove(me)
                self._cond.notify_all()  # the next in line may be at the head now

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


class SerialRunner:
    """The model, its lock and the server's settings; runs Jobs one at a time."""

    def __init__(self, llm: Llama, model_name: str, max_tokens_limit: int, busy_timeout: float, max_waiting: int):
        self.llm, self.model_name = llm, model_name
        self.max_tokens_limit, self.busy_timeout = max_tokens_limit, busy_timeout
        self.lock = FifoLock()
        self.slots = threading.BoundedSemaphore(max_waiting + 1)  # the running job and those waiting for it
        self.shutdown = threading.Event()
        self.current: Job | None = None
        self.since = 0.0  # when the current job took the lock
        self.stats = llm.kv_stats().as_dict()  # figures at the end of the last job
        # the server's own settings, which a request's kv_ fields are checked against while another holds the model
        kv = llm.kv_controller
        self.budget, self.policy = (kv.config.budget, kv.policy) if kv is not None else (None, None)
        self.room = (kv.config.room, kv.engine.config.n_ubatch) if kv is not None else (0, 0)
        # every job's model work runs in this one long-lived thread: glibc gives threads malloc arenas of their own, and
        # requests run each in a new thread left more memory resident than in one thread (benchmarks/RESULTS.md)
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ahakv-model")
        # the client left or the server is stopping: the drop-in stops before its next decode call (the next
        # token, or the next prompt chunk), streamed or not
        llm.should_stop = lambda: self.current is not None and self.current.stopped()

    def start(self) -> None:
        """Serve from now on: the shutdown of a server that ran the app before is over."""
        self.shutdown.clear()

    async def submit(self, request: Request, req: KVFields, kind: str, payload) -> Response:
        """Run a completion (``payload`` its prompt) or a chat (its messages) as a Job; answer JSON, an error,
        or a stream."""
        llm = self.llm
        if kind == "chat":

            def call(**kw):
                return llm.create_chat_completion(payload, **kw)
        else:

            def call(**kw):
                return llm.create_completion(payload, **kw)

        # the request's own mistakes are answered now, in its own thread: they waited for the model (15 s behind a
        # long answer), and a prompt of megabytes was tokenized holding it (50 s for 20 MB, every request waiting)
        try:
            await asyncio.to_thread(self._check, req, kind, payload)
        except (AhakvError, ValueError) as exc:
            return error(400, str(exc))
        if not self.slots.acquire(blocking=False):
            return error(503, "the server is busy: too many requests are waiting")
        job = Job(self.shutdown)
        try:
            threading.Thread(target=self._work, args=(job, req, call), name="ahakv-job", daemon=True).start()
        except RuntimeError:  # no thread to be had
            self.slots.release()
            return error(503, "the server is busy")
        return await respond(job, request)

    def _check(self, req: KVFields, kind: str, payload) -> None:
        """What a request can be refused for without the model: its kv_ fields against the server's settings
        (``settings`` checks the budget against the caches again, holding the model), and a prompt whose text alone
        is past the trained context (its template only adds to it)."""
        asked = make_policy(req.kv_policy) if req.kv_policy is not None else self.policy
        if (req.kv_budget is not None or req.kv_policy is not None) and self.budget is None:
            raise AhakvError("this server runs without a KV budget: kv_budget and kv_policy are not available")
        if req.kv_budget is not None:
            self.budget.parsed(req.kv_budget)
        check_request_query(req.kv_query, asked, *self.room)
        texts = [m["content"] for m in payload] if kind == "chat" else [payload]
        n = sum(len(self.llm.tokenize(t.encode(), add_bos=False, special=True)) for t in texts)
        if n + 1 > (trained := self.llm.kv_engine.n_ctx_train):
            raise AhakvError(f"the prompt has {n} tokens or more, past the model's trained context of {trained}")

    def _work(self, job: Job, req: KVFields, call) -> None:
        """The request's thread: the lock's whole life (it waits for the model, and stops waiting for a client that
        left); what touches the model runs in the model thread."""
        try:
            asked = time.monotonic()
            if self.lock.acquire(self.busy_timeout, give_up=job.stopped):
                try:
                    self.current, self.since = job, time.monotonic()
                    self.model_thread.submit(self._generate, job, req, call).result()
                finally:
                    self.current = None
                    with contextlib.suppress(Exception):  # figures for /v1/kv/stats; never worth keeping the lock
                        self.stats = self.model_thread.submit(self.llm.kv_stats).result().as_dict()
                    release_free_memory()
                    self.lock.release()
            else:  # (nobody reads it if the client has gone)
                job.post("error", (503, self._busy_message(time.monotonic() - asked)))
        finally:
            self.slots.release()
            if not job.finished:  # a bug above: the client still gets an answer, not a hang
                job.post("error", (500, "internal error"))

    def _busy_message(self, waited: float | None = None) -> str:
        if self.shutdown.is_set():
            return "the server is shutting down"
        held = f"one request has held the model for {time.monotonic() - self.since:.0f} s"
        return f"the server is busy: {held}" + ("" if waited is None else f" (this one waited {waited:.0f} s)")

    def _generate(self, job: Job, req: KVFields, call) -> None:
        try:
            with self.settings(req):
                sampling = self.sampling(req)
                out = call(stream=req.stream, **sampling)
                if not req.stream:
                    job.post("result", out)
                    return
                last = None
                with contextlib.closing(out):  # closed here, in the thread that ran it
                    for last in out:
                        job.post("chunk", last)
                if last is not None and req.include_usage:
                    job.post("chunk", usage_chunk(last, self.llm.last_usage))
                job.post("done")
        except Stopped:  # the server is stopping (or the client left, and nobody reads this)
            job.post("error", (503, "the server is shutting down"))
            self.llm.reset()  # a prompt stopped half-read, compressed for its own question: the next starts clean
        except (AhakvError, ValueError) as exc:  # the request's mistake, found here or by llama-cpp-python
            job.post("error", (400, str(exc)))
            self.llm.reset()  # a prompt may have failed half-read (a full cache): the next request starts clean
        except Exception as exc:
            log.exception("request failed")
            job.post("error", (500, f"internal error: {type(exc).__name__}: {exc}"))
            self.llm.reset()

    def sampling(self, req: KVFields) -> dict:
        kw = sampling_of(req, self.max_tokens_limit)
        kw["model"] = self.model_name  # what /v1/models lists (llama-cpp-python would answer with the GGUF's path)
        if req.response_json is not None:
            kw["response_format"] = req.response_json  # (the drop-in translates OpenAI's json_schema)
        return kw

    @contextlib.contextmanager
    def settings(self, req: KVFields):
        """Apply a request's kv_budget / kv_policy once both pass every check (``_check``'s, made before the request
        waited: its kv_query, a server without a budget; and the budget against the caches, here); restore the
        server's after."""
        if req.kv_budget is None and req.kv_policy is None:
            yield
            return
        kv = self.llm.kv_controller
        asked = make_policy(req.kv_policy) if req.kv_policy is not None else None
        saved_budget, saved_policy = kv.config.budget, kv.policy
        budget, policy = saved_budget, saved_policy
        if req.kv_budget is not None:  # with the server's auto-budget parameters
            budget = saved_budget.parsed(req.kv_budget)
        if asked is not None:
            policy = asked
        kv.check_budget(budget, policy, new_sequence=True)  # nothing has changed yet; it is read from the start
        try:  # every group's eviction target too, not only the configured budget
            self.llm.reset()  # the cached history was compressed under other settings; even layer shares again
            kv.configure(budget, policy)
            self.llm.reset()  # adaptive: the caches laid out for the request's budget
            yield
        finally:
            kv.restore(saved_budget, saved_policy)
            self.llm.reset()
            kv.resize_now()  # the server's own caches again now: its stats showed the request's until the next one

    def health(self) -> Response:
        if self.lock.acquire(timeout=1.0):
            self.lock.release()
            return JSONResponse({"status": "ok"})
        return error(503, self._busy_message())

    def kv_stats(self) -> dict:
        """Fresh figures while the model is free; during a generation, those at the end of the last job
        (reading the engine while a worker decodes would race with it)."""
        if self.lock.acquire(timeout=0.2):
            try:
                self.stats = self.llm.kv_stats().as_dict()
            finally:
                self.lock.release()
        return self.stats


@dataclass(frozen=True)
class Prepared:
    """A --parallel request as its own thread prepared it (``ParallelRunner._prepare``)."""

    kind: str  # "chat" or "completion"
    tokens: list[int]
    sampling: Sampling
    read_with: object  # the prompt's guide (``session.guide_of``)
    budget: Budget | None


class ParallelRunner:
    """``--parallel N``: a scheduler thread owns the context's sequence slots (``SequencePool``). A request
    waits for a free slot (503 past ``busy_timeout`` or with ``max_waiting`` others waiting), has its prompt
    read there with its own kv_budget / kv_policy / kv_query, and then gets one token per step, decoded in
    one llama_decode with every other running request."""

    def __init__(self, pool: SequencePool, model_name: str, max_tokens_limit: int, busy_timeout: float,
                 max_waiting: int, default_query: bool | str):  # fmt: skip
        self.pool, self.model_name, self.max_tokens_limit = pool, model_name, max_tokens_limit
        self.busy_timeout, self.max_waiting, self.default_query = busy_timeout, max_waiting, default_query
        self.waiting: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.shutdown = threading.Event()
        self._thread: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        """Serve from now on: the shutdown of a server that ran the app before is over, and the scheduler runs."""
        self.shutdown.clear()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="ahakv-scheduler", daemon=True)
            self._thread.start()

    async def submit(self, request: Request, req: KVFields, kind: str, payload) -> Response:
        # the request's own mistakes are answered now, in its own thread, with its prompt tokenized there: they waited
        # for a free slot (45 s behind two long answers), and a prompt of megabytes was tokenized by the scheduler,
        # every running stream stalled for as long (24 s for 8 MB)
        try:
            prepared = await asyncio.to_thread(self._prepare, req, kind, payload)
        except (AhakvError, ValueError) as exc:
            return error(400, str(exc))
        job = Job(self.shutdown)
        job.req, job.prepared, job.since = req, prepared, time.monotonic()
        with self.cond:
            # clients that left count for nothing: the scheduler prunes them between steps, but not while it reads a
            # prompt (seconds), when 32 who had gone made every new request a 503
            for gone in [j for j in self.waiting if j.stopped()]:
                self.waiting.remove(gone)
                gone.post("error", (503, self._busy_message(gone)))
            if len(self.waiting) >= self.max_waiting:
                return error(503, "the server is busy: too many requests are waiting")
            self.waiting.append(job)
            self.cond.notify()
        return await respond(job, request)

    def _loop(self) -> None:
        """Admit, step, answer, until the server shuts down: then every waiting request is answered 503 (``Job``
        stops at the shutdown), every running one ends at its next token, and the thread returns (an app made in
        a process that goes on, a test's or an embedding app's, kept it polling for the life of the process)."""
        pool = self.pool
        while not (self.shutdown.is_set() and not pool.active and not self.waiting):
            with self.cond:
                while not self.waiting and not pool.active and not self.shutdown.is_set():
                    self.cond.wait(0.25)
                admit = []
                while self.waiting and len(admit) < len(pool.free()):
                    admit.append(self.waiting.popleft())
                now = time.monotonic()
                for job in [j for j in self.waiting if j.stopped() or now - j.since > self.busy_timeout]:
                    self.waiting.remove(job)
                    job.post("error", (503, self._busy_message(job)))
            for job in admit:
                self._start(job)
            try:
                pool.step()
            except Exception as exc:  # a bug, or the engine failing: every running request gets an answer
                log.exception("decode step failed")
                for gen in list(pool.active.values()):
                    gen.emit("", f"error: {type(exc).__name__}: {exc}")
                pool.active.clear()
                pool.next_token.clear()

    def _busy_message(self, job: Job) -> str:
        if self.shutdown.is_set():
            return "the server is shutting down"
        return f"the server is busy: every sequence slot has been taken for {time.monotonic() - job.since:.0f} s"

    def _prepare(self, req: KVFields, kind: str, payload) -> Prepared:
        """What a request starts from, checked as far as the server's settings say (``SequencePool.check_asked``): its
        prompt's tokens, sampling, reading and budget. Runs in the request's thread; raises AhakvError or ValueError."""
        if req.response_json is not None:
            raise AhakvError(
                f"response_format {req.response_format.type} is not supported with --parallel: its sampler has no "
                "grammar (the one-at-a-time server has)"
            )
        kw = sampling_of(req, self.max_tokens_limit)
        for name, default in PARALLEL_SAMPLES_NOT.items():
            if kw[name] != default:
                raise AhakvError(
                    f"{name}={kw[name]} is not supported with --parallel (the one-at-a-time server takes it)"
                )
        budget = Budget.parse(req.kv_budget) if req.kv_budget is not None else None
        chunk = self.pool.engine.config.n_ubatch
        check_request_query(
            req.kv_query, self.pool.check_asked(budget, req.kv_policy)[1], self.pool.spec.room(chunk), chunk
        )
        tokens, chat_stop, read_with = prompt_of(self.pool.engine, kind, payload, req.kv_query, self.default_query)
        self.pool.check_prompt(tokens)
        sampling = Sampling(
            max_tokens=kw["max_tokens"],
            temperature=req.temperature,
            top_p=req.top_p,
            seed=kw.get("seed"),
            stop=tuple(kw["stop"]) + tuple(chat_stop),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            top_k=req.top_k,
            min_p=req.min_p,
        )
        return Prepared(kind, tokens, sampling, read_with, budget)

    def _start(self, job: Job) -> None:
        if job.stopped():
            job.post("error", (503, self._busy_message(job)))
            return
        req, p = job.req, job.prepared
        try:
            reply = Reply(job, self.model_name, p.kind, len(p.tokens), req.stream, req.include_usage)
            gen = Generation(p.tokens, p.sampling, reply.emit, job.stopped, p.budget, req.kv_policy, p.read_with)
            reply.gen = gen
            self.pool.start(gen)  # (checks the budget against the controllers again, in the thread that owns them)
        except (AhakvError, ValueError) as exc:
            job.post("error", (400, str(exc)))
        except Exception as exc:
            log.exception("request failed")
            job.post("error", (500, f"internal error: {type(exc).__name__}: {exc}"))

    def health(self) -> Response:
        """200 while a request would get a slot now, as the one-at-a-time server's while the model is free."""
        if free := len(self.pool.free()):
            return JSONResponse({"status": "ok", "free_slots": free})
        return error(503, f"the server is busy: every sequence slot is taken ({len(self.waiting)} waiting)")

    def kv_stats(self) -> dict:
        """Read from the controllers' Python figures (a request's slot is free before its answer is posted)."""
        return self.pool.stats()


class Reply:
    """Turns a Generation's text into the Job's events, in llama-cpp-python's OpenAI shapes."""

    def __init__(self, job: Job, model: str, kind: str, n_prompt: int, stream: bool, include_usage: bool = False):
        self.job, self.model, self.kind, self.n_prompt, self.stream = job, model, kind, n_prompt, stream
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text: list[str] = []
        self.gen: Generation | None = None
        self.began = False

    def _body(self, choice: dict, chunk: bool) -> dict:
        chat = self.kind == "chat"
        obj = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def _piece(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant"} if role else {} if text is None else {"content": text}
            return self._body({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}, True)
        return self._body({"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}, True)

    def _usage(self) -> dict:
        n = len(self.gen.tokens) if self.gen else 0
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n, "total_tokens": self.n_prompt + n}

    def emit(self, text: str, finish: str | None) -> None:
        if finish == "cancelled":
            self.job.post("error", (503, "the server is shutting down"))
            return
        if finish is not None and finish.startswith("error"):
            self.job.post("error", (500, f"internal {finish}"))
            return
        if self.stream:
            if not self.began and self.kind == "chat":
                self.job.post("chunk", self._piece(None, None, role=True))
            self.began = True
            if text:
                self.job.post("chunk", self._piece(text, None))
            if finish is not None:
                last = self._piece(None, finish)
                self.job.post("chunk", last)
                if self.include_usage:
                    self.job.post("chunk", usage_chunk(last, self._usage()))
                self.job.post("done")
            return
        self.text.append(text)
        if finish is None:
            return
        content, usage = "".join(self.text), self._usage()
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None}
        else:
            choice = {"text": content, "index": 0, "logprobs": None}
        body = self._body({**choice, "finish_reason": finish}, False)
        self.job.post("result", {**body, "usage": usage})


def create_app(
    llm: Llama | SequencePool,
    model_name: str,
    max_tokens_limit: int = 2048,
    busy_timeout: float = 600.0,
    max_waiting: int = 32,
    default_query: bool | str = True,
) -> FastAPI:
    """The app over one ``Llama`` (one request at a time) or a ``SequencePool`` (``--parallel``: one request per
    sequence slot, ``default_query`` the server's reading); setting ``app.state.shutdown`` (a threading.Event)
    stops the generations in progress and every request waiting for the model."""
    if isinstance(llm, SequencePool):
        runner = ParallelRunner(llm, model_name, max_tokens_limit, busy_timeout, max_waiting, default_query)
    else:
        runner = SerialRunner(llm, model_name, max_tokens_limit, busy_timeout, max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()  # a server (again): an app served before answered every request after with 503
        yield
        runner.shutdown.set()  # the app's server stopped (uvicorn, a TestClient): the scheduler's thread ends too

    app = FastAPI(title="ahakv-local", version="1", lifespan=lifespan)
    app.state.shutdown = runner.shutdown
    app.state.runner = runner  # (a test holds its model)
    # as llama-cpp-python's server: a browser app of another origin (a web chat UI on localhost:3000) may call it
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        def describe(e: dict) -> str:
            if e["type"] == "json_invalid":
                return f"the body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})"
            # no body ("Field required"), or one not read as JSON (a form: "Input should be a valid dictionary")
            if tuple(e["loc"]) == ("body",) and e["type"] in ("missing", "model_attributes_type", "dict_type"):
                sent = request.headers.get("content-type") or "none"
                if sent.split(";")[0].strip() == "application/json":
                    return "the body must be a JSON object (a dictionary of the request's fields)"
                return f"the body must be a JSON object, sent as Content-Type: application/json (it was {sent})"
            where = ".".join(str(p) for p in e["loc"] if p != "body")
            msg = e["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own message
            return f"{where}: {msg}" if where else msg

        errors = exc.errors()
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        return error(400, "; ".join(describe(e) for e in errors[:3]) + more)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        response = error(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return error(500, f"internal error: {type(exc).__name__}")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "ahakv-local"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    def models():
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    def model(model_id: str):  # the openai client's models.retrieve()
        if model_id != model_name:
            return error(404, f"the model {model_id!r} does not exist: this server serves {model_name!r}")
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await runner.submit(request, req, "completion", req.prompt)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        messages = [m.as_dict() for m in req.messages]
        return await runner.submit(request, req, "chat", messages)

    @app.get("/v1/kv/stats")
    def kv_stats():
        return runner.kv_stats()

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: health checkers that send no GET)
    def health():
        return runner.health()

    return app


class Server(uvicorn.Server):
    """uvicorn's server whose stop signal also stops the generation in progress and the requests waiting
    for the model: uvicorn alone waits for every open response to finish, however long it streams."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event):
        super().__init__(config)
        self.stopping = stopping  # (uvicorn.Server has a shutdown method)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            # a second Ctrl-C: now. uvicorn's own forced exit cancelled the requests mid-way, each one a traceback in
            # the log and a 500 to its client (while a prompt was read, which stops only between two chunks)
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
            os._exit(130)
        self.stopping.set()
        super().handle_exit(sig, frame)


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: an address in use or a host that does not resolve is one
    line of error at once (uvicorn printed its own after "serving ...", and exited 3)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise AhakvError(f"cannot listen on {host}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise AhakvError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def run_server(app: FastAPI, sock: socket.socket) -> None:
    """Serve on ``sock`` (``listen_socket``) until SIGINT/SIGTERM; open responses get GRACE_S seconds to end (a
    stopped generation ends at its next token), then uvicorn cancels them and re-raises the signal."""
    host, port = sock.getsockname()[:2]
    # connections past MAX_CONNECTIONS get uvicorn's 503: 1,100 left half-sent used up a 1,024-file limit, and then
    # every client waited and uvicorn logged "Too many open files" ~16,000 times a second
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_S,
        limit_concurrency=MAX_CONNECTIONS,
    )  # fmt: skip
    quiet = CancelledAtStop(app.state.shutdown)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        Server(config, app.state.shutdown).run(sockets=[sock])
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)


class CancelledAtStop(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" for a request it cancelled at a stop signal (GRACE_S after it):
    a client that had sent half a request body left a traceback behind a clean exit. uvicorn's one line
    saying it cancelled the request stays."""

    def __init__(self, stopping: threading.Event):
        super().__init__()
        self.stopping = stopping

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (self.stopping.is_set() and isinstance(error, asyncio.CancelledError))
