"""Shared fixtures."""

import pytest


@pytest.fixture
def one_thread():
    """Run torch on one thread: tiny models gain nothing from more, and CI has 2 shared cores."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The whole workbook on tests/smoke.yaml, run once per test session and shared (CI runs it once for the
    end-to-end checks and the browser test). Returns the ``runner.RunResult``."""
    from pathlib import Path

    from eagle3lab import runner

    root = Path(__file__).resolve().parents[1]
    return runner.run(root / "tests" / "smoke.yaml", outputs=tmp_path_factory.mktemp("smoke"), progress=False)
