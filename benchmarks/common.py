"""What every benchmark script shares: results go to CSV under benchmarks/results/."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

RESULTS_DIR = Path(__file__).parent / "results"


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write ``rows`` (dicts with the same keys) to ``path`` and say where they went."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
