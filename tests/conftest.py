from __future__ import annotations

from pathlib import Path

import pytest

from ahakv_local.fixture import FixtureSpec
from ahakv_local.models import default_model_path, fixture_path

import device

LICENSES = Path("/usr/share/common-licenses")


def pytest_configure(config):
    if device.DEVICE and device.DEVICE not in device.REGISTRY_NAMES:
        raise pytest.UsageError(f"AHAKV_TEST_DEVICE={device.DEVICE}: not one of {', '.join(device.REGISTRY_NAMES)}")
    if not (LICENSES / "GPL-3").is_file():  # (a dozen files failed at their first read, each a FileNotFoundError)
        raise pytest.UsageError(
            f"the tests read real text from {LICENSES}, which Debian's and Ubuntu's base-files ship"
        )
    config.addinivalue_line("markers", "device: its models run on AHAKV_TEST_DEVICE (tests/device.py)")


def pytest_collection_modifyitems(config, items):
    """With AHAKV_TEST_DEVICE set and no such device in the engine, the device tests skip with the reason."""
    if reason := device.device_missing():
        for item in items:
            if item.get_closest_marker("device"):
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config):
    return f"engine tests on: {device.description()}" if device.DEVICE else None


@pytest.fixture(scope="session")
def fixture_model():
    return fixture_path()


@pytest.fixture(scope="session")
def gemma3_fixture():
    """The random-weight gemma3 GGUF: layer 0 slides over 24 positions (the sliding cache), layer 1 attends to
    everything (the base cache)."""
    return fixture_path(FixtureSpec(arch="gemma3"))


@pytest.fixture(scope="session")
def six_layers():
    """Three sliding-window layers (0, 2, 4) and three full-attention ones (1, 3, 5): 768 bytes a cell, f16."""
    return fixture_path(FixtureSpec(arch="gemma3", n_layer=6))


@pytest.fixture(scope="session")
def gemma_model():
    return default_model_path()


@pytest.fixture(scope="session")
def license_text() -> str:
    """Real English text nobody here wrote."""
    with open("/usr/share/common-licenses/GPL-3", encoding="utf-8") as f:
        return f.read()
