"""What ``python -m runner generate|bench`` prints and writes once the ranks are done, and its exit code.

The summary is printed before any results file is written, so a file that cannot be written at the end
(the path was checked before the run, but a disk can fill or a directory vanish) costs the file, not the
report; the message names the flag and the path. A run in which every request failed exits 1: the errors
are listed, each with its text, and scripts do not mistake the run for a success.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any, Callable

NO_UBATCH_HINT = ("note: DBO was on but no step ran ubatched: each DP rank's batch stayed below "
                  "--dbo-decode-token-threshold / --dbo-prefill-token-threshold (or a rank's second ubatch would "
                  "have been empty); lower the thresholds or send more prompts")
MAX_ERRORS_LISTED = 10


def _show(o: dict[str, Any]) -> str:
    if o["finish_reason"] == "error":
        return f"[{o['index']}] error: {o['error'] or 'failed without a message'}"
    shown = " ".join(map(str, o["token_ids"][:12])) + (" ..." if len(o["token_ids"]) > 12 else "")
    text = f" {o['text']!r}" if o.get("text") else ""
    return f"[{o['index']}] {o['finish_reason']}: {shown}{text}"


def _list_errors(outputs: list[dict[str, Any]]) -> int:
    """Print the failed requests (each with its error text) to stderr; returns 1 when none succeeded."""
    errors = [o for o in outputs if o["finish_reason"] == "error"]
    for o in errors[:MAX_ERRORS_LISTED]:
        print(f"request {o['index']}: error: {o['error'] or 'failed without a message'}", file=sys.stderr)
    if len(errors) > MAX_ERRORS_LISTED:
        print(f"... and {len(errors) - MAX_ERRORS_LISTED} more failed requests", file=sys.stderr)
    if outputs and len(errors) == len(outputs):
        print(f"error: no request succeeded ({len(errors)} of {len(outputs)} failed)", file=sys.stderr)
        return 1
    return 0


def _write(flag: str, path: str, write: Callable[[Path], None]) -> int:
    try:
        write(Path(path))
    except OSError as e:
        print(f"error: could not write the results to {flag} {path}: {e.strerror or e}; the summary above is "
              "all that was kept", file=sys.stderr)
        return 1
    return 0


def report_generate(result: dict[str, Any], output_json: str | None) -> int:
    run = result["runs"][0]
    outputs = run["outputs"]
    for o in outputs[:4]:
        print(_show(o))
    if len(outputs) > 4:
        print(f"... {len(outputs) - 4} more")
    code = _list_errors(outputs)
    print(run["summary"])
    if run["dbo"] and run["stats"]["num_steps"] and not run["stats"]["num_ubatched_steps"]:
        print(NO_UBATCH_HINT, file=sys.stderr)
    _report_trace(run)
    if output_json:
        code = _write("--output-json", output_json,
                      lambda p: p.write_text(json.dumps(outputs, indent=1) + "\n")) or code
    return code


def _report_trace(run: dict[str, Any]) -> None:
    if run.get("trace"):
        print(run["trace"]["report"])


def compare_outputs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str | None:
    """None when token outputs are identical, else where they first differ."""
    diffs = [(x["index"], x["token_ids"], y["token_ids"]) for x, y in zip(a, b) if x["token_ids"] != y["token_ids"]]
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} results"
    if not diffs:
        return None
    idx, x, y = diffs[0]
    pos = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return f"{len(diffs)} of {len(a)} requests differ (first: request {idx} at output token {pos})"


def report_bench(result: dict[str, Any], output_csv: str | None) -> int:
    off, on = result["runs"]
    rows = [("output tok/s", lambda s: f"{s['num_output_tokens'] / s['elapsed_s']:.1f}" if s["elapsed_s"] else "0"),
            ("total time (s)", lambda s: f"{s['elapsed_s']:.3f}"),
            ("output tokens", lambda s: str(s["num_output_tokens"])),
            ("steps", lambda s: str(s["num_steps"])),
            ("ubatched steps", lambda s: str(s["num_ubatched_steps"]))]
    print(f"{'':<16}{'DBO off':>12}{'DBO on':>12}")
    for name, fmt in rows:
        print(f"{name:<16}{fmt(off['stats']):>12}{fmt(on['stats']):>12}")
    diff = compare_outputs(off["outputs"], on["outputs"])
    verdict = f"identical ({len(on['outputs'])} requests)" if diff is None else f"DIFFERENT: {diff}"
    print(f"token outputs DBO off vs on: {verdict}")
    code = _list_errors(on["outputs"])
    if on["stats"]["num_steps"] and not on["stats"]["num_ubatched_steps"]:
        print(NO_UBATCH_HINT, file=sys.stderr)
    _report_trace(on)
    if output_csv:
        code = _write("--output-csv", output_csv, lambda p: _write_csv(p, off, on, diff is None)) or code
    return code


def _write_csv(path: Path, off: dict[str, Any], on: dict[str, Any], identical: bool) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["dbo", "output_tok_per_s", "total_time_s", "output_tokens", "steps", "ubatched_steps",
                    "outputs_identical"])
        for run in (off, on):
            s = run["stats"]
            w.writerow([run["dbo"], round(s["num_output_tokens"] / s["elapsed_s"], 3) if s["elapsed_s"] else 0,
                        round(s["elapsed_s"], 4), s["num_output_tokens"], s["num_steps"], s["num_ubatched_steps"],
                        identical])
