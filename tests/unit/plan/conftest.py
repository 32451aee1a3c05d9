"""The demo's model and data (built once a session) for the plan tests that check files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """(model dir, data dir) of `megarl demo`: a module's own ``demo`` fixture wins over this one."""
    from megarl.commands.demo import prepare_demo

    return prepare_demo(tmp_path_factory.mktemp("demo"))
