"""Fixtures of the vLLM-facing tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def registry_rows():
    """diagnose's table of the installed vLLM's whole registry, computed once per session: reading every model's
    source costs about a minute on the 2-core CI machine, and three tests read the same table."""
    pytest.importorskip("vllm", reason="tests/vllm need an installed vLLM (0.26.0 in .venv, 0.17.0 in .venvs)")
    from eagle3lab import diagnose as dg
    from eagle3lab import patch

    patch.revert()  # the table describes the unpatched classes
    return tuple(dg.registry_table())
