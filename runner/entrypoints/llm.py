"""LLM: the offline Python API (vLLM's ``LLM.generate`` shape), one instance per DP rank.

Every rank calls ``generate`` with the *same* prompt list (SPMD). Prompt ``i`` runs on DP rank
``i % data_parallel_size``; each rank loops ``schedule -> runner.step -> update`` until the runner reports
that no rank has work left (idle ranks run dummy steps meanwhile, so the MoE collectives stay matched), then
the outputs are all-gathered so every rank returns the full list in input order.

The loop itself is ``runner/core/overlap_loop.py``: by default the CPU processes step N-1 and schedules N+1 while
step N runs on a forward executor thread (``--disable-overlap-schedule``: one step at a time, in this thread).
With ``trace_file`` set, each call is recorded and written as a Chrome trace (``runner/tracing.py``).

Random sampling without an explicit seed uses seed ``cfg.seed * 1_000_003 + i`` for prompt ``i``: a request's
tokens then depend only on its own prompt, seed and logits — not on which rank ran it, what else was in its
batch, or whether DBO split the step.

One ``LLM`` runs one ``generate`` at a time: its scheduler state, its model runner's persistent input
buffers and its forward thread serve one call. Calls from several threads are serialised by a lock (each
returns its own outputs, in turn). With ``data_parallel_size > 1`` every rank must make the same calls in the
same order, which the arrival order of threads cannot guarantee, so there a concurrent call raises instead.
"""
from __future__ import annotations

import numbers
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from runner import tracing
from runner.config import RunnerConfig, make_config
from runner.distributed.liveness import report_progress
from runner.core.engine_core import EngineCore
from runner.core.overlap_loop import LoopStats
from runner.core.requests import EngineCoreOutput, EngineCoreRequest
from runner.sampling_params import SamplingParams



@dataclass
class RequestOutput:
    index: int  # position in the prompt list given to generate()
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = {"index": self.index, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
             "error": self.error}
        if self.text is not None:
            d["text"] = self.text
        return d


@dataclass
class GenerationStats:
    """One generate() call over all DP ranks (steps are global: DP ranks step in lockstep)."""

    num_requests: int
    num_errors: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    num_steps: int
    num_ubatched_steps: int
    num_preemptions: int
    enable_dbo: bool = False

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        parts = [f"requests: {self.num_requests} ({self.num_errors} errors)",
                 f"prompt tokens: {self.num_prompt_tokens}", f"output tokens: {self.num_output_tokens}",
                 f"time: {self.elapsed_s:.2f} s", f"{self.output_tokens_per_s:.1f} output tok/s",
                 f"steps: {self.num_steps}"]
        if self.enable_dbo:
            parts.append(f"ubatched steps: {self.num_ubatched_steps}/{self.num_steps} (DBO)")
        if self.num_preemptions:
            parts.append(f"preemptions: {self.num_preemptions}")
        return " | ".join(parts)


def resolve_world(cfg: RunnerConfig) -> tuple[int, int]:
    """(rank, world size) for this process; joins a torchrun world if its environment is set, with the
    backend of ``cfg.device`` (NCCL on CUDA, gloo on the CPU)."""
    import torch.distributed as dist

    from runner.distributed.device import check_world_backend, resolve_device_type
    from runner.distributed.launch import init_distributed, torchrun_env_present

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        check_world_backend(str(dist.get_backend()), resolve_device_type(cfg.device))
    elif torchrun_env_present() and int(os.environ["WORLD_SIZE"]) > 1:
        rank, world = init_distributed(cfg.dist_timeout_s, device=cfg.device)
    else:
        rank, world = 0, 1
    if world != cfg.data_parallel_size:
        if world == 1:
            raise RuntimeError(
                f"data_parallel_size={cfg.data_parallel_size} needs one process per DP rank: launch with "
                f"`torchrun --nproc-per-node {cfg.data_parallel_size} ...`, `python -m runner generate "
                f"--data-parallel-size {cfg.data_parallel_size} ...`, or runner.distributed.launch.launch(fn, "
                f"{cfg.data_parallel_size})")
        raise RuntimeError(f"this torch.distributed world has {world} ranks but data_parallel_size="
                           f"{cfg.data_parallel_size}; they must match")
    return rank, world


def _is_int(value: Any) -> bool:
    """An integer token id: ``int``, a numpy or other ``numbers.Integral`` integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_list(value: Any) -> Any:
    """numpy arrays and torch tensors as (nested) lists; anything else unchanged."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str)) else value


def _encode(tokenizer: Any, text: str) -> list[int]:
    enc = tokenizer.encode(text)
    return list(enc.ids) if hasattr(enc, "ids") else list(enc)  # tokenizers.Tokenizer vs transformers


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(ids)


class LLM:
    """``LLM(cfg)``, ``LLM(model=..., enable_dbo=True, ...)`` or ``LLM("tiny-qwen3-moe")``.

    ``runner`` injects a model runner (tests); ``tokenizer`` overrides the one found next to the model
    (``tokenizer.json``), which is loaded only when a text prompt needs it.
    """

    def __init__(self, cfg: RunnerConfig | str | None = None, /, *, runner: Any = None, tokenizer: Any = None,
                 **kwargs: Any) -> None:
        if isinstance(cfg, str):
            kwargs.setdefault("model", cfg)
            cfg = None
        if cfg is None or kwargs:
            cfg = make_config(cfg, **kwargs)
        self.cfg = cfg
        self.rank, self.world_size = resolve_world(cfg) if runner is None else (
            getattr(runner, "rank", 0), getattr(runner, "world_size", 1))
        if runner is None:
            from runner.worker.model_runner import ModelRunner
            from runner.models.loader import check_max_model_len, model_config

            if cfg.max_model_len is not None:  # checked before any weight is read
                check_max_model_len(cfg.max_model_len, model_config(cfg.model, cfg.cache_dir))
            runner = ModelRunner(cfg, self.rank, self.world_size)
        self.runner = runner
        self._tokenizer = tokenizer
        self._tokenizer_loaded = tokenizer is not None
        self.last_stats: GenerationStats | None = None
        self.last_loop_stats: LoopStats | None = None
        self.last_trace: Any = None  # runner.tracing.TraceResult of the last generate() with trace_file set
        self._core: EngineCore | None = None
        # One generate() at a time (module docstring). Waiting on it is bounded by the call ahead, whose own
        # waits (collectives, handoffs) all time out.
        self._busy = threading.Lock()
        self._busy_thread: int | None = None  # the thread inside generate(), if any

    # ------------------------------------------------------------------ helpers
    def get_tokenizer(self) -> Any:
        """The model's tokenizer, or None when the model directory has no ``tokenizer.json``."""
        if not self._tokenizer_loaded:
            from runner.models.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.cfg.model, self.cfg.cache_dir)
            self._tokenizer_loaded = True
        return self._tokenizer

    def close(self) -> None:
        """Stop the forward thread and release the runner; not while a generate() runs in another thread."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("LLM.close() called while generate() is running in another thread; close it after "
                               "that call returns")
        try:
            self._close()
        finally:
            self._busy.release()

    def _close(self) -> None:
        if self._core is not None:
            self._core.close()
            self._core = None
            return
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _prompt_ids(self, prompts: Any) -> list[Any]:
        """Token-id lists (or the raw bad value, which the scheduler rejects per request) in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = _as_list(prompts)
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of strings or token-id lists, got {type(prompts).__name__}")
        if prompts and all(_is_int(p) for p in prompts):
            raise TypeError("prompts is a flat list of ints; pass a list of prompts, e.g. [[1, 2, 3]] for one "
                            "token-id prompt")
        texts = [i for i, p in enumerate(prompts)
                 if isinstance(p, str) or (isinstance(p, dict) and "prompt" in p)]
        tokenizer = self.get_tokenizer() if texts else None
        if texts and tokenizer is None:
            raise ValueError(f"prompt {texts[0]} is text but model {self.cfg.model!r} has no tokenizer.json; pass "
                             "token-id lists instead (or give LLM(..., tokenizer=...))")
        out: list[Any] = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = p["prompt_token_ids"]
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise TypeError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
            p = _as_list(p)
            if isinstance(p, str):
                p = _encode(tokenizer, p) if (i % self.world_size) == self.rank else []
            elif isinstance(p, Sequence):
                p = [int(t) if _is_int(t) else t for t in p]  # numpy / torch integers are token ids too
            else:
                raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
            out.append(p)
        return out

    @staticmethod
    def _params(sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts; pass one, or one per prompt")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is {type(p).__name__}, not SamplingParams")
        return params

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, disable_progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order, on every rank.

        Thread-safe: concurrent calls run one after the other (``last_stats`` describes the latest to finish);
        with data_parallel_size > 1 a call made while another runs raises RuntimeError (module docstring).
        """
        forward_thread = self._core.forward_thread_id if self._core is not None else None
        if self._busy_thread is not None and threading.get_ident() in (self._busy_thread, forward_thread):
            # from the calling thread or this LLM's forward thread: it would wait for itself forever
            raise RuntimeError("LLM.generate called again from inside a generate() call (same thread, or the "
                               "forward thread running its steps)")
        if self.world_size > 1:
            if not self._busy.acquire(blocking=False):
                raise RuntimeError(
                    f"LLM.generate called from another thread while a call is running on DP rank {self.rank}: "
                    f"with data_parallel_size={self.world_size} every rank must make the same calls in the same "
                    "order, which concurrent threads cannot guarantee; call generate from one thread per rank")
        else:
            self._busy.acquire()
        self._busy_thread = threading.get_ident()
        try:
            return self._generate(prompts, sampling_params, disable_progress)
        finally:
            self._busy_thread = None
            self._busy.release()

    def _generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  disable_progress: bool) -> list[RequestOutput]:
        prompt_ids = self._prompt_ids(prompts)
        params = self._params(sampling_params, len(prompt_ids))
        start = time.perf_counter()
        steps0 = getattr(self.runner, "num_steps", 0)
        ubatched0 = getattr(self.runner, "num_ubatched_steps", 0)
        core = self._engine_core()
        sched = core.scheduler
        preemptions0 = sched.num_preemptions
        local = list(range(self.rank, len(prompt_ids), self.world_size))
        for i in local:
            core.add_request(EngineCoreRequest(i, prompt_ids[i], params[i], default_seed=self.cfg.seed * 1_000_003 + i))
        with tracing.record(self.cfg.trace_file, getattr(self.runner, "device", None)) as rec:  # clock: device
            finished = self._run_loop(core, prompt_ids, len(local), disable_progress)
        if sched.allocator.num_free_blocks != sched.allocator.num_blocks:  # a leak would starve later calls
            raise RuntimeError(f"KV blocks leaked: {sched.allocator.num_blocks - sched.allocator.num_free_blocks} "
                               "still allocated after every request finished")
        try:  # detokenize whenever the model ships a tokenizer, whatever form the prompts came in
            tokenizer = self.get_tokenizer()
        except ImportError:
            tokenizer = None
        outputs = [self._output(i, prompt_ids[i], finished[i], tokenizer) for i in local]
        elapsed = time.perf_counter() - start
        mine = (outputs, sched.num_preemptions - preemptions0, elapsed, tracing.local_spans(rec))
        gathered = self._all_gather(mine)
        if rec is not None:
            self.last_trace = tracing.export(self.cfg.trace_file, [g[3] for g in gathered], self.rank)
        outputs = sorted((o for g in gathered for o in g[0]), key=lambda o: o.index)
        self.last_stats = GenerationStats(
            num_requests=len(outputs), num_errors=sum(o.finish_reason == "error" for o in outputs),
            num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs if o.finish_reason != "error"),
            num_output_tokens=sum(len(o.token_ids) for o in outputs),
            elapsed_s=max(time.perf_counter() - start, max(g[2] for g in gathered)),
            num_steps=getattr(self.runner, "num_steps", 0) - steps0,
            num_ubatched_steps=getattr(self.runner, "num_ubatched_steps", 0) - ubatched0,
            num_preemptions=sum(g[1] for g in gathered), enable_dbo=self.cfg.enable_dbo)
        return outputs

    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @staticmethod
    def _output(index: int, prompt: Any, final: EngineCoreOutput, tokenizer: Any) -> RequestOutput:
        tokens = final.new_token_ids
        text = _decode(tokenizer, tokens) if tokenizer is not None and final.finish_reason != "error" else None
        return RequestOutput(index=index, prompt_token_ids=list(prompt) if isinstance(prompt, list) else [],
                             token_ids=list(tokens), text=text, finish_reason=final.finish_reason or "error",
                             error=final.error)

    def _run_loop(self, core: EngineCore, prompt_ids: list[Any], num_local: int,
                  disable_progress: bool) -> dict[int, EngineCoreOutput]:
        """Step the engine core until the wave ends (no DP rank has work); returns each request's outputs joined
        into one (all its tokens, its finish reason)."""
        bar = self._progress_bar(num_local, disable_progress)
        out_tokens, t0 = 0, time.perf_counter()
        joined: dict[int, EngineCoreOutput] = {}
        finished: dict[int, EngineCoreOutput] = {}

        def collect(outputs: list[EngineCoreOutput]) -> None:
            nonlocal out_tokens
            for o in outputs:
                acc = joined.setdefault(o.request_id, EngineCoreOutput(o.request_id))
                acc.new_token_ids.extend(o.new_token_ids)
                out_tokens += len(o.new_token_ids)
                if o.finished:
                    acc.finish_reason, acc.stop_reason, acc.error = o.finish_reason, o.stop_reason, o.error
                    finished[o.request_id] = joined.pop(o.request_id)
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.set_postfix_str(f"{out_tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s", refresh=False)

        try:
            collect(core.take_outputs())  # requests refused at add time
            while True:
                step = core.step()
                collect(step.outputs)
                if not step.running:
                    break
            self.last_loop_stats = core.last_loop_stats
            leftover = [rid for rid in joined if rid not in finished] + [
                r.req_id for r in list(core.scheduler.running) + list(core.scheduler.waiting)
                if r.req_id not in joined]
            for rid in leftover:  # only if the runner stopped early: never silent
                core.scheduler.abort_request(rid, "engine stopped before the request finished (model runner "
                                                  "reported no work while this request was still queued)")
            collect(core.take_outputs())
        finally:
            if bar is not None:
                bar.close()
        return finished

    def _engine_core(self) -> EngineCore:
        """This rank's engine core (created on first use, closed by close())."""
        if self._core is None:
            self._core = EngineCore(self.cfg, self.runner, before_launch=report_progress)  # liveness: step count
        return self._core

    def _progress_bar(self, total: int, disable: bool) -> Any:
        if disable or self.rank != 0 or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        desc = "Processed prompts" if self.world_size == 1 else f"Processed prompts (DP rank 0 of {self.world_size})"
        return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)
