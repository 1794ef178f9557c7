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
