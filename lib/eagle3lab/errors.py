"""Errors that mean "the input is wrong" (exit code 2), as opposed to failures during the work.

Standard library only, so any layer may raise them. ``eagle3lab`` maps :class:`InputError` (and its
subclass :class:`eagle3lab.params.ParamsError`) to exit code 2 and prints one line per problem; anything
else that escapes a command is a failure of the work (exit code 3), reported with its type.
"""

from __future__ import annotations

from collections.abc import Sequence


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
