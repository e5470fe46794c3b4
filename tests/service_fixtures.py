"""Fixtures of the service tests: `pytest_plugins = ["service_fixtures"]` in a test module makes them available.

The helpers they use live in `service_harness`, which test modules import by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from service_harness import Service, service_fixture


@pytest.fixture(scope="session")
def small_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.demo import make_demo_dataset

    root = tmp_path_factory.mktemp("service-data") / "small"
    make_demo_dataset(str(root), 24, min_side=96, max_side=200, workers=1)
    return root


@pytest.fixture(scope="session")
def slow_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.demo import make_demo_dataset

    root = tmp_path_factory.mktemp("service-data") / "slow"
    make_demo_dataset(str(root), 40, min_side=800, max_side=1200, workers=2)
    return root


@pytest.fixture
def service(private_redis: Any, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Iterator[Service]:
    """A service on this test's own Redis; jobs may use anything under pytest's temp folder."""
    logs = tmp_path / "logs"
    logs.mkdir()
    yield from service_fixture(private_redis.url, [tmp_path_factory.getbasetemp()], logs)
