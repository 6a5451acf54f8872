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


#: latency the calibrated emulated link charges per transfer (benchmarks that set the link relative to compute)
LINK_LATENCY_US = 20.0


def calibrated_link(nbytes: int, transfers: int, comm_s: float) -> str:
    """``--emulate-link`` spec whose total time for ``transfers`` transfers of ``nbytes`` bytes in all is
    ``comm_s``: without DBO every transfer pays the latency once and the wire carries ``nbytes``, so the
    bandwidth is what is left after the latencies."""
    gbps = nbytes / max(comm_s - transfers * LINK_LATENCY_US * 1e-6, 1e-6) / 1e9
    return f"latency_us={LINK_LATENCY_US},gbps={gbps:.6g}"
