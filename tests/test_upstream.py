"""The upstream boundary: the private llama-cpp-python names ahakv-local relies on exist in the pinned
version, and another version is refused with one line."""

from __future__ import annotations

import llama_cpp
import pytest

from ahakv_local import Llama, upstream
from ahakv_local.errors import EngineNotPatched


def test_the_pinned_version_is_installed():
    assert llama_cpp.__version__ == upstream.PINNED_VERSION
    upstream.check_version()


def test_every_private_name_exists():
    assert upstream.missing_names() == []


@pytest.mark.parametrize("budget", [None, 64])
def test_every_llama_attribute_the_drop_in_uses_exists(fixture_model, budget):
    with Llama(str(fixture_model), n_ctx=256, n_batch=64, kv_budget=budget, verbose=False) as llm:
        missing = [name for name in upstream.LLAMA_ATTRIBUTES if not hasattr(llm, name)]
        assert missing == []
        model, ctx, batch = upstream.handles(llm)
        assert model.model is not None and ctx.ctx is not None and batch.batch is not None


def test_another_version_is_refused(monkeypatch):
    monkeypatch.setattr(llama_cpp, "__version__", "0.3.99")
    with pytest.raises(EngineNotPatched, match=r"llama-cpp-python 0\.3\.99 is installed, ahakv-local needs 0\.3\.36"):
        upstream.check_version()
