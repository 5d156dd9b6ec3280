from __future__ import annotations

import pytest

from ahakv_local.models import default_model_path, fixture_path


@pytest.fixture(scope="session")
def fixture_model():
    return fixture_path()


@pytest.fixture(scope="session")
def gemma_model():
    return default_model_path()


@pytest.fixture(scope="session")
def license_text() -> str:
    """Real English text nobody here wrote."""
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        return f.read()
