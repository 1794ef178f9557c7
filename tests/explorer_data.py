"""Synthetic acceptance records (the format of DESIGN.md, "Acceptance records") for the explorer tests."""

import json
from pathlib import Path


def record(config_drafter: str, k: int, accepted: list[int], prompt_index: int, split: str = "heldout",
           temperature: float = 0.0) -> dict:
    """One prompt's record whose rounds accepted ``accepted[i]`` drafts; token ids count up from 100."""
    out, rounds, nxt = [100], [], 101
    for a in accepted:
        drafted = [nxt + i for i in range(a)] + [9000 + i for i in range(k - a)]  # rejected drafts: 9000+
        emitted = [nxt + i for i in range(a + 1)]
        rounds.append({"start": len(out), "drafted": drafted, "drafted_pieces": [f"t{t}" for t in drafted],
                       "accepted": a, "emitted": emitted})
        out += emitted
        nxt += a + 1
    ids = [1, 1, 2]
    return {"config": f"{split}/{config_drafter}/k{k}/T{temperature:g}", "split": split, "drafter": config_drafter,
            "aux_layer_ids": [1, 2, 4], "k": k, "temperature": temperature, "source": "decoded",
            "prompt_index": prompt_index, "prompt_ids": ids, "prompt_text": f"def prompt_{prompt_index}(x):",
            "output_ids": out, "output_pieces": [f"t{t}" for t in out], "rounds": rounds}


def write_run(folder: Path) -> Path:
    """A run folder holding only acceptance records: drafter main at k=3 (3 prompts) and k=1, one ablation."""
    recs = [record("main", 3, [3, 3, 1, 0], 0), record("main", 3, [2, 3, 3], 1), record("main", 3, [0, 0, 3], 2),
            record("main", 1, [1, 0, 1], 0), record("[2, 3, 4]", 3, [0, 1, 0, 0], 0)]
    path = folder / "artifacts" / "acceptance" / "records.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return folder
