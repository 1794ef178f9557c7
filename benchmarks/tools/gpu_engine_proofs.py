"""GPU proofs for the vLLM engine (issue: the vLLM engine, for real). Run on the device, on a finished run.

    python benchmarks/tools/gpu_engine_proofs.py RUN_DIR OUT_DIR [--suite single|tp] [--prompts 32] [--max-tokens 64]

RUN_DIR is a finished workbook run (its artifacts/target, artifacts/drafter, artifacts/data). Every engine runs
in a child process of its own with the patch chosen through ``EAGLE3LAB_PATCH``, so the patch reaches the
engine core and the workers only through our ``vllm.general_plugins`` entry point, as it does in production.

suite ``single`` (one GPU):
  1. greedy outputs with EAGLE-3 equal those without, eager and compiled (CUDA graphs); mean acceptance length
     at k=3 on the held-out prompts;
  2. our forward forced over vLLM 0.26's native one: aux hidden states captured inside the engine (prefill of
     each prompt) and acceptance counters, compiled with CUDA graphs;
  3. vLLM's per-position acceptance against the reference decoder (transformers, float32, same GPU, same drafter
     and prompts);
  4. the legacy simulation refused by the engine core (its own message), then served with the patch;
  5. benchmarks side by side: output tokens/s with and without EAGLE-3 at batch 1, 8, 32; patched vs native
     throughput; hidden-state extraction vs plain prefill (transformers).
suite ``tp`` (two GPUs): the legacy refusal at TP 2, the patch in both workers, outputs at TP 2 equal to TP 1.
suite ``speed``: output tokens/s with and without EAGLE-3 (and our forward forced) at batch 1, 8, 32 on the run's
  target deepened to ``--layers`` layers (``target.deepen_target``: same tokens, a forward that dominates the
  drafter's); resumable over several device calls.
suite ``ratio``: our forward forced against vLLM's native one, compiled with CUDA graphs, with every instance alive at
  once (``native,forced,native,forced`` by default) and their repetitions taken in turn, round by round
  (``benchmarks/tools/speed.py``): per-round ratios and the spread between instances of one configuration.
suite ``extract``: hidden-state extraction (transformers, our hooks, shards on disk) against a plain prefill of the
  same batches on the GPU (``ratio``), and against the same forward that extraction runs, up to the highest aux
  layer, without copies or writes (``ratio_to_aux_forward``: what the copies and writes cost).
suite ``served``: ``vllm serve`` through ``eagle3lab.engines.vllm_served.VllmServedEngine`` (baseline, then EAGLE-3 with the patch under
  the legacy simulation), and no GPU process left after the shutdown.

Writes OUT_DIR/proofs.json and one log per engine (suite ``speed`` also OUT_DIR/speed.md, its table); metric
snapshots for the tests' fixtures go to OUT_DIR/fixtures/.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

PATCH = {
    "native": {"apply": False, "force": False, "legacy_simulation": False},
    "legacy": {"apply": False, "force": False, "legacy_simulation": True},
    "legacy+patch": {"apply": True, "force": False, "legacy_simulation": True},
    "forced": {"apply": True, "force": True, "legacy_simulation": False},
}
AUX_TOL = 0.0  # our forward does what vLLM's does, op for op: anything but equality is reported as a difference


# ---------------------------------------------------------------------------------------------------------
# child: one engine configuration


def child(job: dict[str, Any]) -> dict[str, Any]:
    """Run one engine configuration: its workloads, timings and counters, as JSON."""
    from eagle3lab.engines.vllm_offline import VllmEngine, metric_dicts

    res: dict[str, Any] = {"name": job["name"]}
    opts = dict(job["options"])
    eng = VllmEngine(job["target"], **opts)
    prompts = job["prompts"]
    mt = job["max_tokens"]
    spec = None
    if job.get("drafter"):
        spec = eng.eagle3_config(job["drafter"], job["k"])
    t0 = time.perf_counter()
    llm = eng.llm(spec)
    res["engine_start_s"] = time.perf_counter() - t0
    res["workers"] = [r.__dict__ for r in eng.worker_reports()]
    if job.get("capture_aux"):
        import torch

        from eagle3lab.engines.workers import drain_aux_capture, install_aux_capture, remove_aux_capture

        llm.apply_model(install_aux_capture)
        # one prompt at a time, one token each: every forward is one prompt's prefill
        for p in prompts[: job["capture_aux"]]:
            eng._run(llm, [p], eng._sampling(1, 0.0, 1.0, 0))  # noqa: SLF001
        caps = [c for c in llm.apply_model(drain_aux_capture) if c][0]  # rank 0's
        n_aux = len(json.loads((Path(job["drafter"]) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"])
        # multi-token forwards are the prefills; [tokens, n_aux, H] as float, as compared by _aux_compare
        prefills = [c.float().unflatten(-1, (n_aux, -1)) for c in caps if c.shape[0] > 1]
        torch.save(prefills, job["aux_file"])
        res["aux_captured"] = [len(prefills)]
        # back to the class's forward: the benchmarks that follow must not pay for the copies
        llm.apply_model(remove_aux_capture)
    sp = eng._sampling(mt, 0.0, 1.0, 0, ignore_eos=True)  # noqa: SLF001
    from eagle3lab.acceptance import stats_from_vllm_metrics

    before = llm.get_metrics()
    t0 = time.perf_counter()
    outs = eng._run(llm, prompts, sp)  # noqa: SLF001
    res["generate_s"] = time.perf_counter() - t0
    after = llm.get_metrics()
    res["outputs"] = outs
    if spec is not None:
        res["stats"] = stats_from_vllm_metrics(before, after).to_dict()
        res["metrics_before"] = metric_dicts(before)
        res["metrics_after"] = metric_dicts(after)
    if job.get("bench"):
        bench = {}
        for b in job["bench"]:
            batch = (prompts * (b // len(prompts) + 1))[:b]
            for _ in range(job.get("warmup", 1)):  # warm-up at this batch size (graph capture, Triton JIT, caches)
                eng._run(llm, batch, sp)  # noqa: SLF001
            t0 = time.perf_counter()
            times: list[float] = []
            while len(times) < 3 or time.perf_counter() - t0 < job.get("min_seconds", 2.0):
                t1 = time.perf_counter()
                outs_b = eng._run(llm, batch, sp)  # noqa: SLF001
                times.append(time.perf_counter() - t1)
            # the median repetition: a stall of the host (the engine core is CPU-bound at small sizes) moves the
            # mean of a few repetitions by tens of percent, the median not
            dt = statistics.median(times)
            n_out = sum(len(o) for o in outs_b)
            bench[str(b)] = {"tokens_per_s": n_out / dt, "seconds_per_batch": dt, "reps": len(times),
                             "mean_tokens_per_s": n_out * len(times) / sum(times), "rep_seconds": times}
        res["bench"] = bench
    eng.close()
    return res


def live_child(job: dict[str, Any]) -> None:
    """One engine instance of suite ``ratio``: start it, say so, then answer the parent's requests
    (the protocol of ``benchmarks/tools/speed.py``) until it asks to close."""
    import traceback

    import speed as SPD

    from eagle3lab.acceptance import stats_from_vllm_metrics
    from eagle3lab.engines.vllm_offline import VllmEngine

    conn = SPD.live_connection()
    try:
        eng = VllmEngine(job["target"], **job["options"])
        spec = None
        if job.get("drafter"):
            spec = eng.eagle3_config(job["drafter"], job["k"])
        t0 = time.perf_counter()
        llm = eng.llm(spec)
        conn.send({"engine_start_s": time.perf_counter() - t0, "pid": os.getpid(),
                   "workers": [r.__dict__ for r in eng.worker_reports()]})
    except Exception:  # noqa: BLE001 - the parent reports it, with the traceback
        conn.send({"error": traceback.format_exc()[-3000:]})
        return
    prompts, sp = job["prompts"], eng._sampling(job["max_tokens"], 0.0, 1.0, 0, ignore_eos=True)  # noqa: SLF001
    warmed: set[int] = set()
    while True:
        msg = conn.recv()
        try:
            if msg["op"] == "counters":
                before = llm.get_metrics()
                t0 = time.perf_counter()
                outs = eng._run(llm, prompts, sp)  # noqa: SLF001
                ans: dict[str, Any] = {"outputs": outs, "generate_s": time.perf_counter() - t0}
                if spec is not None:
                    ans["stats"] = stats_from_vllm_metrics(before, llm.get_metrics()).to_dict()
            elif msg["op"] == "bench":
                b = int(msg["batch"])
                batch = (prompts * (b // len(prompts) + 1))[:b]
                if b not in warmed:  # graph capture, Triton JIT, caches: untimed
                    for _ in range(job.get("warmup", 2)):
                        eng._run(llm, batch, sp)  # noqa: SLF001
                    warmed.add(b)
                # One repetition is as many passes as fill rep_min_seconds: on 2026-12-03 single passes of
                # 0.15-0.6 s varied by up to 2.3x within one engine (the host's pace, not the GPU's).
                steal0 = SPD.cpu_steal_seconds()
                t0, calls, tokens = time.perf_counter(), 0, 0
                while calls == 0 or time.perf_counter() - t0 < job.get("rep_min_seconds", 0.0):
                    outs = eng._run(llm, batch, sp)  # noqa: SLF001
                    calls, tokens = calls + 1, tokens + sum(len(o) for o in outs)
                ans = {"seconds": time.perf_counter() - t0, "tokens": tokens, "calls": calls,
                       "sm_clock_mhz": SPD.gpu_sm_clock_mhz()}
                steal1 = SPD.cpu_steal_seconds()
                if steal0 is not None and steal1 is not None:
                    ans["steal_s"] = steal1 - steal0  # the whole machine's, during this repetition
            elif msg["op"] == "close":
                eng.close()
                conn.send({"closed": True})
                return
            else:
                ans = {"error": f"unknown op {msg['op']!r}"}
        except Exception:  # noqa: BLE001
            ans = {"error": traceback.format_exc()[-3000:]}
        conn.send(ans)


def engine_env(patch: dict[str, bool] | None) -> dict[str, str]:
    """This process's environment for an engine child: no inherited patch choice, then ``patch`` (a row of
    PATCH) through our plugin's variables; None for vLLM untouched."""
    from eagle3lab.plugin import plugin_env

    env = {k: v for k, v in os.environ.items() if k != "EAGLE3LAB_PATCH"}
    if patch is not None:
        env.update(plugin_env(**patch))
    return env


def deep_target_dir(layers: int) -> Path:
    """Where the run's target deepened to ``layers`` layers is kept (shared by the suites: made once)."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"eagle3lab-deep-{layers}"


def run_child(job: dict[str, Any], out_dir: Path, patch: dict[str, bool] | None, timeout: float = 500) -> dict:
    from eagle3lab.engines.processes import run_in_group

    env = engine_env(patch)
    name = job["name"]
    js, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    job = {**job, "out": str(js)}
    t0 = time.perf_counter()
    # The engine child and its engine core die with this call, however it ends: on 2026-12-02 a child started
    # with start_new_session outlived this script's time limit and broke the next call's engine start.
    rc = run_in_group([sys.executable, __file__, "--child", json.dumps(job)], log, timeout_s=timeout, env=env)
    r = result_from_files(out_dir, name, rc)
    r["wall_s"] = time.perf_counter() - t0
    if rc != 0:
        r["log_tail"] = log.read_text(errors="replace")[-3000:]
    print(f"{name}: exit {rc} in {r['wall_s']:.0f} s", flush=True)
    return r


# ---------------------------------------------------------------------------------------------------------
# parent


def _prompts(run_dir: Path, n: int) -> list[list[int]]:
    rows = [json.loads(x) for x in (run_dir / "artifacts/data/heldout_prompts.jsonl").read_text().splitlines() if x]
    return [r["prompt_ids"] for r in rows][:n]


def _reference(run_dir: Path, prompts: list[list[int]], k: int, max_tokens: int) -> dict[str, Any]:
    """The reference decoder (transformers, float32) on the same GPU, drafter and prompts."""
    import torch

    from eagle3lab.engines.reference import ReferenceEngine

    eng = ReferenceEngine(run_dir / "artifacts/target", device="cuda", dtype="float32")
    eng.eos_token_id = None  # the vLLM runs ignore EOS: compare like with like
    t0 = time.perf_counter()
    res = eng.speculative_generate(prompts, run_dir / "artifacts/drafter", k, max_tokens)
    out = {"seconds": time.perf_counter() - t0, "stats": res.stats.to_dict(), "outputs": res.outputs}
    del eng
    torch.cuda.empty_cache()
    return out


def profile_target(params_file: Path, run_dir: Path, dst: Path) -> tuple[Path, list[int]]:
    """A target of a profile's embedded shapes with fresh (untrained) weights and the run's tokenizer, saved in
    bf16 to ``dst``, and the profile's aux layer ids: extraction and prefill throughput depend on the shapes, not
    on the weights, so a run made on a CPU can measure them at the GPU profile's size."""
    import torch
    from transformers import AutoTokenizer

    from eagle3lab import params as P
    from eagle3lab import target as T

    prm = P.load(params_file)
    tok = AutoTokenizer.from_pretrained(run_dir / "artifacts/target")
    model = T.build_model(T.make_config(prm.target.embedded, tok), seed=0).to(torch.bfloat16)
    T.save_target(model, tok, dst)
    return dst, list(prm.drafter.aux_layer_ids)


def _extraction_bench(run_dir: Path, aux_ids: list[int], n_samples: int = 256, device: str = "cuda",
                      target: Path | None = None) -> dict[str, Any]:
    """Hidden-state extraction (our hooks + shards on disk) vs a plain prefill of the same batches (the run's
    samples, on the run's target or on ``target``)."""
    import tempfile

    import torch

    from eagle3lab.aux_states.shards import extract_hidden_states
    from eagle3lab.engines.reference import ReferenceEngine
    from eagle3lab.synthetic import read_samples, write_jsonl_atomic

    eng = ReferenceEngine(target or run_dir / "artifacts/target", device=device, dtype="bfloat16")
    have = read_samples(run_dir / "artifacts/data/samples.jsonl")
    # More samples than the run has: the run's samples again, under new ids (throughput, not content, is measured;
    # a few hundred samples take a fraction of a second on a GPU, where fixed costs would dominate).
    samples = [{**have[i % len(have)], "id": i} for i in range(n_samples)]
    bs = 32
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)  # CPU: a smoke run
    with tempfile.TemporaryDirectory() as tmp:
        sp = write_jsonl_atomic(Path(tmp) / "samples.jsonl", samples)
        extract_hidden_states(eng.model, sp, aux_ids, Path(tmp) / "warm", shard_sequences=64, dtype="bfloat16",
                              batch_size=bs, progress=False, max_shards=1)
        sync()
        t0 = time.perf_counter()
        st = extract_hidden_states(eng.model, sp, aux_ids, Path(tmp) / "h", shard_sequences=64, dtype="bfloat16",
                                   batch_size=bs, progress=False)
        sync()
        ext_s = time.perf_counter() - t0
    seqs = [s["prompt_ids"] + s["output_ids"] for s in samples]
    sync()
    t0 = time.perf_counter()
    n_tok = 0
    with torch.no_grad():
        for i in range(0, len(seqs), bs):
            chunk = seqs[i:i + bs]
            width = max(map(len, chunk))
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, s in enumerate(chunk):
                ids[j, :len(s)] = torch.tensor(s)
                mask[j, :len(s)] = 1
            eng.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            n_tok += int(mask.sum())
    sync()
    pre_s = time.perf_counter() - t0
    # The same forward extraction runs (stopped at the highest aux layer, no LM head), with no copy to the host
    # and no shard written: what extraction costs beyond the states' own compute.
    from eagle3lab.aux_states.shards import ModelAuxSource

    src = ModelAuxSource(eng.model)
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(seqs), bs):
        src.aux_batch(seqs[i:i + bs], aux_ids)
    sync()
    fwd_s = time.perf_counter() - t0
    ext, pre, fwd = st.tokens / ext_s, n_tok / pre_s, n_tok / fwd_s
    return {"tokens": st.tokens, "extraction_tokens_per_s": ext, "prefill_tokens_per_s": pre,
            "ratio": ext / pre, "aux_forward_tokens_per_s": fwd, "ratio_to_aux_forward": ext / fwd,
            "batch_size": bs, "samples": len(samples)}


def _aux_compare(a_file: Path, b_file: Path) -> dict[str, Any]:
    import torch

    a, b = torch.load(a_file), torch.load(b_file)
    if len(a) != len(b) or not a:
        return {"prefills": [len(a), len(b)], "equal": False, "max_abs_diff": None}
    diffs = [float((x - y).abs().max()) if x.shape == y.shape else float("inf") for x, y in zip(a, b, strict=True)]
    scale = max(float(x.abs().max()) for x in a)
    return {"prefills": len(a), "tokens": sum(x.shape[0] for x in a), "shape": list(a[0].shape[1:]),
            "max_abs_diff": max(diffs), "max_abs_value": scale, "equal": max(diffs) <= AUX_TOL}


def suite_single(run_dir: Path, out: Path, n: int, mt: int, k: int) -> dict[str, Any]:
    prompts = _prompts(run_dir, n)
    tgt, dr = str(run_dir / "artifacts/target"), str(run_dir / "artifacts/drafter")
    aux_ids = json.loads((run_dir / "artifacts/drafter/config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    base = {"target": tgt, "prompts": prompts, "max_tokens": mt, "k": k}
    o_eager = {"dtype": "bfloat16", "enforce_eager": True, "gpu_memory_utilization": 0.4, "max_model_len": 1024}
    o_comp = {**o_eager, "enforce_eager": False}
    R: dict[str, dict] = {}
    R["legacy"] = run_child({**base, "name": "legacy", "options": o_eager, "drafter": dr}, out, PATCH["legacy"])
    R["baseline-eager"] = run_child({**base, "name": "baseline-eager", "options": o_eager}, out, None)
    R["patched-eager"] = run_child({**base, "name": "patched-eager", "options": o_eager, "drafter": dr}, out,
                                   PATCH["legacy+patch"])
    bench = [1, 8, 32]
    R["baseline-compiled"] = run_child({**base, "name": "baseline-compiled", "options": o_comp, "bench": bench},
                                       out, None)
    R["native-compiled"] = run_child({**base, "name": "native-compiled", "options": o_comp, "drafter": dr,
                                      "bench": bench, "capture_aux": 8, "aux_file": str(out / "aux-native.pt")},
                                     out, PATCH["native"])
    R["forced-compiled"] = run_child({**base, "name": "forced-compiled", "options": o_comp, "drafter": dr,
                                      "bench": bench, "capture_aux": 8, "aux_file": str(out / "aux-forced.pt")},
                                     out, PATCH["forced"])
    R["reference"] = _reference(run_dir, prompts, k, mt)
    R["extraction"] = _extraction_bench(run_dir, aux_ids)

    def eq(a: str, b: str) -> bool | None:
        oa, ob = R[a].get("outputs"), R[b].get("outputs")
        return None if oa is None or ob is None else oa == ob

    def mismatches(a: str, b: str) -> int | None:
        from speed import mismatches as count

        return count(R[a], R[b])

    st = {m: R[m].get("stats") for m in ("patched-eager", "native-compiled", "forced-compiled")}
    ref = R["reference"]["stats"]
    tau = {m: (1 + s["num_accepted_tokens"] / s["num_drafts"]) if s and s["num_drafts"] else None for m, s in st.items()}
    rates = {m: [x / s["num_drafts"] for x in s["accepted_per_pos"]] if s and s["num_drafts"] else None
             for m, s in st.items()}
    ref_rates = [x / ref["num_drafts"] for x in ref["accepted_per_pos"]]
    b0, bn, bf = (R[m].get("bench", {}) for m in ("baseline-compiled", "native-compiled", "forced-compiled"))
    speedup = {b: bn[b]["tokens_per_s"] / b0[b]["tokens_per_s"] for b in b0 if b in bn}
    forced_vs_native = {b: bf[b]["tokens_per_s"] / bn[b]["tokens_per_s"] for b in bn if b in bf}
    # drafter/target step-cost ratio from the measured batch-1 throughputs: a round costs one target step
    # (verifying k+1 tokens at batch 1 costs about one decode step) plus k drafter steps and yields tau tokens.
    c_ratio = None
    if "1" in b0 and "1" in bn and tau["native-compiled"]:
        t_t = 1 / b0["1"]["tokens_per_s"]
        t_round = tau["native-compiled"] / bn["1"]["tokens_per_s"]
        c_ratio = max(0.0, (t_round - t_t) / k) / t_t
    summary = {
        "proof1_greedy_equal": {"eager": eq("baseline-eager", "patched-eager"),
                                "compiled_native": eq("baseline-compiled", "native-compiled"),
                                "compiled_forced": eq("baseline-compiled", "forced-compiled"),
                                "eager_vs_compiled_baseline": eq("baseline-eager", "baseline-compiled"),
                                "mismatching_prompts_compiled": mismatches("baseline-compiled", "native-compiled")},
        "tau_k3": tau,
        "per_position_rate": rates,
        "proof2_forced_vs_native": {"aux": _aux_compare(out / "aux-native.pt", out / "aux-forced.pt")
                                    if (out / "aux-native.pt").is_file() and (out / "aux-forced.pt").is_file()
                                    else None,
                                    "counters_equal": st["native-compiled"] == st["forced-compiled"],
                                    "native": st["native-compiled"], "forced": st["forced-compiled"]},
        "proof3_reference": {"reference_rates": ref_rates, "vllm_rates": rates["native-compiled"],
                             "max_abs_rate_gap": max(abs(a - b) for a, b in zip(ref_rates, rates["native-compiled"]
                                                                                  or ref_rates, strict=False)),
                             "reference_tau": 1 + ref["num_accepted_tokens"] / ref["num_drafts"],
                             "reference_outputs_equal_vllm_baseline": R["reference"]["outputs"]
                             == R["baseline-compiled"].get("outputs"),
                             "reference_mismatching_prompts": sum(
                                 a != b for a, b in zip(R["reference"]["outputs"],
                                                        R["baseline-compiled"].get("outputs") or [], strict=False))},
        "proof4_legacy": {"refused": R["legacy"]["refusal"] is not None and R["legacy"]["exit_code"] != 0,
                          "message": R["legacy"]["refusal"],
                          "patched_served": R["patched-eager"]["exit_code"] == 0,
                          "patched_workers": R["patched-eager"].get("workers")},
        "proof5_bench": {"baseline_tokens_per_s": {b: v["tokens_per_s"] for b, v in b0.items()},
                         "eagle3_tokens_per_s": {b: v["tokens_per_s"] for b, v in bn.items()},
                         "speedup": speedup, "forced_vs_native_throughput": forced_vs_native,
                         "drafter_to_target_step_cost": c_ratio, "extraction_vs_prefill": R["extraction"]},
        "engine_start_s": {m: R[m].get("engine_start_s") for m in R if isinstance(R[m], dict) and "engine_start_s" in R[m]},
        "exit_codes": {m: R[m].get("exit_code") for m in R if isinstance(R[m], dict) and "exit_code" in R[m]},
    }
    fx = out / "fixtures"
    fx.mkdir(exist_ok=True)
    for m in ("native-compiled", "patched-eager"):
        if "metrics_after" in R[m]:
            (fx / f"vllm_metrics_{m}.json").write_text(json.dumps(
                {"vllm": "0.26.0", "k": k, "prompts": len(prompts), "max_tokens": mt, "stats": R[m]["stats"],
                 "before": R[m]["metrics_before"], "after": R[m]["metrics_after"]}, indent=1))
    (out / "raw.json").write_text(json.dumps({m: {kk: vv for kk, vv in r.items() if kk not in ("outputs",)}
                                              for m, r in R.items()}, indent=1, default=str))
    return summary


def suite_tp(run_dir: Path, out: Path, n: int, mt: int, k: int, tp: int) -> dict[str, Any]:
    prompts = _prompts(run_dir, n)
    tgt, dr = str(run_dir / "artifacts/target"), str(run_dir / "artifacts/drafter")
    base = {"target": tgt, "prompts": prompts, "max_tokens": mt, "k": k}
    o1 = {"dtype": "bfloat16", "enforce_eager": True, "gpu_memory_utilization": 0.4, "max_model_len": 1024}
    on = {**o1, "tensor_parallel_size": tp}
    R = {
        f"legacy-tp{tp}": run_child({**base, "name": f"legacy-tp{tp}", "options": on, "drafter": dr}, out,
                                    PATCH["legacy"]),
        "baseline-tp1": run_child({**base, "name": "baseline-tp1", "options": o1}, out, None),
        "patched-tp1": run_child({**base, "name": "patched-tp1", "options": o1, "drafter": dr}, out,
                                 PATCH["legacy+patch"]),
        f"baseline-tp{tp}": run_child({**base, "name": f"baseline-tp{tp}", "options": on}, out, None),
        f"patched-tp{tp}": run_child({**base, "name": f"patched-tp{tp}", "options": on, "drafter": dr}, out,
                                     PATCH["legacy+patch"]),
    }
    return tp_summary(R, out, tp)


def result_from_files(out: Path, name: str, exit_code: int) -> dict[str, Any]:
    """One child's result as ``run_child`` returns it, rebuilt from its files in OUT (its JSON when it
    finished, its log) and the exit code it printed: for a suite whose children ran over several device calls."""
    from eagle3lab.engines.launch_probe import refusal_in_log

    js, log = out / f"{name}.json", out / f"{name}.log"
    r = json.loads(js.read_text()) if exit_code == 0 and js.is_file() else {"name": name}
    r["exit_code"] = exit_code
    r["refusal"] = refusal_in_log(log.read_text(errors="replace")) if log.is_file() else None
    return r


def tp_summary(R: dict[str, dict], out: Path, tp: int) -> dict[str, Any]:
    """The tensor-parallel proof from its five engines: refusal per worker, patch in every worker, outputs."""
    leg = R[f"legacy-tp{tp}"]
    log = (out / f"legacy-tp{tp}.log").read_text(errors="replace")
    refusing_workers = sorted({ln.split("(")[1].split(")")[0] for ln in log.splitlines()
                               if "does not support EAGLE3 interface" in ln and "(" in ln and "pid=" in ln})

    def same(a: str, b: str) -> int | None:
        from speed import mismatches as count

        return count(R[a], R[b])

    s1, sn = R["patched-tp1"].get("stats"), R[f"patched-tp{tp}"].get("stats")
    return {
        "tp": tp,
        "legacy_refused": leg["refusal"] is not None and leg["exit_code"] != 0,
        "legacy_message": leg["refusal"],
        "refusal_sources": refusing_workers,
        "patched_workers": R[f"patched-tp{tp}"].get("workers"),
        "baseline_mismatching_prompts_tp1_vs_tpn": same("baseline-tp1", f"baseline-tp{tp}"),
        "eagle3_mismatching_prompts_tp1_vs_tpn": same("patched-tp1", f"patched-tp{tp}"),
        "eagle3_vs_baseline_mismatching_prompts_tpn": same(f"baseline-tp{tp}", f"patched-tp{tp}"),
        "stats_tp1": s1, "stats_tpn": sn,
        "per_position_rate_tp1": [x / s1["num_drafts"] for x in s1["accepted_per_pos"]] if s1 else None,
        "per_position_rate_tpn": [x / sn["num_drafts"] for x in sn["accepted_per_pos"]] if sn else None,
        "exit_codes": {m: r.get("exit_code") for m, r in R.items()},
        "engine_start_s": {m: r.get("engine_start_s") for m, r in R.items()},
    }


def suite_speed(run_dir: Path, out: Path, n: int, mt: int, k: int, layers: int, run: bool = True,
                engines: tuple[str, ...] = ("baseline", "native", "forced")) -> dict[str, Any]:
    """Speedup where the target's forward dominates: the run's target deepened to ``layers`` layers.

    ``target.deepen_target`` appends layers with zero output projections: the same tokens and aux states as
    the trained target (so its trained drafter is accepted as before), at the compute of a deeper model.
    Each engine's result is kept in OUT (``<name>.result.json``) and not run again, so the suite can be
    spread over several device calls; with ``run`` False nothing runs, and the figures are rebuilt from the
    kept results. ``engines`` says which engines run, in order; a configuration named twice runs twice
    (``native,forced,native,forced``: engine instances differ, see ``speed`` (benchmarks/tools/speed.py)).
    """

    import speed as SPD

    from eagle3lab.target import deepen_target

    deep = deep_target_dir(layers)
    deepen_s = None
    prompts = _prompts(run_dir, n)
    dr = str(run_dir / "artifacts/drafter")
    base = {"target": str(deep), "prompts": prompts, "max_tokens": mt, "k": k, "bench": [1, 8, 32], "warmup": 3,
            "min_seconds": 4.0}
    # max_num_seqs 32, the largest batch measured, for every engine alike: vLLM sizes its CUDA graphs from it,
    # and capturing graphs up to batch 512 for 96 layers took about 60 s of each engine's start on 2026-12-01.
    opts = {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.4, "max_model_len": 1024,
            "extra": {"max_num_seqs": 32}}
    planned = SPD.instances(engines)
    kept = sorted(f.name.removesuffix(".result.json") for f in out.glob("speed-*.result.json"))
    to_run = [nm for _, nm in planned]
    R: dict[str, dict] = {}
    for name in dict.fromkeys(to_run + kept):
        keep = out / f"{name}.result.json"
        if keep.is_file() and json.loads(keep.read_text()).get("exit_code") == 0:
            R[name] = json.loads(keep.read_text())
            continue
        if not run or name not in to_run:
            R[name] = {"name": name, "exit_code": None, "not_run": True}
            continue
        if not (deep / "config.json").is_file():
            t0 = time.perf_counter()
            deepen_target(run_dir / "artifacts/target", deep, layers)
            deepen_s = time.perf_counter() - t0
        kind = SPD.kind_of(name)
        R[name] = run_child({**base, "name": name, "options": opts, "drafter": None if kind == "baseline" else dr}, out,
                            None if kind == "baseline" else PATCH[kind], timeout=540)
        keep.write_text(json.dumps(R[name], default=str))
    res = SPD.figures(R, k)
    return {
        "layers": layers, "deepen_seconds": deepen_s, "engine_options": opts,
        "not_run": [m for m, r in R.items() if r.get("not_run")],
        "source_layers": json.loads((run_dir / "artifacts/target/config.json").read_text())["num_hidden_layers"],
        **res,
        "divergence_baseline_native": divergence_summary(run_dir, prompts, R.get("speed-baseline", {}).get("outputs"),
                                                         R.get("speed-native", {}).get("outputs")),
        "exit_codes": {m: r.get("exit_code") for m, r in R.items()},
        "engine_start_s": {m: r.get("engine_start_s") for m, r in R.items()},
    }


def suite_ratio(run_dir: Path, out: Path, n: int, mt: int, k: int, layers: int | None,
                engines: tuple[str, ...] = ("native", "forced", "native", "forced"), rounds: int = 10,
                batches: tuple[int, ...] = (1, 8, 32), rep_min_seconds: float = 1.0,
                run: bool = True, options: dict[str, Any] | None = None,
                rounds_seconds: float | None = None, rounds_until: float | None = None) -> dict[str, Any]:
    """Our forward forced against vLLM's native one, every instance alive at once (``benchmarks/tools/speed.py``).

    The instances start one after another; then each round times one repetition of every instance at every
    batch size, in an order rotated each round. Throughput per instance is the median of its repetitions;
    the forced/native ratio is also taken within each round, which cancels drift of the machine over the
    suite's minutes. The repetitions go to OUT/ratio-reps.jsonl as they come; with ``run`` False nothing runs
    and the figures are rebuilt from that file (a suite cut by its call's limit after its rounds).
    """

    import speed as SPD

    from eagle3lab.target import deepen_target

    src_layers = json.loads((run_dir / "artifacts/target/config.json").read_text())["num_hidden_layers"]
    target = run_dir / "artifacts/target"
    if layers and layers != src_layers:
        target = deep_target_dir(layers)
        if not (target / "config.json").is_file():
            deepen_target(run_dir / "artifacts/target", target, layers)
    prompts = _prompts(run_dir, n)
    dr = str(run_dir / "artifacts/drafter")
    per = max(0.1, round(0.8 / len(engines), 2))  # every instance at once on one GPU
    opts = {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": per, "max_model_len": 1024,
            "extra": {"max_num_seqs": max(batches)}, **(options or {})}
    reps_file = out / "ratio-reps.jsonl"
    if not run:
        reps = SPD.timed_reps([json.loads(x) for x in reps_file.read_text().splitlines() if x])
        res = {"layers": layers or src_layers, "source_layers": src_layers, "rebuilt_from": reps_file.name, "k": k,
               "rounds": 1 + max(r["round"] for r in reps), "batches": sorted({r["batch"] for r in reps}),
               "engines": list(dict.fromkeys(r["name"] for r in reps)),
               "note": "counters and outputs were not kept (they lived in the cut suite's memory)"}
        return _ratio_figures(res, reps, {}, k)
    reps_file.write_text("")
    started: list[SPD.Instance] = []
    counters: dict[str, dict[str, Any]] = {}
    res: dict[str, Any] = {"layers": layers or src_layers, "source_layers": src_layers, "engine_options": opts,
                           "rounds": rounds, "rounds_seconds_budget": rounds_seconds, "k": k, "batches": list(batches), "engines": list(engines)}
    reps: list[dict[str, Any]] = []
    failure = None
    try:
        for kind, name in SPD.instances(engines):
            env = engine_env(None if kind == "baseline" else PATCH[kind])
            job = {"name": name, "target": str(target), "options": opts, "prompts": prompts, "max_tokens": mt,
                   "k": k, "drafter": None if kind == "baseline" else dr, "warmup": 2,
                   "rep_min_seconds": rep_min_seconds}
            t0 = time.perf_counter()
            inst = SPD.start_instance(name, [sys.executable, __file__, "--live-child", json.dumps(job)], env,
                                      out / f"{name}.log", start_timeout_s=420)
            started.append(inst)
            print(f"{name}: up in {time.perf_counter() - t0:.0f} s (engine {inst.ready['engine_start_s']:.0f} s)",
                  flush=True)
            counters[name] = {"name": name, "exit_code": 0, "engine_start_s": inst.ready["engine_start_s"],
                              "workers": inst.ready["workers"], **inst.ask({"op": "counters"}, 300)}

        def keep(rep: dict[str, Any]) -> None:
            with reps_file.open("a") as f:
                f.write(json.dumps(rep) + "\n")

        t0 = time.perf_counter()
        budget = rounds_seconds
        if rounds_until is not None:  # a wall-clock deadline (a device session's end), whenever the engines came up
            budget = min(budget if budget is not None else math.inf, rounds_until - time.time())
        res["rounds_seconds_budget"] = budget
        reps = SPD.run_interleaved(started, batches, rounds, on_rep=keep, budget_s=budget)
        res["rounds_seconds"] = time.perf_counter() - t0
        res["rounds_timed"] = len({r["round"] for r in reps})
    except SPD.LiveError as e:  # what ran stays: the kept repetitions are still figures
        failure = str(e)
        print("FAILED:", failure, flush=True)
    finally:
        res["closed"] = SPD.close_all(started)
    res["failure"] = failure
    res["rep_min_seconds"] = rep_min_seconds
    res["engine_start_s"] = {m: c.get("engine_start_s") for m, c in counters.items()}
    res["workers"] = {m: c.get("workers") for m, c in counters.items()}
    res["gpu_processes_left_after_close"] = _gpu_pids()
    # where native and forced outputs part (2026-12-03: 4 of 32 prompts did), the float32 target's margin there
    res["divergence_native_forced"] = divergence_summary(
        run_dir, prompts, counters.get("speed-native", {}).get("outputs"), counters.get("speed-forced", {}).get("outputs"))
    return _ratio_figures(res, reps, counters, k)


def _ratio_figures(res: dict[str, Any], reps: list[dict[str, Any]], counters: dict[str, dict[str, Any]],
                   k: int) -> dict[str, Any]:
    import speed as SPD

    res.update(SPD.figures(SPD.interleaved_results(reps, counters), k))
    res["paired_ratio"] = SPD.paired_ratios(reps)
    res["verdict"] = SPD.ratio_verdict(res["paired_ratio"])
    res["verdict_every_round"] = SPD.ratio_verdict(res["paired_ratio"], rule="every_round")
    res["repetition_spread"] = SPD.repetition_spread(reps)
    res["rep_diagnostics"] = SPD.rep_diagnostics(reps)
    return res


def divergence_summary(run_dir: Path, prompts: list[list[int]], a: list[list[int]] | None,
                       b: list[list[int]] | None) -> dict[str, Any] | None:
    """Where two engines' outputs part, the float32 target's margin between the two tokens (the run's own
    target: a deepened one computes the same logits). None when either did not run or nothing differs."""
    if a is None or b is None or a == b:
        return None
    import torch

    from eagle3lab import divergence as DV
    from eagle3lab.target_loading import load_target

    model, _ = load_target(run_dir / "artifacts/target", "cuda" if torch.cuda.is_available() else "cpu", "float32")
    out = DV.summarise(DV.divergence_margins(model, prompts, a, b), compared=len(prompts))
    del model
    torch.cuda.empty_cache()
    return out


def suite_served(run_dir: Path, out: Path, n: int, mt: int, k: int) -> dict[str, Any]:
    """``vllm serve`` on the GPU through VllmServedEngine: baseline, then EAGLE-3 under the legacy simulation
    with the patch (through the plugin), then a clean shutdown with no process of the server left."""
    from eagle3lab.engines.vllm_served import VllmServedEngine
    from eagle3lab.plugin import plugin_env

    prompts = _prompts(run_dir, n)
    pids_before = _gpu_pids()
    t0 = time.perf_counter()
    eng = VllmServedEngine(run_dir / "artifacts/target", log_dir=out / "served", enforce_eager=True,
                           gpu_memory_utilization=0.4, max_model_len=1024, dtype="bfloat16",
                           env=plugin_env(**PATCH["legacy+patch"]))
    with eng:
        base = eng.generate(prompts, mt)
        spec = eng.speculative_generate(prompts, run_dir / "artifacts/drafter", k, mt)
        launches = list(eng.launches)
    time.sleep(2)
    left = sorted(set(_gpu_pids()) - set(pids_before))
    s = spec.stats
    return {"seconds": time.perf_counter() - t0, "launches": launches, "prompts": len(prompts),
            "outputs_equal_baseline": spec.outputs == base,
            "mismatching_prompts": sum(a != b for a, b in zip(base, spec.outputs, strict=True)),
            "divergence": divergence_summary(run_dir, prompts, base, spec.outputs),
            "stats": s.to_dict(), "tau": s.mean_acceptance_length,
            "gpu_processes_left_after_close": left}


def _gpu_pids() -> list[int]:
    try:
        txt = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(x) for x in txt.split() if x.strip().isdigit()]


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--suite", choices=["single", "tp", "speed", "ratio", "extract", "served"], default="single")
    ap.add_argument("--layers", type=int, default=None,
                    help="suite speed: layers of the deepened target (default 96); suite ratio: the same (default: as it is)")
    ap.add_argument("--rounds", type=int, default=10, help="suite ratio: rounds of interleaved repetitions (at most)")
    ap.add_argument("--rounds-seconds", type=float, default=None,
                    help="suite ratio: start no timed round after this many seconds of rounds")
    ap.add_argument("--rounds-until", type=float, default=None,
                    help="suite ratio: start no timed round after this time (seconds since the epoch)")
    ap.add_argument("--engine-options", help="suite ratio: JSON merged into the engines' options (a CPU smoke run: "
                    '\'{"dtype": "float32", "enforce_eager": true, "attention_backend": "CPU_MLA"}\')')
    ap.add_argument("--batches", default="1,8,32", help="suite ratio: the batch sizes timed in each round")
    ap.add_argument("--rep-min-seconds", type=float, default=1.0,
                    help="suite ratio: a repetition repeats its batch until it has lasted this long")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="suite extract: where the target runs (cpu for a smoke run)")
    ap.add_argument("--extract-samples", type=int, default=256, help="suite extract: sequences per measurement")
    ap.add_argument("--target-params", help="suite extract: measure on a fresh target of this profile's shapes")
    ap.add_argument("--engines", default=None,
                    help="suite speed: the engines to run (default baseline,native,forced); suite ratio: the "
                         "instances alive at once (default native,forced,native,forced)")
    ap.add_argument("--no-run", action="store_true", help="suites speed, ratio: rebuild the figures from kept results only")
    a = ap.parse_args()
    run_dir, out = Path(a.run_dir), Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    head = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "run_dir": str(run_dir), "suite": a.suite, "prompts": a.prompts,
            "max_tokens": a.max_tokens, "k": a.k}
    try:
        import vllm

        head["vllm"] = vllm.__version__
    except ImportError:
        pass
    if a.no_run:  # the engines ran elsewhere (the kept results say what ran); this machine only did the sums
        head = {"rebuilt_from_kept_results": {k: head.pop(k) for k in ("date", "host", "gpus", "torch", "vllm")
                                              if k in head}, **head}
    if a.suite == "single":
        res = suite_single(run_dir, out, a.prompts, a.max_tokens, a.k)
    elif a.suite == "tp":
        res = suite_tp(run_dir, out, a.prompts, a.max_tokens, a.k, a.tp)
    elif a.suite == "speed":
        res = suite_speed(run_dir, out, a.prompts, a.max_tokens, a.k, a.layers or 96, run=not a.no_run,
                          engines=tuple((a.engines or "baseline,native,forced").split(",")))
        from speed import table as speed_table

        (out / "speed.md").write_text(speed_table(res))
    elif a.suite == "ratio":
        res = suite_ratio(run_dir, out, a.prompts, a.max_tokens, a.k, a.layers, rounds=a.rounds,
                          engines=tuple((a.engines or "native,forced,native,forced").split(",")),
                          batches=tuple(int(b) for b in a.batches.split(",")),
                          rep_min_seconds=a.rep_min_seconds, run=not a.no_run,
                          options=json.loads(a.engine_options) if a.engine_options else None,
                          rounds_seconds=a.rounds_seconds, rounds_until=a.rounds_until)
        from speed import ratio_table

        (out / "ratio.md").write_text(ratio_table(res))
    elif a.suite == "extract":
        res = {}
        if a.target_params:
            tgt, aux_ids = profile_target(Path(a.target_params), run_dir, out / "profile-target")
            res["target"] = {"params": a.target_params, "weights": "fresh (untrained): throughput only",
                             "config": json.loads((tgt / "config.json").read_text())}
        else:
            tgt = None
            aux_ids = json.loads((run_dir / "artifacts/drafter/config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
        res["aux_layer_ids"] = aux_ids
        res["extraction_vs_prefill"] = _extraction_bench(run_dir, aux_ids, n_samples=a.extract_samples,
                                                         device=a.device, target=tgt)
        if tgt is not None:
            import shutil

            shutil.rmtree(tgt)  # weights never travel back
    else:
        res = suite_served(run_dir, out, a.prompts, a.max_tokens, a.k)
    doc = {**head, **res}
    (out / "proofs.json").write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps(doc, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--live-child":
        live_child(json.loads(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--child":
        job = json.loads(sys.argv[2])
        Path(job["out"]).write_text(json.dumps(child(job), default=str))
    else:
        sys.exit(main())
