"""Issue 36 item 4: the online route (aux states computed per training batch, no shards) against the offline one
(03's shards, then 04's training), on one finished workbook run: disk, wall time and tau, side by side, one process.

Both routes read the run's own target and samples, extract or compute aux states the way the profile says
(``data.extractor``: transformers on the profile's device, or the vLLM engine's in-engine capture), train a drafter
from the same initialisation with the profile's settings, and are measured by the profile's engine on the run's
held-out prompts (tau at ``acceptance.num_speculative_tokens``, greedy). The online route's verdict is computed:
it wins only where it needs less wall time than extraction + training, with tau no worse.

    .venv/bin/python benchmarks/tools/online_vs_offline.py RUN_DIR [--out benchmarks/online-vs-offline-<date>.json]
        [--order offline,online] [--prompts N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from eagle3lab import drafter as D
from eagle3lab import params as P
from eagle3lab import train
from eagle3lab.aux_states.online import OnlineAuxStates
from eagle3lab.aux_states.shards import HiddenStateDataset, ModelAuxSource, extract_hidden_states
from eagle3lab.engines.factory import engine_from_params
from eagle3lab.kwargs import drafter_kwargs, extraction_kwargs, train_kwargs
from eagle3lab.synthetic import read_jsonl
from eagle3lab.target_loading import load_target, resolve_device

# tau of the two drafters may differ by the batch-shape rounding of the target's forward (online batches are the
# training batches, offline ones the extraction's): a difference below this is no difference
TAU_TIE = 0.05


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())


def _machine(device: torch.device) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"host": platform.node(), "cpu": _cpu_model(), "cores": os.cpu_count(), "gpu": gpu,
            "threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__}


def _source(params, target: Path, aux_ids: list[int], work: Path):
    if params.data.extractor == "engine":
        from eagle3lab.engines.capture import aux_source_from_params
        return aux_source_from_params(params, target, aux_ids, work / "probe", log_dir=work / "logs")
    device = resolve_device(params.engine.device)
    # 03's transformers route runs the target in float32 on the profile's device
    model, _ = load_target(target, device=str(device), dtype="float32",
                           trust_remote_code=params.target.trust_remote_code)
    return ModelAuxSource(model.eval(), device)


def _train(params, target: Path, dataset, out: Path, device) -> tuple[Path, dict]:
    model, _ = train.build_drafter_for_target(target, dataset, params.drafter.draft_vocab_size,
                                              drafter_kwargs(params), seed=params.seed)
    t0 = time.perf_counter()
    res = train.train_drafter(model, dataset, seed=params.seed, **train_kwargs(params, device=device, progress=True))
    seconds = time.perf_counter() - t0
    arch = json.loads((target / "config.json").read_text()).get("architectures")
    path = D.save_drafter(model, out, target, num_speculative_tokens=params.acceptance.num_speculative_tokens,
                          verifier_architectures=arch)
    return path, {"train_s": seconds, "steps": res.steps, "final_loss": res.final_loss,
                  "acc": res.final_accuracy}


def _tau(params, target: Path, drafter: Path, prompts: list[list[int]], work: Path) -> dict:
    engine = engine_from_params(params, target, log_dir=work / "logs")
    try:
        res = engine.speculative_generate(prompts, drafter, params.acceptance.num_speculative_tokens,
                                          params.acceptance.max_new_tokens)
    finally:
        getattr(engine, "close", lambda: None)()  # the reference engine holds nothing to release
    s = res.stats
    return {"tau": s.mean_acceptance_length, "drafts": s.num_drafts,
            "per_position": s.per_position_rate}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--order", default="offline,online")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts for tau (default: the profile's)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    a = ap.parse_args()
    run = a.run.resolve()
    params = P.load(run / "params.yaml")
    target = run / "artifacts" / "target"
    samples = run / "artifacts" / "data" / "samples.jsonl"
    heldout = [r["prompt_ids"] for r in read_jsonl(run / "artifacts" / "data" / "heldout_prompts.jsonl")]
    heldout = heldout[: a.prompts or params.acceptance.num_prompts]
    aux_ids = sorted(params.resolved_aux_layer_ids())
    device = resolve_device(params.engine.device)
    work = a.work or Path(tempfile.mkdtemp(prefix="online-vs-offline-"))
    work.mkdir(parents=True, exist_ok=True)
    source = _source(params, target, aux_ids, work)
    rows: dict[str, dict] = {}
    for route in a.order.split(","):
        t0 = time.perf_counter()
        if route == "offline":
            hidden = work / "hidden"
            shutil.rmtree(hidden, ignore_errors=True)
            stats = extract_hidden_states(source, samples, aux_ids, hidden, target=target,
                                          **extraction_kwargs(params))
            extract_s = time.perf_counter() - t0
            path, tr = _train(params, target, HiddenStateDataset(hidden), work / "drafter-offline", device)
            row = {"extract_s": extract_s, "extract_tokens_per_s": stats.tokens_per_s, "bytes": stats.bytes,
                   "tokens": stats.tokens, **tr}
        elif route == "online":
            ds = OnlineAuxStates(source, samples, aux_ids, dtype=params.data.hidden_dtype)
            path, tr = _train(params, target, ds, work / "drafter-online", device)
            row = {"extract_s": 0.0, "bytes": 0, "forward_s": ds.forward_seconds, "forward_tokens": ds.forward_tokens,
                   **tr}
        else:
            raise SystemExit(f"unknown route {route!r}: offline or online")
        row["wall_s"] = time.perf_counter() - t0
        row["drafter"] = str(path)
        rows[route] = row
        print(route, {k: v for k, v in row.items() if k != "acc"}, flush=True)
    getattr(source, "close", lambda: None)()
    getattr(getattr(source, "engine", None), "close", lambda: None)()
    if isinstance(source, ModelAuxSource):
        del source
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for route, row in rows.items():
        row.update(_tau(params, target, Path(row["drafter"]), heldout, work))
        print(route, "tau", round(row["tau"], 3), flush=True)
    off, on = rows.get("offline"), rows.get("online")
    verdict = None
    if off and on:
        faster = on["wall_s"] <= off["wall_s"]
        tau_ok = on["tau"] >= off["tau"] - TAU_TIE
        verdict = {"online_wall_over_offline": on["wall_s"] / off["wall_s"],
                   "disk_saved_bytes": off["bytes"], "tau_gap": on["tau"] - off["tau"],
                   "online_wins": faster and tau_ok,
                   "why": ("online needs less wall time and keeps tau" if faster and tau_ok else
                           "online is slower than extraction + training" if not faster else
                           f"online loses more than {TAU_TIE} of tau")}
    record = {"tool": "benchmarks/tools/online_vs_offline.py", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": _machine(device), "run": str(run), "profile": params.profile, "device": str(device),
              "extractor": params.data.extractor, "hidden_dtype": params.data.hidden_dtype,
              "samples": sum(1 for _ in samples.open()), "epochs": params.train.epochs,
              "heldout_prompts": len(heldout), "k": params.acceptance.num_speculative_tokens,
              "routes": rows, "verdict": verdict}
    text = json.dumps(record, indent=2, default=float)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
