"""What every benchmark script shares: results go to CSV under benchmarks/results/."""
from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write ``rows`` to ``path`` and say where they went. The columns are every key of any row, in order of
    first appearance (a failed measurement's row lacks the columns of a timed one); missing cells are empty."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


#: each request's (temperature, top-k, top-p) by name: greedy; temperature 1, the OpenAI API's default; the sampling
#: defaults of Qwen3's and of Llama 3's generation_config.json (the decode graphs' greedy, draw, top-k and top-p heads)
SAMPLING_SETTINGS = {"greedy": (0.0, 0, 1.0), "draw": (1.0, 0, 1.0), "qwen3": (0.6, 20, 0.95), "llama3": (0.6, 0, 0.9)}

#: latency the calibrated emulated link charges per transfer (benchmarks that set the link relative to compute)
LINK_LATENCY_US = 20.0


def calibrated_link(nbytes: int, transfers: int, comm_s: float) -> str:
    """``--emulate-link`` spec whose total time for ``transfers`` transfers of ``nbytes`` bytes in all is
    ``comm_s`` (``LinkSpec.calibrated``: each transfer pays the latency once, the bandwidth carries the rest)."""
    from ubatch.modular_moe.prepare_finalize.emulated_link import LinkSpec

    return LinkSpec.calibrated(nbytes, transfers, comm_s, LINK_LATENCY_US).to_text()


def write_json(obj: Any, path: str | Path) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (a temporary file renamed over it): a reader, or a run
    killed mid-write, sees the previous complete file or the new one, never half of one."""
    import json
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def empty_prefix_cache(llm: Any) -> None:
    """Drop ``llm``'s cached prefix blocks before a timed call, so that the call computes every prompt token
    (prefix caching is on by default: the same prompts run again would be cache hits). Raises if a rank could not
    (a request still held KV blocks)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset before a timed call (a request still held KV "
                           "blocks)")
