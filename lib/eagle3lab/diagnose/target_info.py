"""What is known about a target before touching vLLM: an architecture name, a config.json or a folder.

A path that does not exist or does not hold a usable config.json is bad input (:class:`InputError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lab.errors import InputError


@dataclass
class TargetInfo:
    """What was learned about the target before touching vLLM."""

    architecture: str
    config_path: str | None = None
    model_type: str | None = None
    text_model_type: str | None = None  # hf_text_config.model_type (text_config's, if any)
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    text_architectures: list[str] = field(default_factory=list)
    model_type_source: str | None = None  # "config.json", "transformers mapping" or None (unknown)


def read_json_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """Read a config.json, or the config.json inside a folder; return (dict, file path)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise InputError([(str(p), "config not found (give an architecture name, a config.json or a folder)")])
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise InputError([(str(p), f"not valid JSON ({exc})")]) from None
    if not isinstance(cfg, dict):
        raise InputError([(str(p), "top level must be a JSON object")])
    return cfg, p


def text_config_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's sub-config, as vLLM's ``hf_text_config`` picks it (text_config when present)."""
    for key in ("text_config", "language_config", "llm_config"):
        sub = cfg.get(key)
        if isinstance(sub, dict):
            return sub
    return cfg


def _looks_like_path(target: str) -> bool:
    return "/" in target or "\\" in target or target.endswith(".json") or target.startswith(".")


def target_info(target: str | Path) -> TargetInfo:
    """Turn an architecture name, a config.json or a checkpoint folder into a :class:`TargetInfo`."""
    if isinstance(target, Path) or Path(str(target)).exists() or _looks_like_path(str(target)):
        cfg, p = read_json_config(target)
        archs = cfg.get("architectures") or []
        if not archs or not isinstance(archs, list):
            raise InputError([(str(p), "no 'architectures' list, so vLLM cannot pick a model class")])
        text = text_config_of(cfg)

        def pick(key: str) -> Any:
            return text.get(key, cfg.get(key))

        return TargetInfo(
            architecture=str(archs[0]),
            config_path=str(p),
            model_type=cfg.get("model_type"),
            text_model_type=text.get("model_type", cfg.get("model_type")),
            num_hidden_layers=pick("num_hidden_layers"),
            hidden_size=pick("hidden_size"),
            vocab_size=pick("vocab_size"),
            text_architectures=list(text.get("architectures") or []) if text is not cfg else [],
            model_type_source="config.json",
        )
    name = str(target).strip()
    if not name.isidentifier():
        raise InputError([("target", f"{target!r} is neither an architecture name nor an existing config path")])
    mt = model_type_for_architecture(name)
    return TargetInfo(
        architecture=name, model_type=mt, text_model_type=mt, model_type_source="transformers mapping" if mt else None
    )


def model_type_for_architecture(arch: str) -> str | None:
    """The model_type whose transformers class is named ``arch`` (reverse of transformers' auto mappings).

    Only a guess for a bare architecture name: a checkpoint's own config.json is authoritative
    (Kimi-K2.5, for one, is not in transformers, and its gate-relevant model_type is its text_config's).
    """
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    candidates: list[str] = []
    for name, mapping in vars(modeling_auto).items():
        if not (name.endswith("_MAPPING_NAMES") and isinstance(mapping, dict)):
            continue
        for model_type, cls_names in mapping.items():
            names = cls_names if isinstance(cls_names, (tuple, list)) else (cls_names,)
            if arch in names and model_type not in candidates:
                candidates.append(model_type)
    if not candidates:
        return None

    # Several model_types can share a class (llama, code_llama, exaone...): prefer the one whose name
    # is the architecture's stem (DeepseekV3ForCausalLM -> deepseek_v3).
    def norm(x: str) -> str:
        return "".join(ch for ch in x.lower() if ch.isalnum())

    stem = norm(arch)
    for suffix in ("forcausallm", "forconditionalgeneration", "lmheadmodel", "model"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    exact = [c for c in candidates if norm(c) == stem]
    prefix = sorted((c for c in candidates if stem.startswith(norm(c))), key=len, reverse=True)
    return (exact or prefix or candidates)[0]

