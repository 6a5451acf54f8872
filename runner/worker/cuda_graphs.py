"""The engine's CUDA-graph wiring: builds a ``cudagraph.GraphRunner`` for a ModelRunner.

``cudagraph`` knows nothing of the engine; this module hands it the engine's capturable decode attention
(``runner.attention.graph``, through the runner's attention backend), the graphs' heads (the LM head with the
greedy pick, :func:`greedy_sampling_head`, and with the draw, :func:`draw_sampling_head`, after top-k and top-p
as the head's kind asks) and the KV block reserved for graph padding. That block is the extra one the ModelRunner
allocates past the scheduler's range (``num_kv_blocks + 1`` blocks, ids ``0 .. num_kv_blocks``), so padded graph
rows write their KV where no request ever reads.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch.distributed import ProcessGroup

from cudagraph.backends import GraphBackend
from cudagraph.dispatch import GraphKey, capture_blocker, plan_captures
from cudagraph.manager import CaptureAgreement, GraphHead, GraphRunner
from cudagraph.sizes import resolve_capture_sizes
from runner.attention.backend import AttentionBackend
from runner.attention.graph import DecodeMetadataBuffers, capturable_attention
from runner.config import RunnerConfig
from runner.models.base import MoECausalLM
from runner.models.configs import BaseMoEConfig
from runner.worker.fused_draw import fused_draw
from runner.worker.sampler import DRAW_COLUMNS, Sampler, SamplingHead, greedy_rows
from runner.worker.sampling_noise import INVALID_TOKEN, draw_by_inverse_cdf_
from runner.worker.sampling_ops import (
    TOP_K_WIDTH,
    apply_temperature_,
    apply_top_k_where_,
    apply_top_p_,
    max_and_greedy,
    top_k_cut,
)
from ubatch.log_once import log_once
from ubatch.streams import Stream
from ubatch.wrapper import UBatchWrapper

logger = logging.getLogger("ubatch.cudagraph")


class CapturingRunner(Protocol):
    """What the graph wiring and the KV-cache budget (``runner/worker/memory_budget.py``) read of the model
    runner while it is being set up, and the two fields they set (the cache size, the capture stream)."""

    num_kv_blocks: int
    graph_capture_stream: Stream | None

    @property
    def cfg(self) -> RunnerConfig: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model(self) -> MoECausalLM: ...

    @property
    def model_config(self) -> BaseMoEConfig: ...

    @property
    def wrapper(self) -> UBatchWrapper | None: ...

    @property
    def attention_backend(self) -> AttentionBackend: ...

    @property
    def experts_backend(self) -> str:
        """The resolved experts backend ("auto" resolved)."""

    @property
    def dp_group(self) -> ProcessGroup | None:
        """The gloo group of the DP ranks' votes (None with one rank)."""

    # the persistent step inputs the graphs read
    @property
    def input_ids(self) -> torch.Tensor: ...

    @property
    def positions(self) -> torch.Tensor: ...

    @property
    def real_token_mask(self) -> torch.Tensor: ...

    @property
    def draw_inputs(self) -> torch.Tensor:
        """``[max_tokens, 4]`` float32: each row's ``sampler.DRAW_COLUMNS``, staged before a draw head replays."""

    @property
    def sampler(self) -> Sampler:
        """The rank's sampler, whose ``fused_draw`` the heads follow."""


class _Default(enum.Enum):
    """The ``wrapper`` argument's default: the model runner's own UBatchWrapper (None is a value: no DBO)."""

    RUNNERS_WRAPPER = enum.auto()


_RUNNERS_WRAPPER = _Default.RUNNERS_WRAPPER


def capture_agreement(dp_group: ProcessGroup | None) -> CaptureAgreement | None:
    """How DP ranks agree which graph sizes to keep: one all-reduce of "this rank failed" per size over the
    runner's gloo DP group (as the step vote in ``runner/distributed/dp.py``); ``None`` with one rank."""
    if dp_group is None:
        return None

    def agree(captured: bool) -> bool:
        failures = torch.tensor([0 if captured else 1], dtype=torch.int64)
        try:
            dp_group.allreduce([failures]).wait()
        except RuntimeError as exc:
            raise RuntimeError(f"DP rank {dp_group.rank()}: the vote on which CUDA graph sizes every rank captured "
                               f"failed; a peer rank probably exited or timed out ({exc})") from exc
        return int(failures[0]) == 0

    return agree


def planned_keys(model_runner: CapturingRunner, sizes: Sequence[int] | str | None = None,
                 wrapper: UBatchWrapper | None | _Default = _RUNNERS_WRAPPER) -> list[GraphKey]:
    """The graphs ``make_graph_runner(model_runner, sizes=..., wrapper=...)`` captures by default (the KV
    budget's trial capture needs the largest): with the measured DBO cost model, a plain and a DBO graph at
    every size that may ubatch, so each choice it makes replays."""
    cfg = model_runner.cfg
    requested = sizes if sizes is not None else cfg.cuda_graph_sizes
    resolved = resolve_capture_sizes(requested, cfg.max_num_seqs, model_runner.input_ids.shape[0])
    wrapper = model_runner.wrapper if wrapper is _RUNNERS_WRAPPER else wrapper
    return plan_captures(resolved, dbo_enabled=wrapper is not None, decode_threshold=cfg.dbo_decode_token_threshold,
                         num_ubatches=wrapper.config.num_ubatches if wrapper is not None else 2,
                         both_kinds=wrapper is not None and cfg.dbo_cost_model == "measured")


def greedy_sampling_head(model: MoECausalLM) -> GraphHead:
    """A head captured after every decode graph: the LM head and each row's greedy token (``INVALID_TOKEN``
    where its logits are not finite), what the sampler computes for a step whose rows are all greedy with no
    other option (``StepRows.only_greedy``). Such a step's sampling is then one graph launch, not the LM head's
    and the argmax's kernels launched one by one."""

    def head(hidden: torch.Tensor) -> torch.Tensor:
        return greedy_rows(model.compute_logits(hidden, upcast=False))

    return head


def draw_sampling_head(compute_logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                       draw_inputs: torch.Tensor, kind: SamplingHead = SamplingHead.DRAW,
                       fused: bool = False) -> GraphHead:
    """The head of ``kind`` (``SamplingHead.DRAW``, ``TOP_K`` or ``TOP_P``) for a step of greedy rows and rows that
    draw: the LM head in float32 (``compute_logits``: the model's, or a benchmark's), each row's argmax, and each
    row's draw from its logits over its temperature (for ``TOP_K`` after its top-k and top-p, of ``TOP_K_WIDTH``
    gathered logits as the eager sampler's for such a step; for ``TOP_P`` after its top-p over its sorted row) by
    its uniform, all staged in ``draw_inputs`` (``Sampler.draw_inputs``); a negative uniform takes the argmax. The
    same operations as the eager sampler, on every row (a top-k of 0, a top-p floor of -1 leave a row as it is), so
    each row's token is the sampler's.

    ``fused`` (the sampler's ``fused_draw``): the draw is the fused kernels', as the sampler's then is; for
    ``DRAW`` and ``TOP_K`` they also divide by the temperature and drop what top-k's threshold drops, so the row
    is read, not rewritten: the threshold comes from the gathered logits, divided
    (:func:`~runner.worker.sampling_ops.top_k_threshold_of`); every fused head takes the draw's peak from the
    argmax's maximum, divided."""
    if kind not in (SamplingHead.DRAW, SamplingHead.TOP_K, SamplingHead.TOP_P):
        raise ValueError(f"draw_sampling_head: {kind} is not a head that draws")
    columns = {name: draw_inputs[:, i] for i, name in enumerate(DRAW_COLUMNS)}
    width = min(TOP_K_WIDTH, vocab_size)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        logits = compute_logits(hidden)
        temperature, uniform = columns["temperature"][:n], columns["uniform"][:n]
        if fused:
            best, greedy = max_and_greedy(logits, INVALID_TOKEN)  # the argmax, as greedy_rows', and the peak
            peak = best / temperature  # the most likely token survives top-k and top-p
            if kind is SamplingHead.TOP_P:  # the row sorted: divided and cut by torch ops first
                x = apply_top_p_(apply_temperature_(logits, temperature), columns["top_p_floor"][:n])
                drawn = fused_draw(x, uniform, peak=peak)
            else:
                # top-k's cut over logits / temperature, from the gathered logits divided (top_k_threshold_of)
                cut = (top_k_cut(logits.topk(width, dim=-1).values.div_(temperature.unsqueeze(1)),
                                 columns["top_k"][:n].long(), columns["top_p_floor"][:n]).squeeze(1)
                       if kind is SamplingHead.TOP_K else None)
                drawn = fused_draw(logits, uniform, temperature, cut, peak=peak)
        else:
            greedy = greedy_rows(logits)
            x = apply_temperature_(logits, temperature)
            if kind is SamplingHead.TOP_K:
                apply_top_k_where_(x, columns["top_k"][:n].long(), width, columns["top_p_floor"][:n])
            elif kind is SamplingHead.TOP_P:
                apply_top_p_(x, columns["top_p_floor"][:n])
            drawn = draw_by_inverse_cdf_(x, uniform)
        return torch.where(uniform >= 0, drawn, greedy)

    return head


def sampling_heads(model_runner: CapturingRunner) -> dict[str, GraphHead]:
    """The heads captured after every decode graph, by :class:`SamplingHead` value, greedy first."""
    model, inputs = model_runner.model, model_runner.draw_inputs
    return {SamplingHead.GREEDY.value: greedy_sampling_head(model),
            **{kind.value: draw_sampling_head(model.compute_logits, model.config.vocab_size, inputs, kind,
                                              model_runner.sampler.fused_draw)
               for kind in (SamplingHead.DRAW, SamplingHead.TOP_K, SamplingHead.TOP_P)}}


def make_graph_runner(model_runner: CapturingRunner, *, sizes: Sequence[int] | str | None = None,
                      backend: GraphBackend | None = None, num_warmups: int = 2, progress: bool | None = None,
                      wrapper: UBatchWrapper | None | _Default = _RUNNERS_WRAPPER,
                      keys: Sequence[GraphKey] | None = None) -> GraphRunner:
    """A :class:`GraphRunner` over ``model_runner``'s model and persistent input buffers (not yet captured).

    ``wrapper`` defaults to the runner's own UBatchWrapper (``None`` plans no DBO graphs); ``keys``
    overrides the capture plan (benchmarks compare hand-picked graphs).
    """
    cfg = model_runner.cfg
    wrapper = model_runner.wrapper if wrapper is _RUNNERS_WRAPPER else wrapper
    keys = list(keys) if keys is not None else planned_keys(model_runner, sizes, wrapper)
    max_blocks = -(-model_runner.max_model_len // model_runner.block_size)
    null_block = model_runner.num_kv_blocks  # the runner allocated one block past the scheduler's range

    def buffers(max_reqs: int) -> DecodeMetadataBuffers:
        return DecodeMetadataBuffers(max_reqs, max_blocks, model_runner.block_size, null_block, model_runner.device,
                                     backend=model_runner.attention_backend)

    return GraphRunner(model_runner.model, model_runner.input_ids, model_runner.positions,
                       metadata_buffers=buffers, capturable_attention=capturable_attention,
                       sizes=sorted({k.num_tokens for k in keys}), wrapper=wrapper, keys=keys,
                       dbo_decode_threshold=cfg.dbo_decode_token_threshold, backend=backend,
                       num_warmups=num_warmups, real_token_mask=model_runner.real_token_mask,
                       agree=capture_agreement(model_runner.dp_group),
                       # one capture stream per runner for the life of the process, trial capture included
                       capture_stream=model_runner.graph_capture_stream,
                       heads=sampling_heads(model_runner),
                       progress=(model_runner.rank == 0) if progress is None else progress)


def graphs_enabled(model_runner: CapturingRunner, backend: GraphBackend | None = None) -> bool:
    """Whether the runner captures graphs: not with ``--enforce-eager``, on CPU (logged once: "CUDA graphs need
    a GPU: running eager") unless a ``backend`` is given explicitly, or with uncapturable backends (logged once)."""
    cfg = model_runner.cfg
    if cfg.enforce_eager:
        return False
    if backend is None and torch.device(model_runner.device).type != "cuda":
        if model_runner.rank == 0:  # said once for the whole run, not once per DP rank
            log_once(logger, logging.WARNING, "CUDA graphs need a GPU: running eager")
        return False
    # the runner's resolved experts backend ("auto" names none)
    blocker = capture_blocker(cfg.all2all_backend, model_runner.experts_backend)
    if blocker is not None:
        log_once(logger, logging.WARNING, f"CUDA graphs disabled: {blocker}; running eager")
        return False
    return True


def maybe_make_graph_runner(model_runner: CapturingRunner, *, capture: bool = True,
                            backend: GraphBackend | None = None) -> GraphRunner | None:
    """The runner's one entry point: a captured :class:`GraphRunner`, or ``None`` to run eager.

    ``None`` with ``--enforce-eager``, on CPU (logged once: "CUDA graphs need a GPU: running eager"), and
    with backends that cannot be captured (logged once, with the reason). Sizes that run out of memory while
    capturing are dropped with a warning (``GraphRunner.capture``). ``backend``: what to capture with,
    default CUDA graphs on a GPU; a test passes the eager stand-in explicitly to run this path on CPU.
    """
    if not graphs_enabled(model_runner, backend):
        return None
    graph_runner = make_graph_runner(model_runner, backend=backend)
    if capture:
        graph_runner.capture()
    return graph_runner
