"""The EAGLE-3 drafter: vLLM 0.26.0's ``Eagle3LlamaForCausalLM``, weight for weight and op for op.

Three modules: :mod:`.vocab` (the draft vocabulary and vLLM's d2t/t2d maps), :mod:`.model` (the module,
its config, and building one for a target) and :mod:`.checkpoint` (the speculators-format checkpoint vLLM
loads, and reading a target's embeddings). Everything public is re-exported here:
``from eagle3lab.drafter import build_drafter, save_drafter``.
"""

from eagle3lab.drafter.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    expected_vllm_weight_shapes,
    load_drafter,
    save_drafter,
    speculators_config,
    target_embedding_weights,
)
from eagle3lab.drafter.model import (
    MLP,
    Attention,
    DecoderLayer,
    DrafterConfig,
    Eagle3Drafter,
    RMSNorm,
    build_drafter,
    causal_mask,
    default_drafter_heads,
    describe,
    init_from_target,
    make_drafter_config,
    rotary,
)
from eagle3lab.drafter.vocab import (
    VocabCoverage,
    build_draft_vocab,
    draft_to_target,
    target_to_draft,
    token_counts_from_sequences,
    vocab_coverage,
)

__all__ = [
    "CONFIG_NAME", "MLP", "WEIGHTS_NAME", "Attention", "DecoderLayer", "DrafterConfig", "Eagle3Drafter", "RMSNorm",
    "VocabCoverage", "build_draft_vocab", "build_drafter", "causal_mask", "default_drafter_heads", "describe",
    "draft_to_target", "expected_vllm_weight_shapes", "init_from_target", "load_drafter", "make_drafter_config",
    "rotary", "save_drafter", "speculators_config", "target_embedding_weights", "target_to_draft",
    "token_counts_from_sequences", "vocab_coverage",
]
