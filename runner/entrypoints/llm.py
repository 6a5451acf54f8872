"""LLM: the offline Python API, as vLLM users write it (vLLM's ``vllm/entrypoints/llm.py``), one instance per DP
rank.

``generate`` and ``chat`` take vLLM's arguments and return vLLM's ``RequestOutput``s, through the engine client
(text in and out) and an in-process ``EngineCore`` and step loop. With DP every rank calls ``generate`` with the
same prompts (SPMD): prompt ``i`` runs on rank ``i % data_parallel_size`` and the outputs are all-gathered.
Bad prompts raise ``ValueError`` before any step. One call runs at a time (a lock; with DP a concurrent call
raises). Design: docs/design_notes.md, "Front ends".
"""
from __future__ import annotations

import logging
import numbers
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from runner import tracing
from runner.config import ConfigError, RunnerConfig, make_config
from runner.core.engine_core import EngineCore
from runner.core.overlap_loop import LoopStats
from runner.distributed.liveness import report_progress
from runner.engine.generation_config import GenerationConfig, load_generation_config, model_eos_token_ids
from runner.engine.output_processor import OutputProcessor
from runner.engine.tokenizer import apply_chat_template, encode, load_tokenizer, load_tokenizer_from_dir
from runner.entrypoints.output_paths import output_path_error
from runner.core.prompt_checks import prompt_problem
from runner.entrypoints.vllm_engine_args import pop_vllm_engine_args
from runner.outputs import RequestOutput
from runner.sampling_params import RequestOutputKind, SamplingParams
from runner.worker.runner_protocol import ModelRunnerProtocol

if TYPE_CHECKING:  # built on demand: importing it loads the model code
    from runner.worker.model_runner import ModelRunner
from ubatch.log_once import log_once

logger = logging.getLogger("ubatch.engine")


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
    # the measured DBO cost model's buckets as they stand at the end (per DP rank, "rank r: " with several)
    dbo_decisions: list[str] = field(default_factory=list)

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
        if self.dbo_decisions:
            parts.append("DBO cost model: " + "; ".join(self.dbo_decisions))
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


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], dict))


class LLM:
    """``LLM(model=..., enable_dbo=True, ...)``, ``LLM("tiny-qwen3-moe")`` or ``LLM(cfg)``.

    ``runner`` injects a model runner (tests); ``tokenizer`` a tokenizer object or the directory to load one
    from, instead of the model's own (``runner/engine/tokenizer.py``), which is loaded on first use.
    """

    def __init__(self, cfg: RunnerConfig | str | None = None, /, *, runner: ModelRunnerProtocol | None = None,
                 tokenizer: Any = None, **kwargs: Any) -> None:
        if isinstance(cfg, str):
            kwargs.setdefault("model", cfg)
            cfg = None
        pop_vllm_engine_args(kwargs)  # trust_remote_code=True, tensor_parallel_size=1, ...: accepted or refused
        if cfg is None or kwargs:
            cfg = make_config(cfg, **kwargs)
        self.cfg = cfg
        if cfg.trace_file is not None:  # the CLI checked it before any rank started; the Python API checks here
            problem = output_path_error(cfg.trace_file)
            if problem:
                raise ConfigError("trace_file", f"trace_file: {problem}")
        self.rank, self.world_size = resolve_world(cfg) if runner is None else (
            runner.rank, runner.world_size)
        # before any weight is read: the generation config (a bad one is an error) and max_model_len
        self.generation_config = self._load_generation_config(
            runner.eos_token_ids if runner is not None else None)
        if runner is None:
            from runner.models.loader import check_max_model_len, model_config
            from runner.worker.model_runner import ModelRunner

            if cfg.max_model_len is not None:
                check_max_model_len(cfg.max_model_len, model_config(cfg.model, cfg.cache_dir))
            runner = ModelRunner(cfg, self.rank, self.world_size)
        self.runner: ModelRunnerProtocol = runner
        self._tokenizer = load_tokenizer_from_dir(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) \
            else tokenizer
        self._tokenizer_loaded = tokenizer is not None
        self.last_stats: GenerationStats | None = None
        self.last_loop_stats: LoopStats | None = None
        self.last_trace: Any = None  # runner.tracing.TraceResult of the last generate() with trace_file set
        self._core: EngineCore | None = None
        self._request_counter = 0  # request ids continue across calls, as vLLM's
        # One generate() at a time (module docstring). Waiting on it is bounded by the call ahead, whose own
        # waits (collectives, handoffs) all time out.
        self._busy = threading.Lock()
        self._busy_thread: int | None = None  # the thread inside generate(), if any

    @property
    def model_runner(self) -> ModelRunner:
        """The model runner this LLM built, for the front ends and benchmarks that read its model; a TypeError
        when a stand-in was injected."""
        from runner.worker.model_runner import ModelRunner

        if not isinstance(self.runner, ModelRunner):
            raise TypeError(f"this LLM runs an injected {type(self.runner).__name__}, not a ModelRunner")
        return self.runner

    # ------------------------------------------------------------------ helpers
    def _load_generation_config(self, model_eos: Iterable[int] | None) -> GenerationConfig:
        """The checkpoint's generation config; ``model_eos`` None: the EOS ids of its config.json."""
        from runner.models.loader import load_config, resolve_model_path

        path = resolve_model_path(self.cfg.model, self.cfg.cache_dir)
        if model_eos is None:
            model_eos = model_eos_token_ids(load_config(path))
        gen = load_generation_config(path, self.cfg.generation_config, model_eos)
        described = gen.describe()
        if described and self.rank == 0:
            log_once(logger, logging.WARNING, described)
        return gen

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (transformers'), or None when the model ships none (the built-in tiny models)."""
        if not self._tokenizer_loaded:
            self._tokenizer = load_tokenizer(self.cfg.model, self.cfg.cache_dir)
            self._tokenizer_loaded = True
        return self._tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses without sampling params: vLLM's defaults, or the checkpoint's
        ``generation_config.json`` where it sets them (unless ``generation_config="vllm"``)."""
        return self.generation_config.default_sampling_params()

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
        self.runner.close()

    def _prompt_inputs(self, prompts: Any) -> list[tuple[str | None, Any]]:
        """(text or None, token ids) per prompt, in input order. Text is encoded on the rank that runs it only;
        a bad prompt value is kept as given, for the scheduler to refuse as that request's error."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = _as_list(prompts)
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of strings or token-id lists, got {type(prompts).__name__}")
        if prompts and all(_is_int(p) for p in prompts):
            raise TypeError("prompts is a flat list of ints; pass a list of prompts, e.g. [[1, 2, 3]] for one "
                            "token-id prompt")
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)
                 or (isinstance(p, dict) and "prompt" in p and "prompt_token_ids" not in p)]
        tokenizer = self.get_tokenizer() if texts else None
        if texts and tokenizer is None:
            raise ValueError(f"prompt {texts[0]} is text but model {self.cfg.model!r} has no tokenizer; pass "
                             "token-id lists instead (or give LLM(..., tokenizer=...))")
        out: list[tuple[str | None, Any]] = []
        for i, p in enumerate(prompts):
            text: str | None = None
            if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt
                if "prompt_token_ids" in p:
                    text, p = p.get("prompt"), p["prompt_token_ids"]
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise TypeError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
            p = _as_list(p)
            if isinstance(p, str):
                text, p = p, encode(tokenizer, p) if (i % self.world_size) == self.rank else []
            elif isinstance(p, Sequence):
                p = [int(t) if _is_int(t) else t for t in p]  # numpy / torch integers are token ids too
            else:
                raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
            out.append((text, p))
        return out

    def _params(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, each asking for its final output only (as vLLM's LLM sets them)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, dict):  # vLLM's LLM takes SamplingParams objects only
            raise TypeError(f"sampling_params is a dict ({sampling_params!r}); pass SamplingParams(**that dict) "
                            "(or a list of SamplingParams, one per prompt)")
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        else:
            params = list(sampling_params)
            if len(params) != n:
                raise ValueError(f"got {len(params)} sampling params for {n} prompts; pass one, or one per prompt")
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    fix = "; pass SamplingParams(**that dict)" if isinstance(p, dict) else ""
                    raise TypeError(f"sampling_params[{i}] is {type(p).__name__}, not SamplingParams{fix}")
        final: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in final:
                q = p.clone()
                q.output_kind = RequestOutputKind.FINAL_ONLY
                final[id(p)] = q
        return [final[id(p)] for p in params]

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids":
        ...}`` dicts); returns one RequestOutput per prompt, in input order, on every rank.

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
            return self._generate(prompts, sampling_params, use_tqdm)
        finally:
            self._busy_thread = None
            self._busy.release()

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: ``messages`` is one conversation (a list of ``{"role": ..., "content": ...}``)
        or a list of them. Each is rendered with the checkpoint's chat template (or ``chat_template``), with
        the generation prompt, and generated from; ``RequestOutput.prompt`` is the rendered text. A model
        without a chat template raises ValueError naming it."""
        conversations = [messages] if _is_conversation(messages) else list(messages)
        prompts = []
        for conversation in conversations:
            if not _is_conversation(conversation):
                raise TypeError("messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) "
                                f"or a list of them, got an item of type {type(conversation).__name__}")
            text, ids = apply_chat_template(self.get_tokenizer(), list(conversation), model=self.cfg.model,
                                            chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tools=tools,
                                            chat_template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool) -> list[RequestOutput]:
        inputs = self._prompt_inputs(prompts)
        params = self._params(sampling_params, len(inputs))
        tokenizer = self.get_tokenizer()
        if tokenizer is None:  # checked on every rank alike, before any request is added (SPMD)
            stop = next((p.stop for p in params if p.stop), None)
            if stop:
                raise ValueError(f"stop strings {stop!r} need a tokenizer to find them in the text, and model "
                                 f"{self.cfg.model!r} has none; use stop_token_ids")
        core = self._engine_core()  # built on the first call (its one-time set-up is not this call's time)
        local = list(range(self.rank, len(inputs), self.world_size))
        self._check_prompts(inputs, params, local, core)
        start = time.perf_counter()
        steps0 = self.runner.num_steps
        ubatched0 = self.runner.num_ubatched_steps
        sched = core.scheduler
        preemptions0 = sched.num_preemptions
        processor = OutputProcessor(tokenizer, self.runner.max_model_len, self.generation_config)
        first_id = self._request_counter
        self._request_counter += len(inputs)
        engine_id = 0
        for i in local:
            text, ids = inputs[i]
            n = params[i].n
            for request in processor.add_request(str(first_id + i), text, ids, params[i],
                                                 engine_request_ids=range(engine_id, engine_id + n),
                                                 default_seed=self.cfg.seed * 1_000_003 + i):
                core.add_request(request)
            engine_id += n
        with tracing.record(self.cfg.trace_file, self.runner.device) as rec:  # clock: device
            finished = self._run_loop(core, processor, len(local), not use_tqdm)
        if sched.allocator.num_free_blocks != sched.allocator.num_blocks:  # a leak would starve later calls
            raise RuntimeError(f"KV blocks leaked: {sched.allocator.num_blocks - sched.allocator.num_free_blocks} "
                               "still allocated after every request finished")
        mine = ([(i, finished[str(first_id + i)]) for i in local], sched.num_preemptions - preemptions0,
                time.perf_counter() - start, tracing.local_spans(rec), self._dbo_decisions())
        gathered = self._all_gather(mine)
        if rec is not None and self.cfg.trace_file is not None:  # a recorder is made only for a trace file
            self.last_trace = tracing.export(self.cfg.trace_file, [g[3] for g in gathered], self.rank)
            if self.last_trace is not None and self.last_trace.error:
                logger.warning(self.last_trace.error)
        outputs = [o for _, o in sorted((pair for g in gathered for pair in g[0]), key=lambda pair: pair[0])]
        self.last_stats = GenerationStats(
            num_requests=len(outputs), num_errors=sum(o.error is not None for o in outputs),
            num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs if o.error is None),
            num_output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
            elapsed_s=max(time.perf_counter() - start, max(g[2] for g in gathered)),
            num_steps=self.runner.num_steps - steps0,
            num_ubatched_steps=self.runner.num_ubatched_steps - ubatched0,
            num_preemptions=sum(g[1] for g in gathered), enable_dbo=self.cfg.enable_dbo,
            dbo_decisions=[(f"rank {r}: " if len(gathered) > 1 else "") + d
                           for r, g in enumerate(gathered) for d in g[4]])
        return outputs

    def _dbo_decisions(self) -> list[str]:
        """This rank's DBO cost-model buckets, one line each (none without the measured cost model)."""
        cost_model = self.runner.cost_model
        return [] if cost_model is None else [d.describe() for d in cost_model.decisions()]

    def _check_prompts(self, inputs: list[tuple[str | None, Any]], params: list[SamplingParams], local: list[int],
                       core: EngineCore) -> None:
        """ValueError naming the first prompt that cannot run, raised on every rank alike (each checks the prompts
        it encoded, the problems are gathered) before any request is added."""
        sched = core.scheduler
        problems = [(i, problem) for i in local
                    if (problem := prompt_problem(inputs[i][1], params[i], sched.vocab_size, sched.max_model_len))]
        if self.world_size > 1:
            problems = sorted(p for gathered in self._all_gather(problems) for p in gathered)
        if problems:
            i, problem = problems[0]
            text = inputs[i][0]
            shown = f" ({text[:40]!r}{'...' if len(text) > 40 else ''})" if text is not None else ""
            raise ValueError(f"prompt {i}{shown}: {problem}")

    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _run_loop(self, core: EngineCore, processor: OutputProcessor, num_local: int,
                  disable_progress: bool) -> dict[str, RequestOutput]:
        """Step the engine core until the wave ends (no DP rank has work); returns each local request's final
        RequestOutput by request id. Requests stopped by a stop string are aborted in the core at once."""
        bar = self._progress_bar(num_local, disable_progress)
        out_tokens, t0 = 0, time.perf_counter()
        finished: dict[str, RequestOutput] = {}

        def collect(outputs: list[Any]) -> None:
            nonlocal out_tokens
            results, to_abort = processor.process_outputs(outputs)
            if to_abort:
                core.abort_requests(to_abort, "stopped by a stop string")
            out_tokens += sum(len(o.new_token_ids) for o in outputs)
            for result in results:
                if result.finished:
                    finished[result.request_id] = result
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
            for rid in processor.unfinished_engine_request_ids():  # only if the runner stopped early: never silent
                core.scheduler.abort_request(rid, "engine stopped before the request finished (model runner "
                                                  "reported no work while this request was still queued)")
            collect(core.take_outputs())
        finally:
            if bar is not None:
                bar.close()
        return finished

    def _engine_core(self) -> EngineCore:
        """This rank's engine core (created on first use, closed by close()); it steps with this LLM's current
        ``cfg`` (benchmarks switch the loop settings between calls with ``llm.cfg = llm.cfg.replace(...)``)."""
        if self._core is None:
            self._core = EngineCore(self.cfg, self.runner, before_launch=report_progress)  # liveness: step count
        self._core.cfg = self.cfg
        return self._core

    def _progress_bar(self, total: int, disable: bool) -> Any:
        if disable or self.rank != 0 or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        desc = "Processed prompts" if self.world_size == 1 else f"Processed prompts (DP rank 0 of {self.world_size})"
        return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)
