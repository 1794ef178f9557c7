"""Drafter checkpoints in the speculators format vLLM 0.26.0 loads, and reading a target's embeddings.

``config.json`` follows the speculators layout (``speculators_model_type: eagle3``,
``transformer_layer_config`` of a one-layer Llama, ``draft_vocab_size``, ``target_hidden_size``, norm
flags, ``speculators_config.verifier``) with ``eagle_aux_hidden_state_layer_ids`` at the top level;
``model.safetensors`` holds ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (and
``embed_tokens`` only when the drafter has its own).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagle3lab.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3lab.errors import check_safetensors

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def _safetensors_files(target_path: Path) -> list[Path]:
    idx = target_path / "model.safetensors.index.json"
    if idx.is_file():
        names = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        return [target_path / n for n in names]
    files = sorted(target_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in target folder {target_path}")
    return files


def target_embedding_weights(target_path: str | Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(embed_tokens.weight, lm_head.weight or None) of a saved target, read without building the model.

    Names are matched by suffix so wrapped checkpoints (``language_model.model.embed_tokens.weight``)
    work; a tied model without ``lm_head.weight`` gets None.
    """
    from safetensors import safe_open

    embed = head = None
    for f in _safetensors_files(Path(target_path)):
        check_safetensors(f, "target weights file")
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                if name.endswith("embed_tokens.weight") and "mtp" not in name and embed is None:
                    embed = sf.get_tensor(name)
                elif name.endswith("lm_head.weight") and head is None:
                    head = sf.get_tensor(name)
    if embed is None:
        raise FileNotFoundError(f"no *embed_tokens.weight tensor in the target at {target_path}")
    return embed.float(), None if head is None else head.float()


def speculators_config(
    cfg: DrafterConfig,
    target_path_or_name: str | Path,
    num_speculative_tokens: int = 3,
    verifier_architectures: Sequence[str] | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The config.json vLLM 0.26.0 reads for a speculators-format EAGLE-3 drafter."""
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        # transformers 5 reads rope_parameters, 4.x reads rope_theta: give both.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # vLLM's Eagle3 LlamaModel sizes fc from this (else from eagle_config, else assumes 3).
        "num_aux_hidden_states": cfg.num_aux,
        "dtype": dtype,  # transformers 5 name (4.x read torch_dtype; 5.x warns on it)
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        # Top level on purpose: vLLM copies it onto the draft hf_config, where both model runners read it
        # (0.26's V2 runner ignores eagle_config). vLLM's convention: input of layer k.
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}
            ],
            "verifier": {
                "name_or_path": str(target_path_or_name),
                "architectures": list(verifier_architectures or []),
            },
        },
        # Ours, ignored by vLLM: what load_drafter needs to rebuild the module exactly.
        "eagle3lab": {"drafter_config": asdict(cfg)},
    }


def save_drafter(
    drafter: Eagle3Drafter,
    path: str | Path,
    target_path_or_name: str | Path,
    num_speculative_tokens: int = 3,
    verifier_architectures: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json + model.safetensors in the speculators format vLLM 0.26.0 loads; return the folder.

    Weight names: fc.weight, layers.0.*, norm.weight, lm_head.weight, d2t, t2d, and embed_tokens.weight
    only when the drafter has its own embeddings (otherwise vLLM shares the target's).
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    sd = drafter.checkpoint_state_dict()
    if dtype is not None:
        sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    dtype_name = str(next(v for v in sd.values() if v.is_floating_point()).dtype).replace("torch.", "")
    cfg = speculators_config(drafter.config, target_path_or_name, num_speculative_tokens, verifier_architectures,
                             dtype_name)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file({k: v.cpu() for k, v in sd.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", *, embed_weight: torch.Tensor | None = None
) -> Eagle3Drafter:
    """Read a drafter written by :func:`save_drafter`.

    With shared embeddings the checkpoint has none: they come from ``embed_weight`` or, by default, from
    the verifier folder named in the config (the target's safetensors).
    """
    from safetensors.torch import load_file

    p = Path(path)
    cfg_file, w_file = p / CONFIG_NAME, p / WEIGHTS_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(f"drafter folder {p}: no {CONFIG_NAME}")
    if not w_file.is_file():
        raise FileNotFoundError(f"drafter folder {p}: no {WEIGHTS_NAME}")
    raw = json.loads(cfg_file.read_text())
    if raw.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{cfg_file}: not a speculators eagle3 config (speculators_model_type missing or different)")
    ours = (raw.get("eagle3lab") or {}).get("drafter_config")
    cfg = DrafterConfig(**ours) if ours else _config_from_speculators(raw)
    check_safetensors(w_file, "drafter weights file", "save the drafter again (rerun 04_train_drafter)")
    sd = load_file(str(w_file))
    drafter = Eagle3Drafter(cfg, sd["d2t"], sd["t2d"].bool())
    if cfg.shared_embeddings:
        if embed_weight is None:
            verifier = raw["speculators_config"]["verifier"]["name_or_path"]
            if not Path(verifier).is_dir():
                raise FileNotFoundError(
                    f"drafter {p} shares the target's embeddings, but its verifier {verifier!r} is not a local "
                    "folder; pass embed_weight="
                )
            embed_weight, _ = target_embedding_weights(verifier)
        sd["embed_tokens.weight"] = embed_weight
    missing, unexpected = drafter.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter {p}: missing weights {missing}, unexpected weights {unexpected}")
    return drafter.to(device).eval()


def _config_from_speculators(raw: dict[str, Any]) -> DrafterConfig:
    # A checkpoint from elsewhere (no eagle3lab section): rebuild the config from the standard fields.
    layer = raw["transformer_layer_config"]
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if not ids:
        raise ValueError("speculators config without eagle_aux_hidden_state_layer_ids")
    h = int(layer["hidden_size"])
    th = int(raw.get("target_hidden_size") or h)
    rope = layer.get("rope_parameters") or {}
    return DrafterConfig(
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
        hidden_size=h,
        target_hidden_size=th,
        aux_layer_ids=list(ids),
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=layer.get("head_dim"),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        norm_before_residual=bool(raw.get("norm_before_residual", True)),
        shared_embeddings=h == th,
    )


def expected_vllm_weight_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes vLLM 0.26.0's Eagle3LlamaForCausalLM.load_weights accepts for ``cfg``.

    Derived by reading llama_eagle3.py: names without a "model." prefix (load_weights adds it except for
    lm_head), q/k/v and gate/up unfused (its mapper stacks them into qkv_proj / gate_up_proj), qkv input
    2*H for layer 0, hidden_norm in the layer, d2t renamed to draft_id_to_target_id, t2d skipped.
    """
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_aux * cfg.target_hidden_size),
        "layers.0.self_attn.q_proj.weight": (cfg.num_attention_heads * hd, 2 * h),
        "layers.0.self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, 2 * h),
        "layers.0.self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, 2 * h),
        "layers.0.self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
        "layers.0.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "layers.0.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "layers.0.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "layers.0.input_layernorm.weight": (h,),
        "layers.0.hidden_norm.weight": (h,),
        "layers.0.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
    if not cfg.shared_embeddings:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, h)
    return shapes


