"""One EAGLE-3 engine launch in a fresh process (02's refusal, then the patched launch), and the untrained drafter that
makes vLLM ask the target for aux hidden states before any drafter has been trained.

The child is this module run as ``python -m eagle3lab.engines.launch_probe JOB``: a refused engine start leaves a
process in no state to try again, and the patch must arrive the way it does in production, through the plugin, in
processes we never run code in.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lab.drafter import build_drafter, save_drafter, target_embedding_weights
from eagle3lab.engines.processes import run_in_group
from eagle3lab.engines.vllm_offline import VllmEngine
from eagle3lab.engines.workers import WorkerReport
from eagle3lab.vllm_compat import REFUSAL_STEM


def refusal_in_log(text: str) -> str | None:
    """The EAGLE-3 refusal in a vLLM log, from the error's own words on (the last such line), or None."""
    lines = [ln.strip() for ln in text.splitlines() if REFUSAL_STEM in ln]
    if not lines:
        return None
    start = lines[-1].find("Model does not")
    return lines[-1][start:] if start >= 0 else lines[-1]


@dataclass
class LaunchProbe:
    """One EAGLE-3 engine launch in a fresh process: refused (with vLLM's own message) or served."""

    patch: dict[str, bool]
    refused: bool
    exit_code: int
    message: str | None
    workers: list[WorkerReport]
    outputs: list[list[int]] | None
    seconds: float
    log_file: str


def probe_launch(
    target_path: str | Path,
    drafter_path: str | Path,
    patch_env: dict[str, str],
    log_file: str | Path,
    engine_options: dict[str, Any] | None = None,
    prompt_ids: list[list[int]] | None = None,
    num_speculative_tokens: int = 3,
    timeout_s: float = 900.0,
    python: str | Path | None = None,
) -> LaunchProbe:
    """Start vLLM with an EAGLE-3 drafter in a child process and report what happened.

    A child, because a refused engine start leaves a process in no state to try again, and because the
    patch must arrive the way it does in production: through the plugin, in processes we never run
    code in. The child writes a JSON result; the refusal is read from the log, in the engine core's
    words. ``python`` runs the child in another environment (default: this interpreter).
    """
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    result_file = log_file.with_suffix(".json")
    result_file.unlink(missing_ok=True)
    job = {"target": str(target_path), "drafter": str(drafter_path), "options": engine_options or {},
           "prompts": prompt_ids or [[1, 2, 3, 4]], "k": num_speculative_tokens, "out": str(result_file)}
    # vLLM logs to the child's stdout, so that this launch's log holds the engine core's own refusal: the
    # run-wide vLLM log (VLLM_LOGGING_CONFIG_PATH, set by report.route_vllm_logs) would take it elsewhere.
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE3LAB_PATCH", "VLLM_LOGGING_CONFIG_PATH")}
    env.update(patch_env)
    t0 = time.perf_counter()
    # In a process group that is stopped however this call ends (timeout, Ctrl-C, the kernel killed): a
    # launched engine core left behind would hold the GPU for the next launch.
    rc = run_in_group([str(python or sys.executable), "-m", "eagle3lab.engines.launch_probe", json.dumps(job)], log_file,
                      timeout_s=timeout_s, env=env)
    message = refusal_in_log(log_file.read_text(errors="replace"))
    res = json.loads(result_file.read_text()) if result_file.is_file() else {}
    patch = json.loads(patch_env.get("EAGLE3LAB_PATCH", "{}") or "{}")
    return LaunchProbe(
        patch=patch, refused=message is not None and rc != 0, exit_code=rc, message=message,
        workers=[WorkerReport(**w) for w in res.get("workers", [])], outputs=res.get("outputs"),
        seconds=time.perf_counter() - t0, log_file=str(log_file),
    )  # fmt: skip


def random_probe_drafter(
    target_path: str | Path, aux_layer_ids: list[int], out_dir: str | Path, draft_vocab_size: int = 256, seed: int = 0
) -> Path:
    """An untrained EAGLE-3 drafter of the target, in the format vLLM loads: enough to make vLLM ask the
    target for aux hidden states (and so to meet the refusal) before any drafter has been trained."""
    cfg = json.loads((Path(target_path) / "config.json").read_text())
    embed, head = target_embedding_weights(target_path)
    vocab = int(cfg.get("vocab_size") or embed.shape[0])
    drafter = build_drafter(cfg, aux_layer_ids, torch.ones(vocab), min(draft_vocab_size, vocab), embed, head, seed=seed)
    return save_drafter(drafter, out_dir, target_path)


def _probe_child(job: dict[str, Any]) -> None:
    """The child of :func:`probe_launch` (``python -m eagle3lab.engines.launch_probe JOB``)."""
    eng = VllmEngine(job["target"], **job["options"])
    res = eng.speculative_generate(job["prompts"], job["drafter"], job["k"], 8, per_prompt=False)
    reports = eng.worker_reports()
    Path(job["out"]).write_text(json.dumps({"outputs": res.outputs, "stats": res.stats.to_dict(),
                                            "workers": [asdict(r) for r in reports]}))
    eng.close()



if __name__ == "__main__":
    _probe_child(json.loads(sys.argv[1]))
