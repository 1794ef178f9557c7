"""How far a bf16 (or fp16) forward of a run's target strays from float32: the measured yardstick that 05 uses to
read a greedy mismatch as a tie the precision cannot resolve (``eagle3lab.divergence.precision_error``).

    python benchmarks/tools/precision_error.py outputs/<run> [--prompts 32] [--new-tokens 64] [--dtype bfloat16]
        [--device cpu] [--out benchmarks/precision-error-<host>-<date>.json]

The target is loaded in float32, its greedy continuations of the run's held-out prompts are generated in float32,
and both precisions are run over those whole sequences. The JSON records the figures with machine and date.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eagle3lab import divergence as D
from eagle3lab.speculate import greedy_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder with artifacts/target (and artifacts/data/heldout_prompts.jsonl "
                    "once 03 has run)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    target, heldout = a.run / "artifacts/target", a.run / "artifacts/data/heldout_prompts.jsonl"
    if not target.exists():
        raise SystemExit(f"{target} does not exist: give a run folder that reached 00")
    m32 = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval().to(a.device)
    low = copy.deepcopy(m32).to(getattr(torch, a.dtype))
    if heldout.exists():
        prompts = [json.loads(line)["prompt_ids"] for line in heldout.read_text().splitlines()[: a.prompts]]
        prompts_from = str(heldout)
    else:  # a run that stopped after 00: the held-out prompts its 03 would make, from its own params
        from transformers import AutoTokenizer

        from eagle3lab.params import load
        from eagle3lab.synthetic import profile_prompts

        prompts = profile_prompts(load(a.run / "params.yaml"), AutoTokenizer.from_pretrained(target))[1][: a.prompts]
        prompts_from = "synthetic.profile_prompts(<run>/params.yaml): the held-out prompts 03 would make"
    t0 = time.perf_counter()
    eos = m32.config.eos_token_id if isinstance(m32.config.eos_token_id, int) else None  # generate() stops there too
    seqs = [p + greedy_generate(m32, p, a.new_tokens, eos) for p in prompts]
    err = D.precision_error(m32, low, seqs, [len(p) for p in prompts])
    rec = {"run": str(a.run), "prompts_from": prompts_from, "target_layers": m32.config.num_hidden_layers, "hidden_size": m32.config.hidden_size,
           "prompts": len(prompts), "new_tokens": a.new_tokens, "device": a.device, **err.to_dict(),
           "share_moved_at_least": {str(m): err.share_at_least(m) for m in (0.02, 0.05, 0.1, 0.2, 0.4)},
           "seconds_generate_and_measure": round(time.perf_counter() - t0, 1), "host": platform.node(), "machine": platform.processor()
           or platform.machine(), "torch": torch.__version__, "date": datetime.now(UTC).isoformat(timespec="seconds")}
    text = json.dumps(rec, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
