"""ModelRunner: one rank's forward step — inputs, attention metadata, the DBO decision, sampling.

Per step: build flat inputs from the scheduled chunks into persistent buffers; vote locally on ubatching
(thresholds), settle it with the other DP ranks in one all-reduce (``dp.py``), pad to the agreed size,
split into ubatch slices (``--ubatch-split tokens|balanced``) and call the model through
``UBatchWrapper``; then sample one token for each chunk that reached the end of its known tokens.
A rank with nothing scheduled while its peers work runs a dummy step of padding rows -- two ubatches of
one row when the step ubatches -- so the MoE all-to-alls stay matched. Padding rows are marked in a
persistent ``real_token_mask`` buffer and routed to no expert.

A step is *launched* (:meth:`ModelRunner.launch`): the host's work, then the forward and the sampler queued on
the device, the previous step's tokens taken from the device-resident future-token map
(``device_future_map.py``), the sampled ids scattered into it and copied to pinned host memory behind an event;
it returns a :class:`~runner.core.runner_output.PendingStep` whose ``result()`` waits for that copy. So the step loop
can launch step N+1 before it reads step N's results. With ``--emulate-device`` every step also gets a device
time on an emulated stream (``emulated_device.py``) that its read waits for.

With tracing on, the step's CPU phases (DP vote, input preparation, sampling) are spans on the rank's
``step`` track, next to the model's spans on the ubatch tracks.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from types import NotImplementedType
from typing import TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from runner.attention import make_attention_backend
from runner.attention.kv_cache import (
    allocate_kv_caches,
    attention_arrays,
    blocks_needed,
    build_attention_metadata,
    copy_from_host_,
)
from runner.attention.metadata import PagedAttentionMetadata
from runner.config import ConfigError, RunnerConfig
from runner.core.runner_output import ModelRunnerOutput, PendingStep, PromptLogprobs
from runner.core.scheduler_output import SchedulerOutput
from runner.distributed.device import torch_device
from runner.distributed.dp import DPDecision, coordinate_batch_across_dp, local_decision
from runner.models.configs import BaseMoEConfig
from runner.models.loader import load_model
from runner.worker.cuda_graphs import maybe_make_graph_runner
from runner.worker.dbo_cost_model import DBOCostModel
from runner.worker.dbo_step_timing import MeasuredDBO, make_step_timer
from runner.worker.device_future_map import DeviceFutureMap
from runner.worker.emulated_device import DeviceSpec, EmulatedDevice
from runner.worker.memory_budget import fit_kv_cache_to_memory, initial_num_kv_blocks
from runner.worker.prompt_logprobs import prompt_logprobs
from runner.worker.sampler import DRAW_COLUMNS, PendingSample, Sampler, SamplingHead, StepRows
from runner.worker.step_inputs import StagedFields, StepInputs, StepInputSizes
from ubatch import trace
from ubatch.distributed import new_ep_groups
from ubatch.forward_context import DPMetadata, set_forward_context
from ubatch.fused_tails import resolve_fused_tails
from ubatch.log_once import log_once
from ubatch.modular_moe.config import MoEParallelConfig, enable_sbo
from ubatch.modular_moe.experts import resolve_experts_backend
from ubatch.slicing import (
    CommonAttentionMetadata,
    UBatchSlice,
    balanced_split_points,
    check_ubatch_thresholds,
    padded_ubatch_slices,
    split_attn_metadata,
)
from ubatch.streams import Stream
from ubatch.wrapper import UBatchConfig, UBatchWrapper

T = TypeVar("T")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUM_UBATCHES = 2
DEFAULT_MAX_MODEL_LEN = 2048
logger = logging.getLogger("ubatch.runner")


def engine_max_model_len(max_model_len: int | None, model_config: BaseMoEConfig) -> int:
    """The context length the engine runs with: ``max_model_len`` when given, else the model's
    ``max_position_embeddings`` capped at :data:`DEFAULT_MAX_MODEL_LEN`. The front ends call it too, so that they
    size and check what the engine will run before any rank starts."""
    return max_model_len or min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def resolve_dtype(name: str) -> torch.dtype | None:
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown --dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class ModelRunner:
    """One DP rank's model runner: implements the engine core's contract
    (:class:`~runner.core.runner_protocol.ModelRunnerProtocol`), its steps launched without waiting for the
    device (module docstring)."""

    def __init__(self, cfg: RunnerConfig, rank: int = 0, world_size: int = 1) -> None:
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device = torch_device(cfg.device)  # --device: the configured device, not whatever is available
        if world_size > 1 and not dist.is_initialized():
            raise RuntimeError(f"world_size={world_size} but torch.distributed is not initialised "
                               "(launch with torchrun or --data-parallel-size)")
        self.dp_group = self._dp_group()
        parallel = self._moe_parallel_config()
        if cfg.enable_single_batch_overlap:
            enable_sbo(parallel, device=self.device)
        torch.manual_seed(cfg.seed)
        self.model, self.model_config = load_model(cfg.model, parallel, resolve_dtype(cfg.dtype), cfg.cache_dir,
                                                   self.device, quantization=cfg.quantization,
                                                   load_format=cfg.load_format, seed=cfg.seed)
        self.model.set_dbo_schedule(cfg.dbo_schedule)  # where the ubatches yield (runner/models/schedules.py)
        # --fused-tails: norms, q/k norm + RoPE and routers as Triton kernels (auto: on CUDA where Triton imports)
        self.fused_tails = resolve_fused_tails(cfg.fused_tails, self.device)
        self.model.set_fused_tails(self.fused_tails)
        if cfg.enable_dbo and not self.model.has_moe_layers:
            if rank == 0:
                logger.warning("%s has no MoE layers: --enable-dbo has nothing to overlap (DBO hides the MoE "
                               "all-to-all behind the other ubatch's compute); running without it",
                               type(self.model).__name__)
            self.cfg = cfg = cfg.replace(enable_dbo=False)
        mc = self.model_config
        self.vocab_size = mc.vocab_size
        eos = getattr(mc, "eos_token_id", None)
        self.eos_token_ids: set[int] = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.max_model_len = engine_max_model_len(cfg.max_model_len, mc)
        try:  # the default too (LLM and the CLI checked a given one): e.g. a sliding window shorter than it
            mc.check_context_length(self.max_model_len)
        except ValueError as e:
            raise ConfigError("max_model_len", str(e)) from None
        self.block_size = cfg.block_size
        # On a GPU without --num-kv-blocks a minimal cache, re-sized from free memory below
        # (runner/worker/memory_budget.py)
        self.num_kv_blocks = initial_num_kv_blocks(cfg, self.max_model_len, self.block_size, self.device)
        dtype = next(self.model.parameters()).dtype
        # One block more than the scheduler hands out: the null block that padded graph slots write to.
        self.model.bind_kv_caches(allocate_kv_caches(self.model.kv_cache_specs(), self.num_kv_blocks + 1,
                                                     self.block_size, dtype, self.device))
        self.wrapper = UBatchWrapper(self.model, UBatchConfig(NUM_UBATCHES, handoff_timeout_s=cfg.dist_timeout_s),
                                     self.device) if cfg.enable_dbo else None
        self.max_tokens_per_step = cfg.max_num_batched_tokens
        # batched, on the model's device; its draws are the fused kernel's where the fused tails run
        self.sampler = Sampler(self.vocab_size, self.device, self.eos_token_ids, fused_draw=self.fused_tails)
        # Persistent step inputs (ids, positions, mask, attention metadata, placeholder and sampling rows): one
        # device buffer written through pinned staging, one copy per step (runner/worker/step_inputs.py).
        self.inputs = StepInputs(StepInputSizes(self.max_tokens_per_step, cfg.max_num_seqs,
                                                blocks_needed(self.max_model_len, self.block_size)), self.device)
        self.input_ids = self.inputs.input_ids
        self.positions = self.inputs.positions
        self.real_token_mask = self.inputs.real_token_mask
        # each row's sampling settings (sampler.DRAW_COLUMNS), staged before a decode graph's draw heads replay
        self.draw_inputs = torch.tensor(list(DRAW_COLUMNS.values()), device=self.device).repeat(
            self.max_tokens_per_step, 1)
        self.future_tokens = DeviceFutureMap(self.device)  # placeholders resolved on the device
        self.emulated_device = EmulatedDevice(DeviceSpec.parse(cfg.emulate_device)) \
            if cfg.emulate_device is not None else None
        self.num_steps = 0
        self.num_ubatched_steps = 0
        self.num_dummy_steps = 0
        # the measured DBO cost model, fed the forward's device time (host time on CPU): worker/dbo_step_timing.py
        self.cost_model = MeasuredDBO(DBOCostModel(), make_step_timer(self.device)) \
            if cfg.enable_dbo and cfg.dbo_cost_model == "measured" else None
        # --attention-backend: builds each step's attention metadata; graph decode goes through it too
        self.attention_backend = make_attention_backend(cfg.attention_backend, self.device,
                                                        log=rank == 0)
        self.graph_capture_stream: Stream | None = None  # set by the KV budget's trial capture
        self.kv_budget = fit_kv_cache_to_memory(self)  # GPU without --num-kv-blocks: KV from --gpu-memory-utilization
        self.graph_runner = maybe_make_graph_runner(self)  # None on CPU / --enforce-eager; captures on GPU
        if self.cost_model is not None:
            self.cost_model.graph_runner = self.graph_runner  # steps are compared with steps that ran the same way

    # ---- set-up ----------------------------------------------------------------------------------
    def _dp_group(self) -> ProcessGroup | None:
        if self.world_size == 1:
            return None
        from datetime import timedelta
        # The vote is read on the CPU: a gloo group avoids a device sync even when the model runs on NCCL.
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.dist_timeout_s))

    def _moe_parallel_config(self) -> MoEParallelConfig:
        cfg = self.cfg
        capacity = cfg.max_dispatch_tokens_per_rank or cfg.max_num_batched_tokens
        # "auto" -> the backend the capture, SBO and report decisions read; the layers get "auto" itself and pick
        # per token-count bucket where a measured table names this GPU and shape (experts/auto.py)
        self.experts_backend = resolve_experts_backend(cfg.experts_backend, self.device)
        if cfg.experts_backend != self.experts_backend and self.rank == 0:
            log_once(logger, logging.INFO,
                     f"--experts-backend {cfg.experts_backend}: using {self.experts_backend} on {self.device}")
        if cfg.enable_expert_parallel and self.world_size > 1:
            groups = new_ep_groups(NUM_UBATCHES, timeout_s=cfg.dist_timeout_s)
            return MoEParallelConfig(ep_rank=self.rank, ep_size=self.world_size, all2all_backend=cfg.all2all_backend,
                                     experts_backend=cfg.experts_backend, ep_groups=groups,
                                     max_dispatch_tokens_per_rank=capacity, emulate_link=cfg.emulate_link)
        if cfg.all2all_backend != "none":
            raise ValueError(f"--all2all-backend {cfg.all2all_backend} moves tokens between expert-parallel ranks; "
                             "it needs --enable-expert-parallel and --data-parallel-size > 1 (or use 'none')")
        return MoEParallelConfig(experts_backend=cfg.experts_backend, max_dispatch_tokens_per_rank=capacity,
                                 emulate_link=cfg.emulate_link)

    # ---- one step ----------------------------------------------------------------------------------
    def _may_ubatch(self, sched: SchedulerOutput) -> bool:
        """The thresholds' vote (vLLM's gate): DBO is on and the step is large enough for its phase."""
        cfg = self.cfg
        return cfg.enable_dbo and sched.num_tokens > 0 and check_ubatch_thresholds(
            sched.num_tokens, sched.is_uniform_decode, cfg.dbo_decode_token_threshold, cfg.dbo_prefill_token_threshold)

    def _balanced_split(self, sched: SchedulerOutput) -> list[int] | None:
        """``--ubatch-split balanced``: SGLang's cut points, or None where no cut balances the step."""
        return balanced_split_points(sched.query_lens.tolist(), "decode" if sched.is_uniform_decode else "extend",
                                     threshold=self.cfg.tbo_token_distribution_threshold)

    def decide(self, sched: SchedulerOutput) -> tuple[DPDecision, list[int] | int | None]:
        """This step's DBO decision, taken before any input is built. With one rank the DBO-only work -- the cost
        model's vote, a balanced split -- is done only where the step could still ubatch, so a step with DBO
        decided off costs what a step without ``--enable-dbo`` costs; DP ranks fill every row of the vote table,
        since the largest rank's cost-model vote decides for all (``runner/distributed/dp.py``)."""
        with trace.region("dp_vote", "step", track="step"):
            n = sched.num_tokens
            prefill = not sched.is_uniform_decode
            rule = self.cfg.dbo_dp_rule
            vote = self._may_ubatch(sched)
            alone = self.dp_group is None
            pays = self.cost_model is None or n == 0 or (alone and not vote) or self.cost_model.vote(n, prefill)
            split_point: list[int] | None = None
            if vote and (pays or not alone) and self.cfg.ubatch_split == "balanced":
                split_point = self._balanced_split(sched)
                vote = split_point is not None
            split = split_point[0] if split_point is not None else 0
            if alone:
                return local_decision(n, vote, NUM_UBATCHES, is_prefill=prefill, split=split, pays=pays,
                                      rule=rule), split_point
            return coordinate_batch_across_dp(n, vote, self.dp_group, NUM_UBATCHES, is_prefill=prefill,
                                              split=split, pays=pays, rule=rule), split_point

    @property
    def num_placeholders_resolved(self) -> int:
        return self.future_tokens.num_resolved

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch ``sched`` and wait (at most ``--dist-timeout-s``) for its output: the synchronous loop."""
        pending = self.launch(sched)
        return None if pending is None else pending.result(self.cfg.dist_timeout_s)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingStep | None:
        """Queue one step without waiting for the device (module docstring); None when no DP rank had work."""
        decision, split_point = self.decide(sched)
        if not decision.any_work:
            return None
        self.num_steps += 1
        if sched.num_tokens == 0:
            self._dummy_step(decision)
            return self._pending(sched, None, None)
        hidden, _ = self._forward(sched, decision, split_point)
        if self.cost_model is not None:
            self.cost_model.stop(sched.num_tokens, not sched.is_uniform_decode, decision.should_ubatch)
        with trace.region("sample", "step", track="step"):
            sampling = self._launch_sampling(sched, hidden)
            # read at launch, and only on a step whose requests ask for prompt logprobs (rare: scoring requests)
            prompt_lps = prompt_logprobs(sched, hidden, self.model.compute_logits)
        return self._pending(sched, sampling, prompt_lps)

    def _pending(self, sched: SchedulerOutput, sampling: tuple[StepRows, PendingSample] | None,
                 prompt_lps: list[PromptLogprobs | None] | None) -> PendingStep:
        """The launched step's pending output: its emulated device time (if any) queued now, read later."""
        deadline = None if self.emulated_device is None else self.emulated_device.launch(sched.num_tokens)
        n = sched.num_reqs

        def read(timeout_s: float | None) -> ModelRunnerOutput:
            if deadline is not None:
                EmulatedDevice.wait(deadline, timeout_s)
            if sampling is None:
                return ModelRunnerOutput([None] * n, None, prompt_lps)
            step, pending = sampling
            result = pending.result(timeout_s)
            if step.picks is None:
                return ModelRunnerOutput(cast("list[int | None]", result.token_ids), result.logprobs, prompt_lps)
            return ModelRunnerOutput(_scatter(result.token_ids, step.picks, n),
                                     None if result.logprobs is None else result.logprobs.scattered(step.picks, n),
                                     prompt_lps)

        return PendingStep(read)

    def _forward(self, sched: SchedulerOutput, decision: DPDecision,
                 split_point: list[int] | int | None) -> tuple[torch.Tensor, CommonAttentionMetadata]:
        with trace.region("inputs", "step", track="step"):
            n = sched.num_tokens
            padded = decision.num_tokens_padded if self.graph_runner is None else \
                self.graph_runner.padded_num_tokens(n, sched.is_uniform_decode, decision)
            if padded > self.max_tokens_per_step:
                raise ValueError(f"step of {padded} tokens exceeds --max-num-batched-tokens={self.max_tokens_per_step}")
            # Written on the host from the step's arrays and the scheduler's persistent block table (vectorised,
            # no per-request Python) into the persistent staging buffer, copied with one non-blocking copy: the
            # overlap loop prepares this step while the previous forward may still run, and nothing here waits.
            meta, placeholders, mask = self._stage_inputs(sched, padded)
            with trace.region("resolve", "step", track="step"):  # the previous step's tokens, on the device
                if placeholders:
                    prefix = self.inputs.prefix
                    self.future_tokens.gather_(prefix("input_ids", n), prefix("placeholder_at", placeholders),
                                               prefix("placeholder_slot", placeholders))
            slices = None
            if decision.should_ubatch:
                slices = padded_ubatch_slices(sched.query_lens, padded, NUM_UBATCHES, split_point)
        model = self.wrapper if slices is not None and self.wrapper is not None else self.model
        dp_metadata = self._dp_metadata(decision, n)
        if self.cost_model is not None:  # the forward's device work starts here: the inputs are built
            self.cost_model.start(n, not sched.is_uniform_decode, decision.should_ubatch)
        hidden: torch.Tensor | NotImplementedType = NotImplemented
        input_ids, positions = self.inputs.prefix("input_ids", padded), self.inputs.prefix("positions", padded)
        if self.graph_runner is not None:
            with set_forward_context(attn_metadata=meta, ubatch_slices=slices, trace_rank=self.rank,
                                     dp_metadata=dp_metadata, real_token_mask=mask):
                hidden = self.graph_runner.try_replay(meta, slices, input_ids, positions)
        if hidden is NotImplemented:
            with trace.region("inputs", "step", track="step"):
                attn_metadata = self._attention_metadata(meta, slices)
            with set_forward_context(attn_metadata=attn_metadata, ubatch_slices=slices, trace_rank=self.rank,
                                     dp_metadata=dp_metadata, real_token_mask=mask):
                hidden = model(input_ids=input_ids, positions=positions)
        if slices is not None:
            self.num_ubatched_steps += 1
        return hidden, meta

    def _attention_metadata(self, common: CommonAttentionMetadata,
                            slices: list[UBatchSlice] | None) -> PagedAttentionMetadata | list[PagedAttentionMetadata]:
        """The attention backend's metadata for an eager step: built here, before the forward, once for the
        step or once per ubatch (the UBatchWrapper takes the list as already split), so no layer syncs."""
        if slices is None:
            return self.attention_backend.build_metadata(common)
        return [self.attention_backend.build_metadata(m) for m in split_attn_metadata(slices, common)]

    def _stage_inputs(self, sched: SchedulerOutput, padded: int
                      ) -> tuple[CommonAttentionMetadata, int, torch.Tensor | None]:
        """Write the step's inputs into the persistent staging buffer and queue their copy (``step_inputs.py``):
        ids (placeholders claimed here, gathered on the device after the copy), positions, attention metadata,
        the real-token mask and the sampling rows. Returns the step's attention metadata (device views), its
        number of placeholders and the mask's view (None: no padding and no captured graph that reads it)."""
        n, num_reqs = sched.num_tokens, sched.num_reqs
        limits = self.inputs.sizes
        if num_reqs > limits.max_reqs:
            raise ValueError(f"a step of {num_reqs} requests exceeds the {limits.max_reqs} the step inputs hold "
                             "(--max-num-seqs)")
        host = self.inputs.stage()

        def buffers(r: int, width: int, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            if width > limits.max_blocks:
                raise ValueError(f"a request of the step holds {width} KV blocks, more than the "
                                 f"{limits.max_blocks} of --max-model-len={self.max_model_len}")
            return (host.query_start_loc[:r + 1], host.seq_lens[:r], host.block_table[:r * width].reshape(r, width),
                    host.slot_mapping[:t], host.positions[:t])

        a = attention_arrays(sched.num_computed, sched.query_lens, sched.blocks, self.block_size,
                             num_padded_tokens=padded, buffers=buffers)
        width = a.block_table.shape[1]
        ids = host.input_ids
        ids[:n] = sched.token_ids
        ids[n:padded] = 0
        found = self.future_tokens.claim(sched)
        placeholders = 0
        if found is not None:
            where, named = found
            placeholders = len(where)
            host.placeholder_at[:placeholders] = where
            host.placeholder_slot[:placeholders] = named
        use_mask = n != padded or self.graph_runner is not None
        if use_mask:
            host.real_token_mask[:n] = True
            host.real_token_mask[n:padded] = False
        self._stage_sampling(host, sched, a.query_start_loc)
        self.inputs.upload(num_reqs * width)
        prefix = self.inputs.prefix
        meta = CommonAttentionMetadata(
            query_start_loc=prefix("query_start_loc", num_reqs + 1),
            query_start_loc_cpu=torch.from_numpy(a.query_start_loc.copy()),
            seq_lens=prefix("seq_lens", num_reqs), seq_lens_cpu=torch.from_numpy(a.seq_lens.copy()),
            num_reqs=num_reqs, num_actual_tokens=a.num_actual_tokens, max_query_len=a.max_query_len,
            max_seq_len=a.max_seq_len, block_table=prefix("block_table", num_reqs, width),
            slot_mapping=prefix("slot_mapping", padded), positions=prefix("positions", padded), causal=True)
        return meta, placeholders, prefix("real_token_mask", padded) if use_mask else None

    @staticmethod
    def _stage_sampling(host: StagedFields, sched: SchedulerOutput, qsl: np.ndarray) -> None:
        """The rows that sample (as ``Sampler.prepare`` picks them: every request, or those whose chunk reaches
        the end of its known tokens): their last token's hidden row and their future-map slot."""
        if sched.num_reqs and sched.sample.all():
            m = sched.num_reqs
            host.sample_slots[:m] = sched.slots
            if sched.num_tokens != m:
                np.subtract(qsl[1:], 1, out=host.sample_rows[:m], casting="unsafe")
            return
        picks = np.flatnonzero(sched.sample)
        m = len(picks)
        host.sample_slots[:m] = sched.slots[picks]
        host.sample_rows[:m] = qsl[picks + 1] - 1

    def _dp_metadata(self, decision: DPDecision, num_real_tokens: int) -> DPMetadata:
        """What the DP vote agreed (same on every rank): torch_ll sizes each ubatch's buffers by its bound.

        Under CUDA graphs no bound is given: captured all-to-alls keep the fixed capacity, and an eager step
        must use the same sizes as a peer rank that replays a graph.
        """
        sized = self.graph_runner is None
        return DPMetadata(decision.num_tokens_across_dp,
                          step_token_bound=decision.max_tokens_padded if sized else None,
                          ubatch_token_bounds=decision.ubatch_token_bounds if sized else None,
                          num_real_tokens=num_real_tokens, any_prefill=decision.any_prefill)

    def _dummy_step(self, decision: DPDecision) -> None:
        """Padding rows, no request: keeps this idle rank's all-to-alls matched with busy peers.

        One row, or one row per ubatch when the step ubatches (SGLang's rule lets an idle rank take part);
        the rows are routed to no expert, so they send nothing.
        """
        self.num_dummy_steps += 1
        rows = NUM_UBATCHES if decision.should_ubatch else 1
        meta = build_attention_metadata([], [], [], self.block_size, self.device, num_padded_tokens=rows)
        slices = padded_ubatch_slices([], rows, NUM_UBATCHES) if decision.should_ubatch else None
        model = self.wrapper if slices is not None else self.model
        if model is None:
            raise RuntimeError("the DP ranks agreed to ubatch but this rank has no UBatchWrapper: every rank "
                               "must run with the same --enable-dbo")
        self.real_token_mask[:rows].fill_(False)
        with set_forward_context(attn_metadata=self._attention_metadata(meta, slices), ubatch_slices=slices,
                                 trace_rank=self.rank,
                                 dp_metadata=self._dp_metadata(decision, 0),
                                 real_token_mask=self.real_token_mask[:rows]):
            model(input_ids=self.input_ids[:rows].zero_(), positions=self.positions[:rows].zero_())

    def _launch_sampling(self, sched: SchedulerOutput,
                         hidden: torch.Tensor) -> tuple[StepRows, PendingSample] | None:
        """Sample one token per request whose chunk reached the end of its known tokens, on the device; store
        them in the future-token map and start their copy to the host. None when no request samples.

        Read from the step's arrays (``Sampler.prepare``): the settings of requests new to their slot are
        written, the inputs of requests with penalties recorded first -- the penalty counts are kept here, on
        the forward side, from the input ids resolved on the device (``runner/worker/penalties.py``), so they
        are exact when the step was launched before its predecessor's tokens reached the host. A step of
        decodes only samples every row of ``hidden`` as it is; where its graph replayed and the rows' settings
        let one of the graph's heads sample them (``StepRows.sampling_head``: every row greedy with no other
        option; or greedy or drawing with a temperature, maybe top-k and top-p), that head does, in one more graph
        launch."""
        n = sched.num_reqs
        step = self.sampler.prepare(sched, self.inputs.prefix("input_ids", sched.num_tokens))
        if not len(step):
            return None
        m = len(step)
        decodes = step.picks is None and sched.num_tokens == n  # one token per request, all sampling
        graphs = self.graph_runner
        head = step.sampling_head if decodes else None
        if head is not None and graphs is not None and graphs.head_ready(head.value):
            if head is not SamplingHead.GREEDY:
                copy_from_host_(self.draw_inputs[:n], torch.from_numpy(self.sampler.draw_inputs(step)))
            sampled = graphs.replay_head(head.value)[:n]
            pending = self.sampler.launch_read(sampled)
        else:
            # a decode step's rows as they are, or the last tokens' rows staged with the inputs (_stage_sampling);
            # greedy rows take the argmax of the model's dtype (the same as of a float32 copy)
            last = hidden[:n] if decodes else hidden.index_select(0, self.inputs.prefix("sample_rows", m))
            sampled, pending = self.sampler.launch_step(self.model.compute_logits(last, upcast=not step.only_greedy),
                                                        step)
        self.future_tokens.store_(sched.req_ids if step.picks is None else sched.req_ids[step.picks], step.slots,
                                  sampled, self.inputs.prefix("sample_slots", m))
        return step, pending

    def link_times(self) -> tuple[float, float] | None:
        """The emulated all-to-all link's (seconds in flight, seconds waited for) so far; None without one."""
        return self.model.moe_runtime.link_times()

    def close(self) -> None:
        self.sampler.close()
        if self.graph_runner is not None:
            self.graph_runner.clear()
        if self.wrapper is not None:
            self.wrapper.close()


def _scatter(values: Sequence[T | None], picks: np.ndarray, n: int) -> list[T | None]:
    """A list of ``n`` with ``values[j]`` at ``picks[j]`` and None elsewhere (numpy, no Python per request)."""
    out = np.full(n, None, dtype=object)
    out[picks] = values
    return out.tolist()
