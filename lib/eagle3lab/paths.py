"""Where the repository is: the folder holding ``params/`` and ``notebooks/`` (standard library only)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT_ENV = "EAGLE3LAB_ROOT"


def find_repo_root(start: Path) -> Path | None:
    """The first folder upwards from ``start`` holding both ``params/`` and ``notebooks/``, or None."""
    here = Path(start).resolve()
    for d in (here, *here.parents):
        if (d / "params").is_dir() and (d / "notebooks").is_dir():
            return d
    return None


def repo_root(start: Path | None = None) -> Path:
    """``$EAGLE3LAB_ROOT``; else the repository above ``start``; else the one above the current folder;
    else the current folder (an installed package used outside the repository)."""
    env = os.environ.get(ROOT_ENV)
    if env:
        return Path(env).resolve()
    for origin in ([start] if start is not None else []) + [Path.cwd()]:
        found = find_repo_root(origin)
        if found is not None:
            return found
    return Path.cwd().resolve()


def resolve_in_repo(path: str | Path, root: Path) -> Path:
    """``path`` as given when absolute (``~`` expanded), else relative to ``root``."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else root / p
