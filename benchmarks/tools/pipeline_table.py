"""Issue 36 item 4's table for a finished run folder: its pipeline stages (generate, extract, train) beside the
seed's, and, for a GPU run, the seed's workload projected to Kimi-K2.5's widths with every assumption (the same
section 04 shows, for runs made before 04 had it).

    .venv/bin/python benchmarks/tools/pipeline_table.py RUN_DIR [--out benchmarks/pipeline-<run>.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from eagle3lab import pipeline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    metrics, params = pipeline.read_run(a.run)
    section = pipeline.report_for_run(metrics, params)
    rows = section.rows()
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if section.projection is None:
        print(f"\nno projection: {section.reason}")
    else:
        print("\nassumptions:\n" + "\n".join(f"- {x}" for x in section.projection.assumptions))
        for g in section.goal_rows():
            print(g)
    record = {"tool": "benchmarks/tools/pipeline_table.py", "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "run": str(a.run), "run_host": metrics.get("run", {}).get("host"),
              "run_started": metrics.get("run", {}).get("started"), "metrics": section.metrics(), "rows": rows,
              "assumptions": section.projection.assumptions if section.projection else None,
              "goals": section.goal_rows(), "no_projection_because": section.reason}
    if a.out:
        a.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
