"""Lint an EAGLE-3 drafter's config (and weights' shapes, when present) against its target and the installed vLLM.

The target may be of any family: its layer count, hidden size and vocabulary are read from its text config as
vLLM reads them (``hf_text_config``: the ``text_config`` of a multimodal wrapper such as Kimi-K2.5, Kimi-VL or
Gemma-3, else the top level), with transformers' config class supplying what config.json leaves out (Gemma-3's
config.json carries no ``vocab_size``: vLLM gets transformers' default). DeepSeek-only rules (the router bias)
are applied only to targets whose text stack the installed vLLM serves with ``deepseek_v2.py``.

Most drafter mistakes do not crash: aux ids one layer early (the SGLang convention read by vLLM),
ids under ``eagle_config`` that a runner never reads, a draft vocabulary without its ``d2t`` map.
They show up as low acceptance. This module finds them from the config files alone; what the
installed vLLM accepts is read from its source files (``ast`` / text, through
:func:`eagle3lab.vllm_compat.read_source`), without importing it. The aux-id rules are
:mod:`eagle3lab.aux_layers`'s; this module only chooses a severity for each.
"""

from __future__ import annotations

import ast
import json
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3lab import servable, vllm_compat
from eagle3lab.aux_layers import (
    aux_id_problems,
    default_aux_layer_ids,
    sglang_default_ids,
    sglang_to_vllm,
)
from eagle3lab.diagnose.aux_ids import drafter_aux_ids
from eagle3lab.diagnose.target_info import read_json_config, target_info, text_config_of

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    """One lint result."""

    severity: str  # "error" | "warning" | "info"
    code: str
    message: str


@dataclass
class LintReport:
    """All findings for one drafter/target pair."""

    drafter_config: str
    target_config: str
    vllm_version: str | None
    aux_ids: list[int] | None
    findings: list[Finding] = field(default_factory=list)

    @property
    def has_errors(self) -> bool:
        """True when any finding is an error (the CLI exits 1)."""
        return any(f.severity == "error" for f in self.findings)

    @property
    def codes(self) -> list[str]:
        """The finding codes, in order."""
        return [f.code for f in self.findings]

    def add(self, severity: str, code: str, message: str) -> None:
        """Append a finding (severity must be one of :data:`SEVERITIES`)."""
        if severity not in SEVERITIES:
            raise ValueError(f"unknown severity {severity!r}")
        self.findings.append(Finding(severity, code, message))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``has_errors`` included)."""
        d = asdict(self)
        d["has_errors"] = self.has_errors
        return d


# --------------------------------------------------------------------------------------------------
# Reading the installed vLLM without importing it
# --------------------------------------------------------------------------------------------------


def _read(rel: str) -> str | None:
    return vllm_compat.read_source(rel)


def installed_drafter_archs() -> set[str] | None:
    """Architecture names the installed registry maps to an EAGLE-3 drafter class (``_SPECULATIVE_DECODING_MODELS``)."""
    src = _read("model_executor/models/registry.py")
    if src is None:
        return None
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_SPECULATIVE_DECODING_MODELS" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return {
                k.value
                for k, v in zip(node.value.keys, node.value.values, strict=False)
                if isinstance(k, ast.Constant) and "eagle3" in ast.unparse(v).lower()
            }
    return None


def installed_speculators_types() -> tuple[set[str], set[str]] | None:
    """(speculators_model_type values, transformer_layer_config model_types) the installed vLLM accepts for eagle3."""
    src = _read("transformers_utils/configs/speculators/algos.py")
    if src is None:
        return None
    tree = ast.parse(src)
    types: set[str] = set()
    layer_types: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        names = [
            d.args[0].value
            for d in fn.decorator_list
            if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)
        ]
        types.update(names)
        if "eagle3" in names:
            for node in ast.walk(fn):
                if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
                    vals = [v.value for v in node.values if isinstance(v, ast.Constant)]
                    if any("Eagle3" in str(v) for v in vals):
                        layer_types.update(k.value for k in node.keys)
    return types, layer_types


def aux_id_readers() -> list[tuple[str, str, bool]]:
    """Functions of the installed vLLM model runners that read ``eagle_aux_hidden_state_layer_ids``.

    Returns (file, function, reads eagle_config too) for each innermost such function under
    ``vllm/v1/worker`` (the V1 runner and, where present, the V2 runner's EAGLE-3 helpers).
    """
    root = vllm_compat.vllm_package_dir()
    key = "eagle_aux_hidden_state_layer_ids"
    out = []
    for path in sorted((root / "v1" / "worker").rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if key not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue

        def mentions(fn: ast.AST) -> bool:
            return any(
                (isinstance(n, ast.Constant) and n.value == key) or (isinstance(n, ast.Attribute) and n.attr == key)
                for n in ast.walk(fn)
            )

        funcs = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and mentions(f)]
        for fn in funcs:
            if any(g is not fn and g in set(ast.walk(fn)) for g in funcs):
                continue  # an outer function: the nested reader is reported instead
            nested = any(isinstance(n, ast.Constant) and n.value == "eagle_config" for n in ast.walk(fn))
            out.append((str(path.relative_to(root.parent)), fn.name, nested))
    return out


def installed_fc_aux_count(drafter_cfg: dict[str, Any]) -> tuple[int | None, str]:
    """How many aux states the installed vLLM's Llama EAGLE-3 drafter builds its fc for, and why.

    Read from ``llama_eagle3.py``: either a fixed ``fc_input_size = ... * N`` or
    ``num_aux_hidden_states`` (config) falling back to len(eagle_config ids), then a constant.
    """
    src = _read("model_executor/models/llama_eagle3.py")
    if src is None:
        return None, "llama_eagle3.py not found"
    if "num_aux_hidden_states" in src:
        layer = drafter_cfg.get("transformer_layer_config") or {}
        n = drafter_cfg.get("num_aux_hidden_states", layer.get("num_aux_hidden_states"))
        if n:
            return int(n), "num_aux_hidden_states in the drafter config"
        nested = (drafter_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if nested:
            return len(nested), "len(eagle_config.eagle_aux_hidden_state_layer_ids)"
        m = re.search(r"len\(layer_ids\)\s+if\s+layer_ids\s+else\s+(\d+)", src)
        if m:
            return int(m.group(1)), "vLLM's fallback (no num_aux_hidden_states, no eagle_config ids)"
        return None, "could not read the fallback count"
    m = re.search(r"fc_input_size\s*=\s*[^\n]*\*\s*(\d+)", src)
    if m:
        return int(m.group(1)), "fixed in this vLLM's llama_eagle3.py"
    return None, "could not read the fc width rule"


# --------------------------------------------------------------------------------------------------
# Weights' shapes without loading them
# --------------------------------------------------------------------------------------------------


def safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape for every ``*.safetensors`` file in ``folder``, from the headers only.

    The header is an 8-byte little-endian length then JSON; reading it directly costs no tensor I/O
    and no framework import (the same information ``safe_open(...).get_slice(k).get_shape()`` gives).
    """
    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ValueError(f"{f}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                raise ValueError(f"{f}: not a safetensors file (header length {n})")
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__" and isinstance(v, dict):
                shapes[k] = list(v.get("shape", []))
    return shapes


def _find(shapes: dict[str, list[int]], suffix: str) -> tuple[str, list[int]] | None:
    for k, v in shapes.items():
        if k == suffix or k.endswith("." + suffix):
            return k, v
    return None


# --------------------------------------------------------------------------------------------------
# The target's text stack, whatever its family
# --------------------------------------------------------------------------------------------------

TARGET_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size")


@dataclass
class TargetFields:
    """What the lint needs from a target: its text stack's layer count, width and vocabulary, and their origin."""

    architecture: str
    config_path: str
    model_type: str | None
    text_model_type: str | None
    text_config_key: str | None  # "text_config" (or language_config / llm_config) for a wrapper, None: top level
    num_hidden_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    from_transformers: list[str] = field(default_factory=list)  # fields config.json lacks, from transformers

    def describe(self) -> str:
        """One sentence: the target, where its text config is, and the three values."""
        where = f"its {self.text_config_key}" if self.text_config_key else "the top level"
        vals = ", ".join(f"{f} {getattr(self, f)}" for f in TARGET_FIELDS)
        s = f"target {self.architecture}: text config at {where} (model_type {self.text_model_type}): {vals}"
        if self.from_transformers:
            s += (f" ({', '.join(self.from_transformers)} not in config.json: transformers' {self.text_model_type} "
                  "config gives it, as vLLM loads it)")
        return s


def _transformers_text_config(cfg: dict[str, Any], text: dict[str, Any]) -> Any | None:
    """transformers' text config for this config.json (defaults and attribute aliases applied), or None."""
    try:
        from transformers import CONFIG_MAPPING
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        # The whole config first (a wrapper's class builds its text sub-config), then the text config alone
        # (a wrapper transformers does not know, such as Kimi-K2.5, around one it knows).
        for conf, mt in ((cfg, cfg.get("model_type")), (text, text.get("model_type"))):
            if not mt or mt not in CONFIG_MAPPING:
                continue
            try:
                built = CONFIG_MAPPING[mt](**{k: v for k, v in conf.items() if k != "model_type"})
                return built.get_text_config() if hasattr(built, "get_text_config") else built
            except Exception:  # noqa: BLE001, S112 - a config transformers cannot build: try the next, else None
                continue
        return None
    finally:
        hf_logging.set_verbosity(level)


def target_fields(target_config: str | Path) -> TargetFields:
    """The target's text-stack fields, as vLLM reads them (``hf_text_config``), for any family.

    config.json's values come first (its text config's, as :func:`target_info` reads them); a field it lacks,
    or names otherwise (GPT-2's ``n_layer``), comes from transformers' config class for its model_type.
    """
    tinfo = target_info(Path(target_config))
    cfg, _ = read_json_config(tinfo.config_path or target_config)
    text = text_config_of(cfg)
    key = next((k for k, v in cfg.items() if v is text), None)
    values = {f: getattr(tinfo, f) for f in TARGET_FIELDS}
    missing = [f for f, v in values.items() if v is None]
    filled = []
    if missing:
        built = _transformers_text_config(cfg, text)
        for f in missing:
            v = getattr(built, f, None) if built is not None else None
            if isinstance(v, int) and not isinstance(v, bool):
                values[f] = v
                filled.append(f)
    return TargetFields(
        architecture=tinfo.architecture, config_path=str(tinfo.config_path), model_type=tinfo.model_type,
        text_model_type=tinfo.text_model_type, text_config_key=key,
        num_hidden_layers=_int_or_none(values["num_hidden_layers"]), hidden_size=_int_or_none(values["hidden_size"]),
        vocab_size=_int_or_none(values["vocab_size"]), from_transformers=filled,
    )


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def installed_model_modules() -> dict[str, str] | None:
    """Architecture -> module name (``deepseek_v2``, ``glm4_moe``...) of the installed vLLM's text and multimodal models."""
    src = _read("model_executor/models/registry.py")
    if src is None:
        return None
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")
                    for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            for k, v in zip(node.value.keys, node.value.values, strict=False):
                if (isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and v.elts
                        and isinstance(v.elts[0], ast.Constant)):
                    out[str(k.value)] = str(v.elts[0].value)
    return out


def text_stack_modules(target: TargetFields, cfg: dict[str, Any]) -> list[str]:
    """The installed vLLM's modules that build this target's text stack (empty: cannot tell).

    The architecture's own module, the text config's architectures', the architectures the wrapper's module
    builds its language model as (``architectures=["DeepseekV2ForCausalLM"]`` in ``kimi_k25.py``), and the
    causal-LM class transformers names for the text model_type.
    """
    modules = installed_model_modules()
    if not modules:
        return []
    archs = [target.architecture, *(text_config_of(cfg).get("architectures") or [])]
    own = modules.get(target.architecture)
    if own:
        src = _read(f"model_executor/models/{own}.py") or ""
        archs += re.findall(r"architectures\s*=\s*\[\s*[\"']([A-Za-z0-9_]+)[\"']", src)
    if target.text_model_type:
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
        except ImportError:
            causal = {}
        name = causal.get(target.text_model_type)
        archs += [name] if isinstance(name, str) else list(name or [])
    return list(dict.fromkeys(modules[a] for a in archs if a in modules))


# --------------------------------------------------------------------------------------------------
# The lint
# --------------------------------------------------------------------------------------------------


_SGLANG_TOOLS = ("specforge", "torchspec", "sglang")


def lint_drafter(drafter_config: str | Path, target_config: str | Path) -> LintReport:
    """Lint a drafter config (file or folder) against the target's config (file or folder)."""
    dcfg, dpath = read_json_config(drafter_config)
    target = target_fields(Path(target_config))
    L, H_t, V_t = target.num_hidden_layers, target.hidden_size, target.vocab_size
    layer_cfg = dcfg.get("transformer_layer_config") or {}
    ids, where = drafter_aux_ids(dcfg)
    report = LintReport(str(dpath), target.config_path, vllm_compat.vllm_version() or None, ids)
    shapes = safetensors_shapes(dpath.parent)

    report.add("info", "TARGET", target.describe())
    unknown = [f for f in TARGET_FIELDS if getattr(target, f) is None]
    if unknown:
        skipped = {"num_hidden_layers": "the aux ids' range", "hidden_size": "the hidden sizes",
                   "vocab_size": "the vocabularies"}
        report.add(
            "warning",
            "TARGET_UNKNOWN",
            f"the target's text config gives no {', '.join(unknown)} (nor does transformers for model_type "
            f"{target.text_model_type!r}): {', '.join(skipped[f] for f in unknown)} not checked",
        )

    report.add(
        "info",
        "AUX_CONVENTION",
        "vLLM's aux id k is the residual stream at the input of layer k (k == num_layers: the final "
        "pre-norm state); SGLang (and SpecForge/TorchSpec configs) capture the output of layer i, which is "
        "vLLM's id i+1",
    )

    # -- aux ids -------------------------------------------------------------------------------------
    effective = ids
    if ids is None:
        if L is None:
            report.add("warning", "AUX_UNKNOWN", "no aux ids in the drafter config and no num_hidden_layers in the target's")
        else:
            effective = default_aux_layer_ids(L)
            report.add("info", "AUX_DEFAULT", f"no aux ids in the drafter config: vLLM uses its default rule {effective}")
    if effective is not None:
        for problem in aux_id_problems(effective, L):
            report.add("error" if problem.is_error else "warning", problem.code, f"ids {effective}: {problem.message}")
    if ids is not None and L is not None:
        text = json.dumps(dcfg).lower()
        tool = next((t for t in _SGLANG_TOOLS if t in text), None)
        vllm_ids = sglang_to_vllm(ids)
        if ids == sglang_default_ids(L) or (tool and ids != default_aux_layer_ids(L)) or (0 in ids):
            why = (
                f"they equal SGLang's default pattern (1, L//2-1, L-4) for L={L}" if ids == sglang_default_ids(L)
                else f"the config names {tool}" if tool else "they include id 0 (SGLang's output of layer 0)"
            )
            bad = [i for i in vllm_ids if i > L]
            report.add(
                "warning",
                "AUX_SGLANG",
                f"aux ids {ids} look like SGLang's convention ({why}); vLLM reads them literally, one layer "
                f"early. In vLLM's convention they are {vllm_ids}"
                + (f" (note: {bad} would exceed {L})" if bad else ""),
            )

    # -- where the ids live vs where this vLLM reads them -------------------------------------------
    if where == "drafter config (eagle_config)":
        blind = [(f, fn) for f, fn, reads_nested in aux_id_readers() if not reads_nested]
        if blind:
            sev = "error" if L is not None and ids != default_aux_layer_ids(L) else "warning"
            places = ", ".join(f"{f}:{fn}()" for f, fn in blind)
            report.add(
                sev,
                "AUX_PLACEMENT",
                f"aux ids {ids} are only under eagle_config; {places} read(s) only the top-level "
                "eagle_aux_hidden_state_layer_ids and would silently fall back to the default rule: put them "
                "at the top level too",
            )

    # -- fc width: ids vs weights vs what vLLM builds ----------------------------------------------
    n_ids = len(effective) if effective is not None else None
    t_hidden = dcfg.get("target_hidden_size") or layer_cfg.get("target_hidden_size")
    width_basis = t_hidden or H_t
    fc = _find(shapes, "fc.weight")
    if fc is not None and width_basis and n_ids:
        key, shape = fc
        if len(shape) == 2 and shape[1] != n_ids * width_basis:
            n_w = shape[1] / width_basis
            report.add(
                "error",
                "FC_WIDTH",
                f"{key} has shape {shape}: {n_w:g} aux states of width {width_basis}, but {n_ids} aux ids "
                f"are configured ({effective})",
            )
    fc_n, fc_why = installed_fc_aux_count(dcfg)
    if fc_n is not None and n_ids is not None and fc_n != n_ids:
        report.add(
            "error",
            "FC_COUNT",
            f"the installed vLLM builds the drafter's fc for {fc_n} aux states ({fc_why}) but {n_ids} ids "
            "are configured: set num_aux_hidden_states (or eagle_config ids) to match",
        )

    # -- hidden sizes ----------------------------------------------------------------------------------
    d_hidden = dcfg.get("hidden_size") or layer_cfg.get("hidden_size")
    if H_t is not None:
        if t_hidden is not None and int(t_hidden) != int(H_t):
            report.add("error", "HIDDEN_SIZE", f"target_hidden_size {t_hidden} != the target's hidden_size {H_t}")
        elif t_hidden is None and d_hidden is not None and int(d_hidden) != int(H_t):
            report.add(
                "error",
                "HIDDEN_SIZE",
                f"no target_hidden_size and the drafter's hidden_size {d_hidden} != the target's {H_t}: vLLM "
                "then sizes fc for the drafter's width; set target_hidden_size",
            )

    # -- vocabularies ----------------------------------------------------------------------------------
    # The drafter's vocab_size is the target's vocabulary (embeddings, and what d2t maps into): vLLM builds
    # the drafter for that size, so another one mismatches the target's token ids.
    d_vocab = dcfg.get("vocab_size") or layer_cfg.get("vocab_size")
    if d_vocab is not None and V_t is not None and int(d_vocab) != int(V_t):
        report.add("error", "VOCAB_SIZE", f"the drafter's vocab_size {d_vocab} != the target's vocab_size {V_t}")
    dv = dcfg.get("draft_vocab_size") or layer_cfg.get("draft_vocab_size")
    if dv is not None and V_t is not None:
        if int(dv) > int(V_t):
            report.add("error", "VOCAB_SIZE", f"draft_vocab_size {dv} > the target's vocab_size {V_t}")
        elif int(dv) < int(V_t):
            d2t = _find(shapes, "d2t")
            if shapes and d2t is None:
                report.add(
                    "error", "VOCAB_D2T", f"draft vocab {dv} < target vocab {V_t} but the weights carry no d2t map"
                )
            elif d2t is not None and d2t[1] and d2t[1][0] != int(dv):
                report.add("error", "VOCAB_D2T", f"d2t has {d2t[1][0]} entries, draft_vocab_size is {dv}")
            elif not shapes:
                report.add(
                    "info", "VOCAB_D2T", f"draft vocab {dv} < target vocab {V_t}: the weights must carry d2t "
                    "(no safetensors next to the config to check)",
                )
    lm = _find(shapes, "lm_head.weight")
    if lm is not None and dv is not None and lm[1] and lm[1][0] != int(dv):
        report.add("error", "VOCAB_SIZE", f"{lm[0]} has {lm[1][0]} rows, draft_vocab_size is {dv}")

    # -- does this vLLM accept the drafter? ------------------------------------------------------------
    _lint_architecture(report, dcfg, layer_cfg)
    # -- will the installed vLLM serve them (rules read from vLLM: servable) ------------------------------
    _add_servable(report, dcfg, Path(target_config), target)
    return report


def _lint_architecture(report: LintReport, dcfg: dict[str, Any], layer_cfg: dict[str, Any]) -> None:
    ver = report.vllm_version or "(vLLM not installed)"
    spec_type = dcfg.get("speculators_model_type")
    if spec_type is not None:
        accepted = installed_speculators_types()
        if accepted is None:
            report.add("warning", "ARCH", f"cannot read vLLM {ver}'s speculators support")
            return
        types, layer_types = accepted
        if spec_type not in types:
            report.add("error", "ARCH", f"speculators_model_type {spec_type!r} not accepted by vLLM {ver} ({sorted(types)})")
        elif spec_type == "eagle3" and layer_types:
            mt = layer_cfg.get("model_type", "llama")
            if mt not in layer_types:
                report.add(
                    "error", "ARCH",
                    f"transformer_layer_config.model_type {mt!r} not accepted for eagle3 by vLLM {ver} ({sorted(layer_types)})",
                )
        return
    archs = dcfg.get("architectures") or []
    if not archs:
        report.add("error", "ARCH", "neither speculators_model_type nor architectures: vLLM cannot load this drafter")
        return
    known = installed_drafter_archs()
    if known is None:
        report.add("warning", "ARCH", f"cannot read vLLM {ver}'s registry")
    elif archs[0] not in known:
        report.add(
            "error", "ARCH",
            f"architecture {archs[0]!r} is not an EAGLE-3 drafter in vLLM {ver}'s registry (known: {sorted(known)})",
        )


def format_lint(r: LintReport) -> str:
    """Human-readable text of a :class:`LintReport`, errors first."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    n = {s: sum(f.severity == s for f in r.findings) for s in SEVERITIES}
    lines = [
        f"drafter {r.drafter_config} vs target {r.target_config} on vLLM {r.vllm_version}: "
        f"{n['error']} error(s), {n['warning']} warning(s), {n['info']} note(s)",
        f"  aux ids: {r.aux_ids}",
    ]
    for f in sorted(r.findings, key=lambda f: order[f.severity]):
        lines.append(f"  {f.severity.upper():7s} {f.code}: {f.message}")
    return "\n".join(lines)


def _add_servable(report: LintReport, dcfg: dict[str, Any], target: Path, fields: TargetFields) -> None:
    """The drafter's head_dim and the target's MLA dims / router keys against the installed vLLM.

    The router rule is ``deepseek_v2.py``'s (the bias exists only for ``topk_method: noaux_tc``): it is applied
    where that module builds the target's text stack, or where the stack's module cannot be told; GLM-4-MoE's
    module, for one, always creates the bias, so the rule would refuse a sound GLM checkpoint.
    """
    if not vllm_compat.vllm_version():
        return
    try:
        cfg, folder = servable.read_config(target)
        found = servable.check_drafter_config(dcfg)
        mla = servable.check_mla(cfg)
        found += [mla] if mla is not None else []
        modules = text_stack_modules(fields, cfg)
        if "deepseek_v2" in modules or not modules:
            router = servable.check_router(cfg, folder)
            found += [router] if router is not None else []
        elif text_config_of(cfg).get("n_routed_experts"):
            report.add("info", "ROUTER_BIAS", f"the router-bias rule is DeepSeek-V2's (deepseek_v2.py); this "
                       f"target's text stack is built by {', '.join(m + '.py' for m in modules)}: not applied")
    except Exception as exc:  # noqa: BLE001 - a vLLM without these modules: say so, do not fail the lint
        report.add("info", "SERVABLE_UNKNOWN", f"could not check servability on this vLLM: {type(exc).__name__}: {exc}")
        return
    for f in found:
        report.add({"ok": "info"}.get(f.level, f.level), f.code, f.message)
