"""Fixtures of the end-to-end runs: one embedded Ray per module and the demo's tiny model and
data (built once per module)."""

from __future__ import annotations

import pytest

from megarl.ray_cluster.session import ray_session


@pytest.fixture(scope="module")
def ray_local():
    with ray_session(None, num_cpus=6) as session:
        yield session


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    return tmp_path_factory.mktemp("demo")
