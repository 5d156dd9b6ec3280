"""`ahakv-local serve` answers the official openai client on localhost, streaming and not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from openai import BadRequestError, OpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(gemma_model):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ahakv_local",
        "serve",
        str(gemma_model),
        "--port",
        str(port),
        "--budget",
        "96",
        "--recent",
        "16",
        "--policy",
        "ahakv",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # bounded wait for the model to load
        try:
            with urllib.request.urlopen(base + "/models", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read().decode()}")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server, api_key="not-needed", max_retries=0, timeout=120)


def test_models(client):
    assert client.models.list().data[0].id == "gemma-3-270m-q4_k_m.gguf"


def test_completion_and_stream(client):
    out = client.completions.create(
        model="local", prompt="The GNU General Public License", max_tokens=12, temperature=0
    )
    text = out.choices[0].text
    assert text and out.usage.completion_tokens <= 12
    pieces = client.completions.create(
        model="local", prompt="The GNU General Public License", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in pieces) == text


def test_chat_and_stream_past_the_budget(client, server):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Count from one to one hundred in words, separated by commas."},
    ]
    out = client.chat.completions.create(model="local", messages=messages, max_tokens=150, temperature=0)
    answer = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and answer
    stream = client.chat.completions.create(
        model="local", messages=messages, max_tokens=150, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == answer
    with urllib.request.urlopen(server + "/kv/stats", timeout=10) as r:
        stats = json.load(r)
    assert stats["tokens_seen"] > 96 and stats["cells_used"] <= 96  # the conversation ran past the budget


def test_per_request_budget_and_policy(client, server):
    out = client.completions.create(
        model="local",
        prompt="one two three four five " * 20,
        max_tokens=8,
        temperature=0,
        extra_body={"kv_budget": 64, "kv_policy": "h2o"},
    )
    assert out.choices[0].text is not None
    with pytest.raises(BadRequestError, match="exceeds this server's"):
        client.completions.create(model="local", prompt="x", max_tokens=2, extra_body={"kv_budget": 100000})
    with pytest.raises(BadRequestError, match="unknown policy"):
        client.completions.create(model="local", prompt="x", max_tokens=2, extra_body={"kv_policy": "nope"})
