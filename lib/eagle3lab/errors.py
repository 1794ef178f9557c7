"""Errors that mean "the input is wrong" (exit code 2), as opposed to failures during the work.

Standard library only, so any layer may raise them. ``eagle3lab`` maps :class:`InputError` (and its
subclass :class:`eagle3lab.params.ParamsError`) to exit code 2 and prints one line per problem; anything
else that escapes a command is a failure of the work (exit code 3), reported with its type.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path


class InputError(ValueError):
    """Input that cannot be used: ``problems`` is a list of (where, reason); ``str()`` is one line each.

    ``where`` names the file or argument and, when there is one, the field (``params/x.yaml: train.epochs``).
    """

    def __init__(self, problems: Sequence[tuple[str, str]]) -> None:
        if not problems:
            raise ValueError("InputError needs at least one problem")
        self.problems = [(str(w), str(r)) for w, r in problems]
        super().__init__("\n".join(f"{w}: {r}" if w else r for w, r in self.problems))

    @property
    def lines(self) -> list[str]:
        """One message per problem."""
        return str(self).splitlines()


class CorruptFileError(InputError):
    """A file that exists but cannot be read (truncated, overwritten, not the format it claims): names the file,
    says what it was and what to do, instead of the reader's own error from deep inside torch or safetensors."""

    def __init__(self, path: str | Path, what: str, cause: BaseException | str, remedy: str = "") -> None:
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        self.path = Path(path)
        super().__init__([(str(path), f"corrupt {what} ({detail})" + (f"; {remedy}" if remedy else ""))])


def safetensors_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (header unreadable, data shorter than the header says), or
    None. Reads the header only: a file cut short by a kill or a failed copy is caught, flipped bytes inside the
    tensors are not (the format has no checksum)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                return f"{size} bytes: shorter than a safetensors header"
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                return f"header length {n} exceeds the file's {size} bytes"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"unreadable header ({type(exc).__name__}: {exc})"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    ends = [int(v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{size} bytes, the header describes {need}: truncated"
    return None


def check_safetensors(path: str | Path, what: str, remedy: str = "") -> None:
    """Raise :class:`CorruptFileError` naming ``path`` when it is not a whole safetensors file."""
    problem = safetensors_problem(path)
    if problem is not None:
        raise CorruptFileError(path, what, problem, remedy)
