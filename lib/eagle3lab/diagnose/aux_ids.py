"""The aux layer ids vLLM would use for a target: the drafter config's, or vLLM's default rule.

The rules themselves live in :mod:`eagle3lab.aux_layers`; this module only finds the ids (where a drafter
config carries them, as vLLM's runners read them) and reports the problems for a diagnosis.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3lab.aux_layers import AuxProblem, aux_id_problems, default_aux_layer_ids
from eagle3lab.diagnose.target_info import read_json_config


@dataclass
class AuxIds:
    """The aux layer ids vLLM would use for a target, where they came from, and what is wrong with them."""

    ids: list[int] | None
    source: str  # "drafter config (top level)", "drafter config (eagle_config)", "default rule", "unknown"
    num_layers: int | None
    problems: list[AuxProblem]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def drafter_aux_ids(drafter_cfg: dict[str, Any]) -> tuple[list[int] | None, str]:
    """The aux ids a drafter config carries and where (top level wins, as vLLM's runners read it)."""
    ids = drafter_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(i) for i in ids], "drafter config (top level)"
    nested = (drafter_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return [int(i) for i in nested], "drafter config (eagle_config)"
    return None, "default rule"


def resolve_aux_ids(num_layers: int | None, drafter_config: str | Path | None = None) -> AuxIds:
    """The aux ids vLLM would use for this target (drafter's, or the default rule), with problems."""
    ids: list[int] | None = None
    source = "default rule"
    if drafter_config is not None:
        cfg, _ = read_json_config(drafter_config)
        ids, source = drafter_aux_ids(cfg)
    if ids is None:
        if num_layers is None:
            return AuxIds(None, "unknown (layer count unknown: give a config.json)", None, [])
        ids = default_aux_layer_ids(num_layers)
    return AuxIds(ids, source, num_layers, aux_id_problems(ids, num_layers))
