"""LLM: the offline Python API, as vLLM users write it (vLLM's ``vllm/entrypoints/llm.py``).

``generate`` and ``chat`` take vLLM's arguments and return vLLM's ``RequestOutput``s. The LLM turns prompts into
engine-core requests and outputs back into ``RequestOutput``s (``OutputProcessor``); an engine client runs them,
picked by ``runner.engine.core_client.make_client`` from where the LLM runs:

- in a plain process, by default: the engine-core processes, one per DP rank (one for one rank, as vLLM's
  ``VLLM_ENABLE_V1_MULTIPROCESSING=1``), started here and stopped by ``close()``, ``del`` or interpreter exit
  (``SyncMPClient``): this process detokenizes and builds outputs while the cores run the next steps;
- one DP rank with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or an injected runner: the in-process client
  (``InprocClient``: an ``EngineCore`` and its step loop in this process);
- inside a world someone else launched (``torchrun``, ``runner.distributed.launch``; vLLM's
  ``distributed_executor_backend="external_launcher"``): one LLM per rank, every rank calling ``generate`` with
  the same prompts (SPMD); prompt ``i`` runs on rank ``i % data_parallel_size`` (its in-process client) and the
  outputs are all-gathered.

Bad prompts raise ``ValueError`` before any step. One call runs at a time (a lock; in SPMD a concurrent call
raises). Design: docs/design_notes.md, "Front ends".
"""
from __future__ import annotations

import logging
import numbers
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runner import tracing
from runner.batch_defaults import BATCH_FIELDS, UsageContext, with_batch_defaults
from runner.config import ConfigError, RunnerConfig, make_config
from runner.core.overlap_loop import LoopStats
from runner.core.prompt_checks import prompt_problem
from runner.core.requests import EngineCoreOutputs, default_seed
from runner.core.runner_protocol import ModelRunnerProtocol
from runner.engine.core_client import make_client
from runner.engine.engine_core_client import EngineCoreClient, RunReport
from runner.engine.generation_config import GenerationConfig, load_generation_config, model_eos_token_ids
from runner.engine.output_processor import OutputProcessor
from runner.engine.tokenizer import apply_chat_template, encode, load_tokenizer, load_tokenizer_from_dir
from runner.entrypoints.output_paths import output_path_error
from runner.entrypoints.vllm_engine_args import pop_vllm_engine_args
from runner.outputs import RequestOutput
from runner.sampling_params import RequestOutputKind, SamplingParams

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
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (every rank)
    prefix_cache_hits: int = 0  # of which found there: their KV was reused, not computed
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
        if self.prefix_cache_hits:
            parts.append(f"prefix cache: {self.prefix_cache_hits}/{self.prefix_cache_queries} prompt tokens")
        if self.dbo_decisions:
            parts.append("DBO cost model: " + "; ".join(self.dbo_decisions))
        return " | ".join(parts)


def launched_world(cfg: RunnerConfig, executor_backend: str | None = None) -> tuple[int, int] | None:
    """(rank, world size) of the torch.distributed world this process is a rank of, joining a torchrun world if
    its environment is set (the backend of ``cfg.device``: NCCL on CUDA, gloo on the CPU); None in a plain
    process, where an LLM with ``data_parallel_size > 1`` starts its own rank processes.
    ``executor_backend="external_launcher"`` (vLLM's) requires such a world."""
    import torch.distributed as dist

    from runner.distributed.device import check_world_backend, resolve_device_type
    from runner.distributed.launch import init_distributed, torchrun_env_present

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        check_world_backend(str(dist.get_backend()), resolve_device_type(cfg.device))
    elif torchrun_env_present() and int(os.environ["WORLD_SIZE"]) > 1:
        rank, world = init_distributed(cfg.dist_timeout_s, device=cfg.device)
    elif executor_backend == "external_launcher":
        raise RuntimeError(
            f"distributed_executor_backend='external_launcher' needs a world launched outside this LLM: run one "
            f"process per DP rank with `torchrun --nproc-per-node {cfg.data_parallel_size} ...` (or "
            "runner.distributed.launch.launch), or leave the argument unset to have the LLM start its ranks")
    else:
        return None
    if world != cfg.data_parallel_size:
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

    ``runner`` injects a model runner (tests); ``engine_client`` an engine client built for ``cfg`` (the CLI's
    rank processes, whose tracebacks it shows only with ``--debug``), which this LLM then owns and closes;
    ``tokenizer`` a tokenizer object or the directory to load one from, instead of the model's own
    (``runner/engine/tokenizer.py``), which is loaded on first use.
    """

    def __init__(self, cfg: RunnerConfig | str | None = None, /, *, runner: ModelRunnerProtocol | None = None,
                 engine_client: EngineCoreClient | None = None, tokenizer: Any = None, **kwargs: Any) -> None:
        if isinstance(cfg, str):
            kwargs.setdefault("model", cfg)
            cfg = None
        executor_backend = kwargs.get("distributed_executor_backend")
        pop_vllm_engine_args(kwargs)  # trust_remote_code=True, tensor_parallel_size=1, ...: accepted or refused
        if cfg is None or kwargs:
            # max_num_seqs / max_num_batched_tokens absent or None: vLLM's defaults for this device and the LLM
            # class (runner/batch_defaults.py), unless a config or an engine already fixed them
            given = [f for f in BATCH_FIELDS if kwargs.get(f) is not None]
            kwargs = {k: v for k, v in kwargs.items() if not (k in BATCH_FIELDS and v is None)}
            defaulted = cfg is None and runner is None and engine_client is None
            cfg = make_config(cfg, **kwargs)
            if defaulted:
                from runner.models.loader import model_config
                from runner.worker.model_runner import engine_max_model_len

                max_model_len = engine_max_model_len(cfg.max_model_len, model_config(cfg.model, cfg.cache_dir))
                cfg = with_batch_defaults(cfg, given, max_model_len, UsageContext.LLM_CLASS)
        self.cfg = cfg
        if cfg.trace_file is not None:  # the CLI checked it before any rank started; the Python API checks here
            problem = output_path_error(cfg.trace_file)
            if problem:
                raise ConfigError("trace_file", f"trace_file: {problem}")
        if runner is not None and engine_client is not None:
            raise ValueError("give LLM a runner or an engine_client, not both")
        world = (runner.rank, runner.world_size) if runner is not None \
            else None if engine_client is not None else launched_world(cfg, executor_backend)
        # rank and world size of the SPMD world this LLM is one rank of (0 and 1 when it drives every rank itself)
        self.rank, self.world_size = world if world is not None else (0, 1)
        # before any weight is read: the generation config (a bad one is an error) and max_model_len
        self.generation_config = self._load_generation_config(
            runner.eos_token_ids if runner is not None else None)
        if runner is None:
            from runner.models.loader import check_max_model_len, model_config

            if cfg.max_model_len is not None:
                check_max_model_len(cfg.max_model_len, model_config(cfg.model, cfg.cache_dir))
        self._client: EngineCoreClient = engine_client if engine_client is not None \
            else make_client(cfg, runner=runner, world=world)
        self._runner: ModelRunnerProtocol | None = self._client.runner
        self._tokenizer = load_tokenizer_from_dir(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) \
            else tokenizer
        self._tokenizer_loaded = tokenizer is not None
        self.last_stats: GenerationStats | None = None
        self.last_loop_stats: LoopStats | None = None  # the in-process step loop's (None over rank processes)
        self.last_trace: Any = None  # runner.tracing.TraceResult of the last generate() with trace_file set
        self._request_counter = 0  # request ids continue across calls, as vLLM's
        self._engine_request_counter = 0  # engine request ids continue too: a cut-short call's outputs may lag
        # One generate() at a time (module docstring). Waiting on it is bounded by the call ahead, whose own
        # waits (collectives, handoffs, the rank processes' outputs) all time out.
        self._busy = threading.Lock()
        self._busy_thread: int | None = None  # the thread inside generate(), if any

    @property
    def runner(self) -> ModelRunnerProtocol:
        """This process's model runner (one DP rank, or this rank of a launched world); a RuntimeError when the
        engine cores run in processes this LLM started (set VLLM_ENABLE_V1_MULTIPROCESSING=0 for one rank in this
        process)."""
        if self._runner is None:
            raise RuntimeError(f"this LLM runs data_parallel_size={self.cfg.data_parallel_size} ranks in their own "
                               "processes: their model runners are not in this process "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps one rank in this process)")
        return self._runner

    @property
    def engine_client(self) -> EngineCoreClient:
        """The engine client running this LLM's requests (in-process, or over the rank processes)."""
        return self._client

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

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``LLM.reset_prefix_cache``: drop every DP rank's cached prefix blocks, so the next generate()
        computes every prompt in full; True only if every rank did. Between generate() calls (one running in
        another thread is waited for; in SPMD every rank must call it, as generate())."""
        if self._busy_thread is not None and threading.get_ident() in (self._busy_thread,
                                                                       self._client.forward_thread_id):
            raise RuntimeError("LLM.reset_prefix_cache called from inside a generate() call")
        with self._busy:
            reset = self._client.reset_prefix_cache()
        return all(self._all_gather(reset)) if self.world_size > 1 else reset

    def close(self) -> None:
        """Stop the engine (the forward thread and the runner, or the rank processes); not while a generate()
        runs in another thread."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("LLM.close() called while generate() is running in another thread; close it after "
                               "that call returns")
        try:
            self._close()
        finally:
            self._busy.release()

    def _close(self) -> None:
        self._client.close()

    def __del__(self) -> None:  # the engine-core processes of an LLM that was never closed end with it
        client = self.__dict__.get("_client")
        if client is not None and client.runner is None:
            client.close()

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
        in SPMD (a launched world of several ranks) a call made while another runs raises RuntimeError (module
        docstring).
        """
        forward_thread = self._client.forward_thread_id
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
        client = self._client
        client.prepare(self.cfg)  # benchmarks switch the loop settings with llm.cfg = ... (in process only)
        local = list(range(self.rank, len(inputs), self.world_size))
        self._check_prompts(inputs, params, local)
        start = time.perf_counter()
        processor = OutputProcessor(tokenizer, client.max_model_len, self.generation_config)
        first_id = self._request_counter
        self._request_counter += len(inputs)
        engine_id = self._engine_request_counter  # unique for the client's lifetime, as its outputs may lag a call
        for i in local:
            text, ids = inputs[i]
            n = params[i].n
            for request in processor.add_request(str(first_id + i), text, ids, params[i],
                                                 engine_request_ids=range(engine_id, engine_id + n),
                                                 default_seed=default_seed(self.cfg.seed, i)):
                client.add_request(request)
            engine_id += n
        self._engine_request_counter = engine_id
        finished, report = self._run(processor, len(local), not use_tqdm)
        self.last_loop_stats = report.loop_stats
        mine = [(i, finished[str(first_id + i)]) for i in local]
        elapsed = time.perf_counter() - start
        if self.world_size > 1:  # SPMD: this rank's share; the peers' come from the gather
            gathered = self._all_gather((mine, report.num_preemptions, elapsed, report.traces[0],
                                         report.dbo_decisions[0], report.prefix_cache_queries,
                                         report.prefix_cache_hits))
        else:  # every rank this client drives, already together
            gathered = [(mine, report.num_preemptions, elapsed, None, [], report.prefix_cache_queries,
                         report.prefix_cache_hits)]
        traces = [g[3] for g in gathered] if self.world_size > 1 else report.traces
        decisions = [g[4] for g in gathered] if self.world_size > 1 else report.dbo_decisions
        if self.cfg.trace_file is not None:
            self.last_trace = tracing.export(self.cfg.trace_file, traces, self.rank)
            if self.last_trace is not None and self.last_trace.error:
                logger.warning(self.last_trace.error)
        outputs = [o for _, o in sorted((pair for g in gathered for pair in g[0]), key=lambda pair: pair[0])]
        self.last_stats = GenerationStats(
            num_requests=len(outputs), num_errors=sum(o.error is not None for o in outputs),
            num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs if o.error is None),
            num_output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
            elapsed_s=max(time.perf_counter() - start, max(g[2] for g in gathered)),
            num_steps=report.num_steps, num_ubatched_steps=report.num_ubatched_steps,
            num_preemptions=sum(g[1] for g in gathered), enable_dbo=self.cfg.enable_dbo,
            prefix_cache_queries=sum(g[5] for g in gathered), prefix_cache_hits=sum(g[6] for g in gathered),
            dbo_decisions=[(f"rank {r}: " if len(decisions) > 1 else "") + d
                           for r, lines in enumerate(decisions) for d in lines])
        return outputs

    def _check_prompts(self, inputs: list[tuple[str | None, Any]], params: list[SamplingParams],
                       local: list[int]) -> None:
        """ValueError naming the first prompt that cannot run, raised on every rank alike (each checks the prompts
        it encoded, the problems are gathered) before any request is added."""
        vocab_size, max_model_len = self._client.vocab_size, self._client.max_model_len
        problems = [(i, problem) for i in local
                    if (problem := prompt_problem(inputs[i][1], params[i], vocab_size, max_model_len))]
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

    def _run(self, processor: OutputProcessor, num_local: int,
             disable_progress: bool) -> tuple[dict[str, RequestOutput], RunReport]:
        """Have the engine client run every request added; returns each request's final RequestOutput by request
        id, and the client's report. Requests stopped by a stop string are aborted in the engine at once."""
        bar = self._progress_bar(num_local, disable_progress)
        out_tokens, t0 = 0, time.perf_counter()
        finished: dict[str, RequestOutput] = {}
        client = self._client

        def collect(outputs: EngineCoreOutputs) -> None:
            nonlocal out_tokens
            results, to_abort = processor.process_outputs(outputs)
            if to_abort:
                client.abort_requests(to_abort, "stopped by a stop string")
            for result in results:
                if result.finished:
                    finished[result.request_id] = result
            if bar is not None:  # the tokens are counted for the bar only: a pass over every output per step
                out_tokens += outputs.num_new_tokens
                bar.update(sum(r.finished for r in results))
                bar.set_postfix_str(f"{out_tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s", refresh=False)

        try:
            report = client.run(collect, trace=self.cfg.trace_file is not None)
        finally:
            if bar is not None:
                bar.close()
        return finished, report

    def _progress_bar(self, total: int, disable: bool) -> Any:
        if disable or self.rank != 0 or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        desc = "Processed prompts" if self.world_size == 1 else f"Processed prompts (DP rank 0 of {self.world_size})"
        return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)
