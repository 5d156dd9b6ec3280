"""``ahakv-local serve``: an OpenAI-compatible HTTP server over one bounded-cache ``Llama``.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (``stream: true`` sends
server-sent events, ending with ``data: [DONE]``). Besides the OpenAI fields a request may carry
``kv_budget`` and ``kv_policy``; they apply to that request only. One request runs at a time.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from .controller import Budget
from .errors import AhakvError
from .llama import Llama
from .policies import make_policy

SAMPLING = ("max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty")


class KVFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = 256
    temperature: float = 0.8
    top_p: float = 0.95
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    kv_budget: int | float | str | None = None
    kv_policy: str | None = None


class CompletionRequest(KVFields):
    prompt: str | list[str] = ""


class ChatRequest(KVFields):
    messages: list[dict[str, Any]]


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": None}}, status)


def create_app(llm: Llama, model_name: str) -> FastAPI:
    app = FastAPI(title="ahakv-local", version="1")
    lock = threading.Lock()

    @contextmanager
    def request_settings(req: KVFields):
        """Apply a request's kv_budget / kv_policy, restoring the server's defaults afterwards."""
        kv = llm.kv_controller
        if req.kv_budget is None and req.kv_policy is None:
            yield
            return
        if kv is None:
            raise AhakvError("this server runs without a KV budget: kv_budget and kv_policy are not available")
        saved_budget, saved_policy = kv.config.budget, kv.policy
        if req.kv_budget is not None:
            b = Budget.parse(req.kv_budget)
            kv.check_floor(b)
            if not kv.fits(b):
                raise AhakvError(f"kv_budget {int(b.value)} exceeds this server's {llm.kv_stats().kv_cells} cells")
            kv.config.budget = b
        if req.kv_policy is not None:
            kv.set_policy(make_policy(req.kv_policy))
        llm.reset()  # the cached history was compressed under other settings
        try:
            yield
        finally:
            kv.config.budget = saved_budget
            kv.set_policy(saved_policy)
            llm.reset()

    def sampling(req: KVFields) -> dict:
        return {k: getattr(req, k) for k in SAMPLING if getattr(req, k) is not None}

    def respond(req: KVFields, run):
        if not lock.acquire(timeout=600):
            return error(503, "the server is busy")
        try:
            settings = request_settings(req)
            settings.__enter__()
        except AhakvError as exc:
            lock.release()
            return error(400, str(exc))

        def finish() -> None:
            settings.__exit__(None, None, None)
            lock.release()

        if not req.stream:
            try:
                return JSONResponse(run(False))
            except ValueError as exc:  # llama-cpp-python's own request errors (context, grammar, ...)
                return error(400, str(exc))
            finally:
                finish()

        def events():
            try:
                for chunk in run(True):
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            except ValueError as exc:
                yield f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n"
            finally:
                finish()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "ahakv-local"}],
        }

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        prompt = req.prompt if isinstance(req.prompt, str) else "".join(req.prompt)
        return respond(req, lambda stream: llm.create_completion(prompt, stream=stream, **sampling(req)))

    @app.post("/v1/chat/completions")
    def chat_completions(req: ChatRequest):
        return respond(req, lambda stream: llm.create_chat_completion(req.messages, stream=stream, **sampling(req)))

    @app.get("/v1/kv/stats")
    def kv_stats():
        return llm.kv_stats().as_dict()

    return app
