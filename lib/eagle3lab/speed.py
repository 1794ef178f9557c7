"""Figures of the speed benchmark (``scripts/gpu_engine_proofs.py --suite speed``) from its engines' results.

Each engine configuration (``baseline``: no speculation; ``native``: EAGLE-3 with vLLM's forward; ``forced``:
EAGLE-3 with our patched forward forced over it) runs in a child process of its own and leaves one result:
output tokens/s per batch size (``bench``), its outputs, and for the EAGLE-3 engines vLLM's acceptance counters.

Engine instances differ from each other: on 2026-12-02 the same native engine, started on two machines, ran at
0.76-1.10 of itself, far more than the 2% a forced/native comparison has to resolve. So a configuration may run
several times, alternating (``native,forced,native,forced``): its throughput is then the median over its
instances, and the spread between instances of one configuration is reported beside the ratios, so that a reader
sees whether a ratio stands out from the noise.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

KINDS = ("baseline", "native", "forced")


def instances(engines: Sequence[str]) -> list[tuple[str, str]]:
    """(configuration, result name) in run order: the first ``native`` is ``speed-native``, the second
    ``speed-native-2`` (so a suite run before repeats existed resumes from its kept results)."""
    unknown = sorted(set(engines) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown engines {unknown}: expected some of {list(KINDS)}")
    seen: Counter[str] = Counter()
    out = []
    for e in engines:
        seen[e] += 1
        out.append((e, f"speed-{e}" + (f"-{seen[e]}" if seen[e] > 1 else "")))
    return out


def kind_of(name: str) -> str:
    """The configuration of a result name (``speed-forced-2`` -> ``forced``)."""
    return name.removeprefix("speed-").split("-")[0]


def _per_batch(results: Mapping[str, Mapping[str, Any]], kind: str) -> dict[str, list[float]]:
    """Tokens/s of every instance of one configuration, per batch size it measured."""
    per_batch: dict[str, list[float]] = {}
    for name, r in results.items():
        if kind_of(name) == kind:
            for b, v in (r.get("bench") or {}).items():
                per_batch.setdefault(b, []).append(v["tokens_per_s"])
    return per_batch


def pooled(results: Mapping[str, Mapping[str, Any]], kind: str) -> dict[str, float]:
    """Tokens/s per batch size of one configuration: the median over its instances that measured that size."""
    return {b: statistics.median(v) for b, v in _per_batch(results, kind).items()}


def spread(results: Mapping[str, Mapping[str, Any]], kind: str) -> dict[str, float]:
    """Per batch size, the fastest instance of a configuration over its slowest (only with two or more)."""
    return {b: max(v) / min(v) for b, v in _per_batch(results, kind).items() if len(v) > 1}


def mismatches(a: Mapping[str, Any], b: Mapping[str, Any]) -> int | None:
    """Prompts whose outputs differ between two engines' results (None when either did not run)."""
    oa, ob = a.get("outputs"), b.get("outputs")
    return None if oa is None or ob is None else sum(x != y for x, y in zip(oa, ob, strict=True))


def figures(results: Mapping[str, Mapping[str, Any]], k: int) -> dict[str, Any]:
    """Speedup, forced/native ratio, acceptance and per-step costs from the engines' results (any that ran)."""
    b0, bn, bf = (pooled(results, kind) for kind in KINDS)
    native = results.get("speed-native", {})
    forced = results.get("speed-forced", {})
    st = native.get("stats")
    tau = 1 + st["num_accepted_tokens"] / st["num_drafts"] if st and st["num_drafts"] else None
    step: dict[str, float | None] = {"target_step_ms_b1": 1e3 / b0["1"] if "1" in b0 else None}
    if tau and "1" in bn and "1" in b0:
        round_ms = 1e3 * tau / bn["1"]
        step["eagle3_round_ms_b1"] = round_ms
        step["drafting_ms_per_round_b1"] = round_ms - step["target_step_ms_b1"]
        step["drafter_to_target_step_cost"] = (round_ms - step["target_step_ms_b1"]) / k / step["target_step_ms_b1"]
    counters = [r.get("stats") for n, r in results.items() if kind_of(n) in ("native", "forced") and "stats" in r]
    return {
        "instances": {kind: [n for n in results if kind_of(n) == kind and results[n].get("bench")] for kind in KINDS},
        "tau_k3": tau, "stats_native": st, "stats_forced": forced.get("stats"),
        "counters_equal_forced_native": (all(c == counters[0] for c in counters) and len(counters) > 1)
        if "stats" in forced and st else None,
        "mismatching_prompts_baseline_native": mismatches(results.get("speed-baseline", {}), native),
        "mismatching_prompts_native_forced": mismatches(native, forced),
        "baseline_tokens_per_s": b0, "eagle3_tokens_per_s": bn, "forced_tokens_per_s": bf,
        "speedup": {b: bn[b] / b0[b] for b in b0 if b in bn},
        "forced_vs_native_throughput": {b: bf[b] / bn[b] for b in bn if b in bf},
        "instance_spread": {kind: s for kind in KINDS if (s := spread(results, kind))},
        **step,
    }


def table(res: Mapping[str, Any]) -> str:
    """The figures as a markdown table (output tokens/s per batch size, side by side) and a note."""
    rows = ["| batch | without EAGLE-3 | EAGLE-3 (vLLM's forward) | speedup | EAGLE-3 (our forward forced) | "
            "forced / native |", "|---|---|---|---|---|---|"]

    def cell(x: float | None, spec: str) -> str:
        return "not run" if x is None else format(x, spec)

    for b, base in res["baseline_tokens_per_s"].items():
        rows.append(f"| {b} | {base:,.0f} | {cell(res['eagle3_tokens_per_s'].get(b), ',.0f')} | "
                    f"{cell(res['speedup'].get(b), '.2f')}x | {cell(res['forced_tokens_per_s'].get(b), ',.0f')} | "
                    f"{cell(res['forced_vs_native_throughput'].get(b), '.3f')} |")
    tau = res.get("tau_k3")
    note = f"Target deepened from {res['source_layers']} to {res['layers']} layers; tau at k=3: " + (
        f"{tau:.3f}" if tau else "not measured")
    if res.get("target_step_ms_b1") and res.get("eagle3_round_ms_b1"):
        note += (f"; batch 1: target step {res['target_step_ms_b1']:.2f} ms, EAGLE-3 round "
                 f"{res['eagle3_round_ms_b1']:.2f} ms, drafter/target step cost {res['drafter_to_target_step_cost']:.3f}")
    for kind, s in (res.get("instance_spread") or {}).items():
        n = len(res["instances"][kind])
        note += (f". {n} {kind} engines: fastest over slowest " + ", ".join(f"{v:.3f} at batch {b}" for b, v in s.items())
                 + " (the figures above are medians over instances)")
    dv = res.get("divergence_baseline_native")
    if dv:
        note += (f". Outputs with and without EAGLE-3 part on {dv['differing_at_a_token']} of {dv['compared']} prompts; "
                 f"{dv['near_ties']} of them where the float32 target's two candidates lie within "
                 f"{dv['ties_within_bf16_steps']:g} bf16 steps (largest margin {dv['largest_margin']:.4f})")
    return "\n".join(rows) + "\n\n" + note + ".\n"
