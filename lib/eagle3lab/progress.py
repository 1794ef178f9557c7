"""Progress bars that show where a person watches and stay silent in a batch run.

``eagle3lab run`` executes notebooks with papermill: whatever a progress bar writes lands in the executed
notebook, its HTML page and run.log, one line per refresh (hundreds per notebook). The runner sets
``EAGLE3LAB_BATCH=1`` in the kernel's environment, and every bar made here is then disabled. In JupyterLab
the bar is ``tqdm.auto``'s widget; in a terminal it is tqdm's text bar.

This module imports nothing from eagle3lab, so any module may use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

BATCH_ENV = "EAGLE3LAB_BATCH"


def in_batch_run() -> bool:
    """True inside a notebook kernel started by ``eagle3lab run`` (the runner sets ``EAGLE3LAB_BATCH=1``)."""
    return os.environ.get(BATCH_ENV, "") not in ("", "0")


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """A ``tqdm.auto.tqdm`` bar (same keywords), disabled in batch runs.

    ``disable=True`` from the caller is honoured everywhere; in a batch run the bar is disabled whatever the
    caller asked, so no refresh reaches a report.
    """
    if in_batch_run():
        # tqdm.std, not tqdm.auto: importing the notebook variant warns when ipywidgets is missing.
        from tqdm.std import tqdm as quiet

        kwargs["disable"] = True
        return quiet(iterable, **kwargs)
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)
