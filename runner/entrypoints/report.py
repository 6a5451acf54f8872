"""What ``python -m runner generate|bench`` prints and writes once the ranks are done, and its exit code.

One line per request (per sample with ``--n`` > 1): its finish reason (and stop reason), how many tokens, and
the text where the model has a tokenizer, else its first token ids. ``--output-json`` holds every request in
vLLM's ``RequestOutput`` shape (:func:`request_output_json`).

The summary is printed before any results file is written, so a file that cannot be written at the end
(the path was checked before the run, but a disk can fill or a directory vanish) costs that file only, not
the report or the other files; the message names the flag and the path (exit 1). A run in which every
request failed exits 1: the errors are listed, each with its text, and scripts do not mistake the run for a
success.
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.outputs import CompletionOutput, RequestOutput

NO_UBATCH_HINT = ("note: DBO was on but no step ran ubatched: each DP rank's batch stayed below "
                  "--dbo-decode-token-threshold / --dbo-prefill-token-threshold (or a rank's second ubatch would "
                  "have been empty); lower the thresholds or send more prompts")
COST_MODEL_OFF_HINT = ("note: DBO was on but no step ran ubatched: the measured DBO cost model found DBO slower in "
                       "the buckets it measured (above); --dbo-cost-model off runs it wherever the thresholds allow")
MAX_ERRORS_LISTED = 10


def no_ubatch_hint(stats: dict[str, Any]) -> str | None:
    """Why a DBO run ran no step ubatched, when it did not: the cost model's choice, or the thresholds."""
    if not stats["num_steps"] or stats["num_ubatched_steps"]:
        return None
    return COST_MODEL_OFF_HINT if stats.get("dbo_decisions") else NO_UBATCH_HINT


TEXT_SHOWN = 72  # characters of text per line
IDS_SHOWN = 8  # token ids per line, for a model without a tokenizer


def _completion_json(c: CompletionOutput, has_tokenizer: bool) -> dict[str, Any]:
    logprobs = None if c.logprobs is None else [
        {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
         for tid, lp in position.items()} for position in c.logprobs]
    return {"index": c.index, "text": c.text if has_tokenizer else None, "token_ids": list(c.token_ids),
            "cumulative_logprob": c.cumulative_logprob, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def request_output_json(index: int, o: RequestOutput, has_tokenizer: bool) -> dict[str, Any]:
    """One request of ``--output-json``: vLLM's RequestOutput fields (``text`` is null without a tokenizer;
    ``logprobs`` maps each token id, as a string, to its log-probability, rank and text)."""
    return {"index": index, "request_id": o.request_id, "prompt": o.prompt,
            "prompt_token_ids": list(o.prompt_token_ids), "finished": o.finished, "error": o.error,
            "outputs": [_completion_json(c, has_tokenizer) for c in o.outputs]}


def _shown_text(c: dict[str, Any]) -> str:
    if c["text"] is None:
        ids = c["token_ids"]
        return " ".join(map(str, ids[:IDS_SHOWN])) + (" ..." if len(ids) > IDS_SHOWN else "")
    text = c["text"]
    return repr(text[:TEXT_SHOWN]) + ("..." if len(text) > TEXT_SHOWN else "")


def show_request(r: dict[str, Any]) -> list[str]:
    """The lines for one request of ``--output-json`` (one per sample)."""
    if r["error"] is not None:
        return [f"[{r['index']}] error: {r['error'] or 'failed without a message'}"]
    lines = []
    for c in r["outputs"]:
        tag = f"[{r['index']}]" if len(r["outputs"]) == 1 else f"[{r['index']}.{c['index']}]"
        reason = c["finish_reason"] + (f" ({c['stop_reason']!r})" if c["stop_reason"] is not None else "")
        lines.append(f"{tag} {reason}, {len(c['token_ids'])} tokens: {_shown_text(c)}")
    return lines


def _list_errors(outputs: list[dict[str, Any]]) -> int:
    """Print the failed requests (each with its error text) to stderr; returns 1 when none succeeded."""
    errors = [o for o in outputs if o["error"] is not None]
    for o in errors[:MAX_ERRORS_LISTED]:
        print(f"request {o['index']}: error: {o['error'] or 'failed without a message'}", file=sys.stderr)
    if len(errors) > MAX_ERRORS_LISTED:
        print(f"... and {len(errors) - MAX_ERRORS_LISTED} more failed requests", file=sys.stderr)
    if outputs and len(errors) == len(outputs):
        print(f"error: no request succeeded ({len(errors)} of {len(outputs)} failed)", file=sys.stderr)
        return 1
    return 0


def _write(flag: str, path: str, write: Callable[[Path], object]) -> int:
    try:
        write(Path(path))
    except OSError as e:
        print(f"error: could not write the results to {flag} {path}: {e.strerror or e}; only that file is lost "
              "(the summary above stands)", file=sys.stderr)
        return 1
    return 0


def report_generate(result: dict[str, Any], output_json: str | None) -> int:
    run = result["runs"][0]
    outputs = run["outputs"]
    for o in outputs:
        for line in show_request(o):
            print(line)
    code = _list_errors(outputs)
    print(run["summary"])
    hint = no_ubatch_hint(run["stats"]) if run["dbo"] else None
    if hint:
        print(hint, file=sys.stderr)
    code = _report_trace(run) or code
    if output_json:
        code = _write("--output-json", output_json,
                      lambda p: p.write_text(json.dumps(outputs, indent=1) + "\n")) or code
    return code


def _report_trace(run: dict[str, Any]) -> int:
    """Print the trace's metrics; 1 when the trace file could not be written (said after the metrics)."""
    trace = run.get("trace")
    if not trace:
        return 0
    print(trace["report"])
    if trace.get("error"):
        print(f"error: --trace-file: {trace['error']}; only that file is lost (its metrics are above)",
              file=sys.stderr)
        return 1
    return 0


def _token_ids(r: dict[str, Any]) -> list[list[int]]:
    return [c["token_ids"] for c in r["outputs"]]


def compare_outputs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str | None:
    """None when token outputs are identical, else where they first differ."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} results"
    diffs = [(x["index"], _token_ids(x), _token_ids(y)) for x, y in zip(a, b, strict=True)
             if _token_ids(x) != _token_ids(y)]
    if not diffs:
        return None
    idx, xs, ys = diffs[0]
    # strict=False: the first difference within the common prefix, else the shorter length
    sample = next((k for k, (x, y) in enumerate(zip(xs, ys, strict=False)) if x != y), min(len(xs), len(ys)))
    x, y = (xs[sample] if sample < len(xs) else []), (ys[sample] if sample < len(ys) else [])
    pos = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
    where = f"request {idx}" + (f" sample {sample}" if max(len(xs), len(ys)) > 1 else "")
    return f"{len(diffs)} of {len(a)} requests differ (first: {where} at output token {pos})"


def tok_per_s(stats: dict[str, Any]) -> float:
    return stats["num_output_tokens"] / stats["elapsed_s"] if stats["elapsed_s"] else 0.0


@dataclass(frozen=True)
class Throughput:
    """A variant's output tok/s over its timed runs: the median, and the spread (max - min) / median."""

    runs: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def spread(self) -> float:
        return (max(self.runs) - min(self.runs)) / self.median if self.median else 0.0

    @classmethod
    def of(cls, run: dict[str, Any]) -> Throughput:
        return cls([tok_per_s(s) for s in run.get("repeats") or [run["stats"]]])


def token_verdict(off: dict[str, Any], on: dict[str, Any], float32: dict[str, Any] | None) -> tuple[str, bool]:
    """What the token comparison says, and whether the outputs count as identical.

    In float32 a difference is a difference. In a half-precision dtype DBO changes the GEMMs' row counts and so
    their rounding: a difference there is reported as such, with the float32 re-run's verdict beside it, and
    only the float32 verdict decides.
    """
    diff = compare_outputs(off["outputs"], on["outputs"])
    dtype = off.get("dtype", "float32")
    if diff is None:
        return f"identical ({len(on['outputs'])} requests{'' if dtype == 'float32' else ', ' + dtype})", True
    if float32 is None:
        return f"DIFFERENT: {diff}", False
    exact = compare_outputs(float32["off"], float32["on"])
    checked = (f"in float32 (DBO on every step the thresholds allow, {float32['experts_backend']} experts): " +
               (f"identical ({len(float32['on'])} requests)" if exact is None else f"DIFFERENT: {exact}"))
    return (f"{diff} in {dtype}, which may differ by rounding (DBO halves each step's GEMMs, and {dtype} rounds "
            f"a half-size GEMM differently); {checked}"), exact is None


def report_bench(result: dict[str, Any], output_csv: str | None) -> int:
    off, on = result["runs"]
    speed = {id(off): Throughput.of(off), id(on): Throughput.of(on)}
    rows = [("output tok/s", lambda r: f"{speed[id(r)].median:.1f}"),
            ("run-to-run", lambda r: f"{100 * speed[id(r)].spread:.1f} % ({len(speed[id(r)].runs)} runs)"),
            ("total time (s)", lambda r: f"{r['stats']['elapsed_s']:.3f}"),
            ("output tokens", lambda r: str(r["stats"]["num_output_tokens"])),
            ("steps", lambda r: str(r["stats"]["num_steps"])),
            ("ubatched steps", lambda r: str(r["stats"]["num_ubatched_steps"]))]
    print(f"{'':<16}{'DBO off':>20}{'DBO on':>20}")
    for name, fmt in rows:
        print(f"{name:<16}{fmt(off):>20}{fmt(on):>20}")
    verdict, identical = token_verdict(off, on, result.get("float32_check"))
    print(f"token outputs DBO off vs on: {verdict}")
    decisions = on["stats"].get("dbo_decisions")
    if decisions:
        print("DBO cost model: " + "; ".join(decisions))
    code = _list_errors(on["outputs"])
    hint = no_ubatch_hint(on["stats"])
    if hint:
        print(hint, file=sys.stderr)
    code = _report_trace(on) or code
    if output_csv:
        code = _write("--output-csv", output_csv, lambda p: _write_csv(p, off, on, identical, speed)) or code
    return code


def _write_csv(path: Path, off: dict[str, Any], on: dict[str, Any], identical: bool,
               speed: dict[int, Throughput]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["dbo", "output_tok_per_s", "total_time_s", "output_tokens", "steps", "ubatched_steps",
                    "outputs_identical", "runs", "spread_pct"])
        for run in (off, on):
            s, t = run["stats"], speed[id(run)]
            w.writerow([run["dbo"], round(t.median, 3), round(s["elapsed_s"], 4), s["num_output_tokens"],
                        s["num_steps"], s["num_ubatched_steps"], identical, len(t.runs), round(100 * t.spread, 2)])
