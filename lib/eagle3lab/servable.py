"""Will the installed vLLM serve this target and this drafter? Checked before any work starts.

Three refusals were seen on an H200 with vLLM 0.26 (2026-11-29), each only after minutes of set-up:
- MLA prefill: no backend for the target's (qk_nope, qk_rope, v) head dims ("No valid MLA prefill backend");
- weight loading: transformers' DeepSeek-V3 saves ``mlp.gate.e_score_correction_bias``, which vLLM creates only
  when the config says ``topk_method: noaux_tc`` (KeyError at load otherwise);
- the drafter's attention: a head_dim the FlashAttention path does not take sent it to a kernel that is not
  installed.

The rules are read from the installed vLLM, never copied: the MLA prefill backends' own
``supports_mla_dimensions`` / ``supports_compute_capability`` where they import, else the ``MLADimensions``
literals in their source; the router condition from ``deepseek_v2.py``'s source; the head sizes from
FlashAttention's ``supports_head_size``, executed from its source with and without FA4's optional CuTe path
(its kernels are not in a plain install).
"""

from __future__ import annotations

import ast
import contextlib
import io
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3lab import vllm_compat
from eagle3lab.diagnose.target_info import read_json_config, text_config_of

HOPPER = (9, 0)


@dataclass
class Finding:
    """One verdict: ``level`` is "error" (vLLM will refuse), "warning" (may refuse) or "ok"."""

    code: str
    level: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_config(path_or_config: str | Path | dict[str, Any]) -> tuple[dict[str, Any], Path | None]:
    """A target config as a dict (from a dict, a config.json or a checkpoint folder) and its folder."""
    if isinstance(path_or_config, dict):
        return path_or_config, None
    cfg, file = read_json_config(path_or_config)
    return cfg, file.parent


# ----------------------------------------------------------------------------------------------------
# MLA prefill


def _quiet() -> contextlib.AbstractContextManager[Any]:
    return contextlib.redirect_stdout(io.StringIO())


def _dims_literals(source: str) -> list[tuple[int, int, int]]:
    """Every ``MLADimensions(qk_nope_head_dim=.., qk_rope_head_dim=.., v_head_dim=..)`` literal in a source."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "MLADimensions":
            kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
            if {"qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"} <= kw.keys():
                out.append((kw["qk_nope_head_dim"], kw["qk_rope_head_dim"], kw["v_head_dim"]))
    return out


def mla_prefill_backends(dims: tuple[int, int, int], capability: tuple[int, int] = HOPPER) -> list[dict[str, Any]]:
    """Each MLA prefill backend of the installed vLLM: does it take ``dims`` on ``capability``?

    ``accepts``/``capability_ok`` are None where neither the class nor its source can tell (then the
    backend is given the benefit of the doubt).
    """
    registry = vllm_compat.import_module("v1.attention.backends.mla.prefill.registry")
    base = vllm_compat.import_module("v1.attention.backends.mla.prefill.base")
    iface = vllm_compat.import_module("platforms.interface")
    want = base.MLADimensions(qk_nope_head_dim=dims[0], qk_rope_head_dim=dims[1], v_head_dim=dims[2])
    cap = iface.DeviceCapability(*capability)
    rows = []
    for member in registry.MLAPrefillBackendEnum:
        if not member.value:
            continue  # CUSTOM: a placeholder for third-party backends
        row: dict[str, Any] = {"backend": member.name, "accepts": None, "capability_ok": None, "how": "class"}
        try:
            with _quiet():
                cls = member.get_class()
            row["accepts"] = bool(cls.supports_mla_dimensions(want))
            row["capability_ok"] = bool(cls.supports_compute_capability(cap))
        except Exception as exc:  # noqa: BLE001 - e.g. CUDA-only imports on a CPU machine: read the source
            module = str(member.value).rsplit(".", 1)[0]
            src = vllm_compat.read_source(module.removeprefix("vllm.").replace(".", "/") + ".py")
            lits = _dims_literals(src) if src else []
            row.update(how=f"source ({type(exc).__name__} on import)", known_dims=lits)
            if lits:
                row["accepts"] = tuple(dims) in lits
        rows.append(row)
    return rows


def check_mla(cfg: dict[str, Any], capability: tuple[int, int] = HOPPER) -> Finding | None:
    """An error when no MLA prefill backend of the installed vLLM takes the target's head dims."""
    c = text_config_of(cfg)
    if "kv_lora_rank" not in c or "qk_rope_head_dim" not in c:
        return None  # not an MLA model
    dims = (int(c.get("qk_nope_head_dim", 0)), int(c["qk_rope_head_dim"]), int(c.get("v_head_dim", 0)))
    rows = mla_prefill_backends(dims, capability)
    usable = [r for r in rows if r["capability_ok"] is not False]
    taking = [r["backend"] for r in usable if r["accepts"]]
    unknown = [r["backend"] for r in usable if r["accepts"] is None]
    cap = f"{capability[0]}.{capability[1]}"
    ev = {"dims": dims, "capability": cap, "backends": rows}
    if taking:
        return Finding("MLA_DIMS", "ok", f"MLA prefill (qk_nope, qk_rope, v) = {dims}: taken by {', '.join(taking)} "
                       f"on compute capability {cap}", ev)
    if unknown:
        return Finding("MLA_DIMS", "warning", f"MLA prefill (qk_nope, qk_rope, v) = {dims}: no backend known to take "
                       f"it on compute capability {cap} (cannot tell for {', '.join(unknown)})", ev)
    known = sorted({d for r in rows for d in r.get("known_dims", [])})
    hint = f"; dims in the installed backends' sources: {known}" if known else ""
    return Finding("MLA_DIMS", "error", f"vLLM will refuse the target: no MLA prefill backend takes (qk_nope, qk_rope, "
                   f"v) = {dims} on compute capability {cap}{hint}", ev)


# ----------------------------------------------------------------------------------------------------
# router weights


def _has_weight_suffix(folder: Path, suffix: str) -> bool | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            if any(k.endswith(suffix) for k in sf.keys()):  # noqa: SIM118 (not a mapping)
                return True
    return False


DEEPSEEK_V2_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")


def check_router(cfg: dict[str, Any], folder: Path | None = None) -> Finding | None:
    """An error when the checkpoint carries a router bias that the installed vLLM will not create."""
    c = text_config_of(cfg)
    # the rule is deepseek_v2.py's: GLM-4-MoE and others create the bias unconditionally
    if not c.get("n_routed_experts") or c.get("model_type") not in DEEPSEEK_V2_MODEL_TYPES:
        return None
    src = vllm_compat.read_source("model_executor/models/deepseek_v2.py") or ""
    gated = '"topk_method", None) == "noaux_tc"' in src and "e_score_correction_bias = nn.Parameter" in src
    if not gated:
        return Finding("ROUTER_BIAS", "ok", "the installed vLLM does not gate the router bias on topk_method", {})
    has_bias = _has_weight_suffix(folder, "e_score_correction_bias") if folder is not None else None
    if has_bias is None:
        # transformers' DeepseekV3 always has (and saves) the bias; DeepSeek-V2 checkpoints do not
        has_bias = c.get("model_type") in ("deepseek_v3", "kimi_k2", "kimi_k25")
    method = c.get("topk_method")
    if has_bias and method != "noaux_tc":
        return Finding("ROUTER_BIAS", "error", f"vLLM will fail to load the weights: the checkpoint has "
                       f"mlp.gate.e_score_correction_bias, which vLLM creates only for topk_method 'noaux_tc' (config: "
                       f"{method!r}); set topk_method: noaux_tc and scoring_func: sigmoid, as DeepSeek-V3 and Kimi-K2.5 do",
                       {"topk_method": method})
    return Finding("ROUTER_BIAS", "ok", f"router: topk_method {method!r}, bias present: {has_bias}", {})


# ----------------------------------------------------------------------------------------------------
# drafter attention


def _supports_head_size(fa4: bool) -> Any | None:
    """FlashAttention's ``supports_head_size`` from the installed vLLM's source, run with FA4 present or not.

    Executed from the source rather than imported: on a GPU host the imported one answers for FA4's CuTe
    path, whose ``nvidia-cutlass-dsl`` kernels a plain install lacks (a 512-wide head failed that way).
    """
    src = vllm_compat.read_source("v1/attention/backends/flash_attn.py")
    if not src:
        return None
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == "supports_head_size":
            node.decorator_list = []
            if node.args.args and node.args.args[0].arg == "cls":
                node.args.args = node.args.args[1:]
            code = compile(ast.Module(body=[node], type_ignores=[]), "<vllm flash_attn.supports_head_size>", "exec")
            ns: dict[str, Any] = {"is_fa_version_supported": lambda v: fa4 and v == 4}
            exec(code, ns)  # noqa: S102 - the installed vLLM's own rule, nothing else
            return ns["supports_head_size"]
    return None


def check_drafter_heads(head_dim: int) -> Finding:
    """Does vLLM's FlashAttention path take the drafter's head_dim (without FA4's optional CuTe kernels)?"""
    plain, with_fa4 = _supports_head_size(False), _supports_head_size(True)
    if plain is None or with_fa4 is None:
        return Finding("DRAFTER_HEAD_DIM", "warning", f"cannot read FlashAttention's head sizes here (head_dim {head_dim})")
    hd = int(head_dim)
    if plain(hd):
        return Finding("DRAFTER_HEAD_DIM", "ok", f"drafter head_dim {hd}: taken by FlashAttention")
    fix = "published drafters use 128 (or the target's head_dim): change drafter.num_attention_heads"
    if with_fa4(hd):
        return Finding("DRAFTER_HEAD_DIM", "warning", f"drafter head_dim {hd} needs FlashAttention 4's CuTe path "
                       f"(package nvidia-cutlass-dsl, absent from a plain vLLM install); {fix}")
    return Finding("DRAFTER_HEAD_DIM", "error", f"drafter head_dim {hd} is not taken by vLLM's FlashAttention "
                   f"(rule read from the installed vLLM); {fix}")


# ----------------------------------------------------------------------------------------------------
# entry points


def check_target(path_or_config: str | Path | dict[str, Any], capability: tuple[int, int] = HOPPER) -> list[Finding]:
    """Findings for a target (checkpoint folder, config.json or config dict) on the installed vLLM."""
    cfg, folder = read_config(path_or_config)
    return [f for f in (check_mla(cfg, capability), check_router(cfg, folder)) if f is not None]


def check_drafter_config(drafter_cfg: dict[str, Any]) -> list[Finding]:
    """Findings for a drafter config.json (speculators format or HF Llama-style)."""
    layer = drafter_cfg.get("transformer_layer_config") or drafter_cfg
    heads = int(layer.get("num_attention_heads") or 1)
    hd = int(layer.get("head_dim") or int(layer["hidden_size"]) // heads)
    return [check_drafter_heads(hd)]


def profile_target_config(params: Any) -> dict[str, Any]:
    """The text config of a profile's target: the checkpoint's, or the fields 00 will give the embedded one."""
    if params.target.source == "checkpoint":
        return text_config_of(read_json_config(params.target.path)[0])
    e = params.target.embedded
    if e.architecture == "glm4_moe":  # grouped-query attention: no MLA dims to check
        return {"model_type": "glm4_moe", "n_routed_experts": e.n_routed_experts, "hidden_size": e.hidden_size,
                "num_attention_heads": e.num_attention_heads, "head_dim": e.head_dim}
    if e.architecture != "deepseek_v3":  # the dense families: no MLA, no router
        return {"model_type": e.architecture, "hidden_size": e.hidden_size,
                "num_attention_heads": e.num_attention_heads, "head_dim": e.head_dim}
    return {"model_type": "deepseek_v3", "kv_lora_rank": e.kv_lora_rank, "qk_rope_head_dim": e.qk_rope_head_dim,
            "qk_nope_head_dim": e.qk_nope_head_dim, "v_head_dim": e.v_head_dim,
            "n_routed_experts": e.n_routed_experts, "topk_method": "noaux_tc", "hidden_size": e.hidden_size,
            "num_attention_heads": e.num_attention_heads}


def check_profile(
    params: Any, drafter_heads: Callable[[int, int | None], int], capability: tuple[int, int] = HOPPER
) -> list[Finding]:
    """Findings for a validated profile: its target (built or on disk) and its drafter's head_dim.

    ``drafter_heads(width, target_heads)`` is the drafter's head rule (``drafter.default_drafter_heads``),
    used where the profile states no head count; passed in because the drafter sits a layer above this module.
    """
    cfg = profile_target_config(params)
    findings = check_target(Path(params.target.path) if params.target.source == "checkpoint" else cfg, capability)
    width = params.drafter.hidden_size or int(cfg["hidden_size"])
    heads = params.drafter.num_attention_heads or drafter_heads(width, cfg.get("num_attention_heads"))
    findings.append(check_drafter_heads(width // heads))
    return findings
