"""A traced engine step is explained by named phases: every phase's work runs inside a span of that phase.

One process, DBO on, the emulated link carrying the all-to-all. What a trace can decide whatever the machine's
load is checked, not a share of wall time (a share moves with load: Python between spans is slowed by a busy
core or a coverage tracer, the spans' torch work is not):

- every ubatched step has each of its phases: the step's own on the step track, and on each ubatch track
  the model's phases exactly once per layer (a phase that loses its span, or records it twice, fails);
- the test itself probes the work: it wraps the functions that do each phase (scheduling, the DP vote, input
  preparation, sampling, placeholder resolve, routing, the all-to-all sends, the experts) and every leaf
  module that runs whole (Linear, norms, embedding), and records when each call ran. Each call must lie
  inside a span of its phase on its own track (a module call: inside some named span of its ubatch). This is
  containment, decided by the order of the code (span opened, work, span closed), so load cannot move it;
  remove a phase's span and that phase's probed work lies between spans, and the test names it.
"""
from __future__ import annotations

import functools
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.models.loader import TINY_MODELS
from ubatch.trace_metrics import is_cpu_track, spans_from_chrome

MODEL = "tiny-qwen3-moe"
LAYERS = TINY_MODELS[MODEL]["num_hidden_layers"]
PHASES = {"schedule", "update", "dp_vote", "inputs", "sample", "ubatch_setup", "embed", "attention", "gate",
          "route", "dispatch_send", "experts", "combine_send", "handoff", "final_norm"}
# Per ubatched step: on the step track (at least once: input preparation, say, may be split in parts); on
# each ubatch track exactly once, or exactly once per layer.
STEP_PHASES = ("dp_vote", "inputs", "ubatch_setup", "ubatch_wake", "ubatch_join", "ubatch_merge", "sample")
UBATCH_ONCE = ("embed", "final_norm")
UBATCH_PER_LAYER = ("attention", "mlp_norm", "gate", "route", "dispatch_send", "experts", "combine_send", "residual")


@dataclass(frozen=True)
class Call:
    """One probed call: the span it must lie in (``phase``; None: any named span) on ``track``."""

    what: str
    phase: str | None
    track: str
    start: float
    end: float


def _ubatch_track() -> str:
    from ubatch.forward_context import maybe_get_forward_context

    fc = maybe_get_forward_context()
    return f"ubatch{fc.ubatch_id}" if fc is not None and fc.ubatch_id is not None else "step"


def _subclasses(cls: type[Any]) -> Iterator[type[Any]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


class Probes:
    """Wraps each phase's functions and hooks every whole-running leaf module; ``calls`` is what ran."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.calls: list[Call] = []
        self.mp = mp
        self._open: dict[tuple[int, int], float] = {}
        self._handles: list[Any] = []

    def wrap(self, owner: Any, name: str, phase: str, track: Callable[[], str]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def probed(*args: Any, **kwargs: Any) -> Any:
            where = track()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.calls.append(Call(f"{getattr(owner, '__name__', owner)}.{name}", phase, where, start,
                                       time.perf_counter()))

        self.mp.setattr(owner, name, probed)

    def install(self) -> None:
        import runner.worker.model_runner as model_runner
        import ubatch.modular_moe.experts.torch_experts
        import ubatch.modular_moe.layer as layer
        import ubatch.modular_moe.prepare_finalize.none  # noqa: F401
        from runner.core.scheduler import Scheduler
        from runner.worker.device_future_map import DeviceFutureMap
        from ubatch.modular_moe.experts.base import MoEExperts
        from ubatch.modular_moe.prepare_finalize.base import PrepareFinalize

        step, scheduler = (lambda: "step"), (lambda: "scheduler")
        self.wrap(Scheduler, "schedule", "schedule", scheduler)
        self.wrap(Scheduler, "update", "update", scheduler)
        self.wrap(model_runner.ModelRunner, "_may_ubatch", "dp_vote", step)
        self.wrap(model_runner, "attention_arrays", "inputs", step)
        self.wrap(model_runner.ModelRunner, "_launch_sampling", "sample", step)
        self.wrap(DeviceFutureMap, "gather_", "resolve", step)
        self.wrap(layer, "select_experts", "route", _ubatch_track)
        for cls in _subclasses(MoEExperts):
            if "apply" in vars(cls):
                self.wrap(cls, "apply", "experts", _ubatch_track)
        for cls in _subclasses(PrepareFinalize):
            for method, phase in (("prepare_async", "dispatch_send"), ("finalize_async", "combine_send")):
                if method in vars(cls):
                    self.wrap(cls, method, phase, _ubatch_track)
        # FusedMoE is a leaf that hands over to the other ubatch inside its forward: its parts are probed above.
        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
                         torch.nn.modules.module.register_module_forward_hook(self._post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    @staticmethod
    def _whole_leaf(module: torch.nn.Module) -> bool:
        from ubatch.modular_moe.layer import FusedMoE

        return next(module.children(), None) is None and not isinstance(module, FusedMoE)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._whole_leaf(module):
            self._open[(id(module), threading.get_ident())] = time.perf_counter()

    def _post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        start = self._open.pop((id(module), threading.get_ident()), None)
        if start is not None:
            self.calls.append(Call(type(module).__name__, None, _ubatch_track(), start, time.perf_counter()))


def unexplained(calls: list[Call], spans: list[Any]) -> list[str]:
    """Probed calls that do not lie inside a span of their phase (any named span for ``phase=None``) on
    their track; one line each, first few per kind."""
    by_track: dict[str, list[Any]] = {}
    for s in spans:
        if is_cpu_track(s.track) and s.cat != "wait":
            by_track.setdefault(s.track, []).append(s)
    bad: Counter[str] = Counter()
    for c in calls:
        inside = any(s.start <= c.start and c.end <= s.end and (c.phase is None or s.name == c.phase)
                     for s in by_track.get(c.track, ()))
        if not inside:
            bad[f"{c.what} on {c.track} outside {'any named span' if c.phase is None else repr(c.phase)}"] += 1
    return [f"{what} ({n}x)" for what, n in sorted(bad.items())]


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One traced generate() with every phase probed: the Chrome trace, the raw spans, the probed calls."""
    from runner import tracing
    from runner.entrypoints.llm import LLM
    from runner.sampling_params import SamplingParams

    tmp = tmp_path_factory.mktemp("attribution")
    trace_file = tmp / "trace.json"
    raw: list[Any] = []
    with pytest.MonkeyPatch.context() as mp:
        original = tracing.local_spans

        def recording_local_spans(rec: tracing.Recording | None) -> tracing.RankTrace | None:
            spans = original(rec)
            raw.append(spans)
            return spans

        mp.setattr(tracing, "local_spans", recording_local_spans)
        llm = LLM(model=MODEL, cache_dir=str(tmp / "cache"), enable_dbo=True, dbo_cost_model="off",
                  disable_overlap_schedule=False,  # the overlap loop's phases (resolve) are probed too
                  dbo_decode_token_threshold=4, dbo_prefill_token_threshold=16, max_num_seqs=64,
                  emulate_link="latency_us=50,gbps=2", trace_file=str(trace_file), device="cpu")
        probes = Probes(mp)
        probes.install()
        try:
            rng = random.Random(0)
            prompts = [[rng.randrange(TINY_MODELS[MODEL]["vocab_size"]) for _ in range(24)] for _ in range(48)]
            llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
            stats = llm.last_stats
            assert stats is not None and stats.num_ubatched_steps == stats.num_steps > 10
        finally:
            probes.remove()
            llm.close()
    return {"chrome": json.loads(Path(trace_file).read_text()), "spans": raw[0].spans, "calls": probes.calls}


def test_every_named_phase_is_on_the_timeline(traced_run: dict[str, Any]) -> None:
    _, spans = spans_from_chrome(traced_run["chrome"], 0)
    assert {s.name for s in spans} >= PHASES


def test_every_ubatched_step_has_each_phase_as_often_as_it_runs(traced_run: dict[str, Any]) -> None:
    _, spans = spans_from_chrome(traced_run["chrome"], 0)
    starts = sorted(s.start for s in spans if s.name == "dp_vote")
    windows = list(zip(starts, starts[1:] + [float("inf")], strict=True))
    checked = 0
    for a, b in windows:
        inside = Counter((s.track, s.name) for s in spans if a <= s.start < b and s.track != "scheduler")
        if not inside[("step", "ubatch_setup")]:
            continue  # the last vote finds no work left: no forward
        checked += 1
        missing = [n for n in STEP_PHASES if not inside[("step", n)]]
        assert not missing, f"step at {a:.0f} us has no {missing} span on the step track"
        expected = {}
        for u in ("ubatch0", "ubatch1"):
            expected.update({(u, n): 1 for n in UBATCH_ONCE})
            expected.update({(u, n): LAYERS for n in UBATCH_PER_LAYER})
        got = {key: inside[key] for key in expected}
        assert got == expected, f"step at {a:.0f} us: {sorted((k, v) for k, v in got.items() if v != expected[k])}"
    assert checked > 10


def test_every_probed_call_runs_inside_its_phase(traced_run: dict[str, Any]) -> None:
    calls = traced_run["calls"]
    phases = {c.phase for c in calls}
    kinds = {c.what for c in calls if c.phase is None}
    # the probes really saw the work (a probe that never fires would pass vacuously)
    assert {"schedule", "update", "dp_vote", "inputs", "sample", "resolve", "route", "experts", "dispatch_send",
            "combine_send"} <= phases, phases
    assert {"Linear", "RMSNorm", "Embedding"} <= kinds, kinds
    assert unexplained(calls, traced_run["spans"]) == []


@pytest.mark.parametrize("phase,probe", [("gate", "Linear on ubatch0 outside any named span"),
                                         ("sample", "outside 'sample'"), ("experts", "outside 'experts'"),
                                         ("schedule", "outside 'schedule'"), ("embed", "Embedding on ubatch")])
def test_the_check_names_a_phase_without_its_span(traced_run: dict[str, Any], phase: str, probe: str) -> None:
    """The same run with one phase's spans dropped: the check reports that phase's work (so it has teeth)."""
    spans = [s for s in traced_run["spans"] if s.name != phase]
    found = unexplained(traced_run["calls"], spans)
    assert any(probe in line for line in found), found
