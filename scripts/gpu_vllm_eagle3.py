"""GPU verification with real vLLM: our target and drafter under EAGLE-3, and the patch in a real engine.

STATUS (2026-11-29): written for the GPU engine issue, NOT YET RUN on a device.

    python scripts/gpu_vllm_eagle3.py RUN_DIR OUT_DIR [--prompts 32] [--max-tokens 64] [--k 3]

RUN_DIR is a finished workbook run (its artifacts/target, artifacts/drafter, artifacts/data). Each mode
runs vLLM in a fresh process (engine core in its own process, so the patch reaches it only through our
``vllm.general_plugins`` entry point and ``EAGLE3LAB_PATCH``):

- baseline:      no speculation (the reference greedy output)
- native:        EAGLE-3 with vLLM 0.26's own DeepseekV2 support
- legacy:        the legacy simulation without the patch: vLLM must refuse, as 0.15-0.17 do
- legacy+patch:  the legacy simulation, then our patch (our interface and our forward)
- forced:        our forward installed over the native one (force=True)

It writes OUT_DIR/gpu_vllm_eagle3.json and prints a table: outputs equal to baseline, mean acceptance
length and per-position rates from vLLM's spec-decode counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = {
    "baseline": None,
    "native": {"apply": False, "force": False, "legacy_simulation": False},
    "legacy": {"apply": False, "force": False, "legacy_simulation": True},
    "legacy+patch": {"apply": True, "force": False, "legacy_simulation": True},
    "forced": {"apply": True, "force": True, "legacy_simulation": False},
}
REFUSAL = "does not support EAGLE3 interface"


def child(mode: str, run_dir: Path, out: Path, n: int, max_tokens: int, k: int) -> None:
    """Run one mode in this process and write its JSON."""
    from vllm.inputs import TokensPrompt

    from eagle3lab.acceptance import stats_from_vllm_metrics
    from vllm import LLM, SamplingParams

    prompts = [json.loads(x)["prompt_ids"] for x in (run_dir / "artifacts/data/heldout_prompts.jsonl").open()][:n]
    kw = dict(model=str(run_dir / "artifacts/target"), dtype="bfloat16", enforce_eager=True, seed=0,
              gpu_memory_utilization=0.3, max_model_len=1024, disable_log_stats=False)
    if mode != "baseline":
        kw["speculative_config"] = {"method": "eagle3", "model": str(run_dir / "artifacts/drafter"),
                                    "num_speculative_tokens": k}
    t0 = time.time()
    llm = LLM(**kw)
    start = time.time() - t0
    before = llm.get_metrics()
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    gen = time.time() - t0
    res = {"mode": mode, "engine_start_s": round(start, 1), "generate_s": round(gen, 2),
           "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    if mode != "baseline":
        res["stats"] = stats_from_vllm_metrics(before, llm.get_metrics()).to_dict()
    out.write_text(json.dumps(res))


def parent(run_dir: Path, out_dir: Path, n: int, max_tokens: int, k: int) -> int:
    """Run every mode in a subprocess, compare, write the summary and print a table."""
    from eagle3lab.patch import plugin_env

    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for mode, patch in MODES.items():
        env = dict(os.environ)
        env.pop("EAGLE3LAB_PATCH", None)
        if patch is not None:
            env.update(plugin_env(**patch))
        js = out_dir / f"mode-{mode.replace('+', '_')}.json"
        log = out_dir / f"mode-{mode.replace('+', '_')}.log"
        cmd = [sys.executable, __file__, "--child", mode, str(run_dir), str(js), str(n), str(max_tokens), str(k)]
        with log.open("w") as fh:
            rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=420).returncode
        text = log.read_text(errors="replace")
        r = json.loads(js.read_text()) if rc == 0 and js.exists() else {"mode": mode}
        r["exit_code"] = rc
        r["refused"] = REFUSAL in text
        refusal_lines = [ln.strip() for ln in text.splitlines() if REFUSAL in ln]
        r["refusal_line"] = refusal_lines[0][-200:] if refusal_lines else None
        results[mode] = r
        print(f"{mode}: exit {rc}", flush=True)

    base = results["baseline"].get("outputs")
    table = []
    for mode, r in results.items():
        st = r.get("stats") or {}
        row = {"mode": mode, "exit": r["exit_code"], "refused": r["refused"],
               "equal_to_baseline": (r.get("outputs") == base) if base and r.get("outputs") else None,
               "mean_acceptance_length": st.get("mean_acceptance_length"),
               "per_position_rate": st.get("per_position_rate"),
               "engine_start_s": r.get("engine_start_s"), "generate_s": r.get("generate_s")}
        table.append(row)
    summary = {"run_dir": str(run_dir), "prompts": n, "max_tokens": max_tokens, "k": k, "table": table,
               "native_equals_forced_stats": (results["native"].get("stats") == results["forced"].get("stats")),
               "results": {m: {kk: vv for kk, vv in r.items() if kk != "outputs"} for m, r in results.items()}}
    (out_dir / "gpu_vllm_eagle3.json").write_text(json.dumps(summary, indent=2))
    print(f"{'mode':<14}{'exit':>5}{'refused':>9}{'==base':>8}{'tau':>8}  per-position")
    for r in table:
        tau = f"{r['mean_acceptance_length']:.3f}" if r["mean_acceptance_length"] else "-"
        pp = ", ".join(f"{x:.2f}" for x in r["per_position_rate"] or [])
        print(f"{r['mode']:<14}{r['exit']:>5}{r['refused']!s:>9}{r['equal_to_baseline']!s:>8}{tau:>8}  {pp}")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        mode, run_dir, out, n, mt, k = sys.argv[2:8]
        child(mode, Path(run_dir), Path(out), int(n), int(mt), int(k))
    else:
        import argparse

        ap = argparse.ArgumentParser()
        ap.add_argument("run_dir")
        ap.add_argument("out_dir")
        ap.add_argument("--prompts", type=int, default=32)
        ap.add_argument("--max-tokens", type=int, default=64)
        ap.add_argument("--k", type=int, default=3)
        a = ap.parse_args()
        sys.exit(parent(Path(a.run_dir), Path(a.out_dir), a.prompts, a.max_tokens, a.k))
