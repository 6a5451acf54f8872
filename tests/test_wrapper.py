"""UBatchWrapper as a library user sees it: argument slicing, output merging, forward context, streams."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ubatch import (
    UBatchConfig,
    UBatchSlice,
    UBatchWrapper,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_switch_to_comm,
    dbo_switch_to_compute,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    get_forward_context,
    set_forward_context,
    streams,
)
from ubatch.context import DBOError, current_ubatch_context
from ubatch.wrapper import merge_ubatch_outputs


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, scale: float = 1.0,
                table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(torch.nn.functional.one_hot(input_ids, 4).float()) * scale
        dbo_yield()
        assert table is not None
        return h + positions[:, None], table.sum().expand(input_ids.shape[0])


def slices(bounds: list[int]) -> list[UBatchSlice]:
    return [UBatchSlice(slice(a, b), slice(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]  # neighbours


def test_ubatched_equals_plain_call_and_passes_other_args_unchanged() -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    ids = torch.tensor([0, 1, 2, 3, 1, 0, 2])
    pos = torch.arange(7)
    table = torch.ones(3, 5)  # first dim differs from the token count: never sliced
    ref = model(ids, pos, scale=2.0, table=table)
    w = UBatchWrapper(model)
    with set_forward_context(ubatch_slices=slices([0, 3, 7])):
        out = w(input_ids=ids, positions=pos, scale=2.0, table=table)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)
    assert w.num_ubatched_steps == 1
    w.close()


def test_without_slices_the_runnable_is_called_directly() -> None:
    seen: list[bool] = []

    def record_dbo(x: torch.Tensor) -> torch.Tensor:
        seen.append(dbo_enabled())
        return x

    w = UBatchWrapper(record_dbo)
    x = torch.zeros(3)
    assert w(x) is x
    with set_forward_context(attn_metadata=None):
        assert w(x) is x
    assert seen == [False, False] and w.num_ubatched_steps == 0
    w.close()


def test_getattr_delegates_to_the_runnable() -> None:
    model = TwoHeads()
    w = UBatchWrapper(model)
    assert w.proj is model.proj and w.unwrap() is model
    with pytest.raises(AttributeError):
        _ = w.no_such_attribute
    w.close()


def test_each_ubatch_sees_its_own_forward_context() -> None:
    seen = {}

    def model(x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        seen[dbo_current_ubatch_id()] = (ctx.ubatch_id, ctx.ubatch_slice, ctx.attn_metadata, ctx.trace_rank)
        dbo_yield()
        assert get_forward_context() is ctx  # unchanged after the other ubatch ran
        return x

    w = UBatchWrapper(model, UBatchConfig(num_ubatches=3))
    sl = slices([0, 2, 4, 6])
    with set_forward_context(attn_metadata=["m0", "m1", "m2"], ubatch_slices=sl, trace_rank=7) as outer:
        w(torch.zeros(6))
        assert get_forward_context() is outer
    assert seen == {i: (i, sl[i], f"m{i}", 7) for i in range(3)}  # step-level fields are inherited
    w.close()


def test_stream_switching_is_tracked_on_cpu() -> None:
    w = UBatchWrapper(lambda x: x, device="cpu")  # the CPU's stream bookkeeping, also on a machine with a GPU
    log = []

    def model(x: torch.Tensor) -> torch.Tensor:
        ctx = current_ubatch_context()
        assert ctx is not None
        assert streams.current_stream("cpu") is ctx.compute_stream
        dbo_yield_and_switch_from_compute_to_comm()
        log.append(streams.current_stream("cpu") is w.comm_stream)
        dbo_yield_and_switch_from_comm_to_compute()
        log.append(streams.current_stream("cpu") is ctx.compute_stream)
        dbo_switch_to_comm()
        with pytest.raises(DBOError, match="expected the compute stream"):
            dbo_yield_and_switch_from_compute_to_comm()
        dbo_switch_to_compute()
        return x

    w.runnable = model
    with set_forward_context(ubatch_slices=slices([0, 2, 4])):
        w(torch.zeros(4))
    assert log == [True, True, True, True]
    w.close()


def test_merge_outputs_rejects_unmergeable_types() -> None:
    assert merge_ubatch_outputs([None, None]) is None
    with pytest.raises(TypeError, match="cannot merge ubatch outputs of type dict"):
        merge_ubatch_outputs([{}, {}])


def test_slice_count_must_match_config() -> None:
    w = UBatchWrapper(lambda x: x)
    with (
        set_forward_context(ubatch_slices=slices([0, 1, 2, 3])),
        pytest.raises(ValueError, match="3 ubatch slices but the wrapper runs 2"),
    ):
        w(torch.zeros(3))
    w.close()


@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_caller_autograd_mode_reaches_the_ubatches(mode: str) -> None:
    lin = nn.Linear(4, 4)
    seen = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return lin(x)

    w = UBatchWrapper(model)
    ctx = {"inference": torch.inference_mode(), "no_grad": torch.no_grad(), "grad": torch.enable_grad()}[mode]
    with ctx, set_forward_context(ubatch_slices=slices([0, 2, 4])):
        out = w(torch.ones(4, 4))
    expected = {"inference": (True, False), "no_grad": (False, False), "grad": (False, True)}[mode]
    assert seen == [expected, expected]
    assert out.requires_grad == (mode == "grad")
    w.close()


@pytest.mark.parametrize("executor", ["greenlet", "threads"])
@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_the_autograd_mode_holds_after_the_last_yield_when_the_other_ubatch_has_finished(mode: str,
                                                                                        executor: str) -> None:
    """Ubatch 1 runs its part after the last yield once ubatch 0 has returned: on the greenlet executor both
    share a thread, whose autograd mode is thread-local, so ubatch 0 leaving its mode must not end ubatch 1's."""
    seen: list[tuple[int | None, bool, bool]] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        dbo_yield()
        seen.append((dbo_current_ubatch_id(), torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return x * 2

    w = UBatchWrapper(model, UBatchConfig(2, executor=executor))
    ctx = {"inference": torch.inference_mode(), "no_grad": torch.no_grad(), "grad": torch.enable_grad()}[mode]
    with ctx, set_forward_context(ubatch_slices=slices([0, 2, 4])):
        w(torch.ones(4, 4))
    expected = {"inference": (True, False), "no_grad": (False, False), "grad": (False, True)}[mode]
    assert seen == [(0, *expected), (1, *expected)]
    w.close()


# ---- issue: slices that do not match the input, use after close, stuck workers ----------------------------
def _identity(x: torch.Tensor) -> torch.Tensor:
    dbo_yield()
    return x


@pytest.mark.parametrize("bounds, message", [
    ([(0, 4), (4, 8)], "cover 8 tokens but no tensor argument has 8 rows"),  # padded slices, unpadded input
    ([(0, 3), (4, 7)], "starts at token 4 but the previous one ends at 3: a gap would drop"),
    ([(0, 4), (3, 7)], "starts at token 3 but the previous one ends at 4: an overlap would duplicate"),
    ([(1, 4), (4, 7)], "ubatch slice 0 starts at token 1 but the previous one ends at 0"),
])
def test_slices_that_do_not_partition_the_input_raise(bounds: list[tuple[int, int]], message: str) -> None:
    w = UBatchWrapper(_identity)
    bad = [UBatchSlice(slice(a, b), slice(a, b)) for a, b in bounds]
    try:
        with set_forward_context(ubatch_slices=bad), pytest.raises(ValueError, match=message):
            w(torch.arange(7))
        assert w.num_ubatched_steps == 0
        with set_forward_context(ubatch_slices=slices([0, 3, 7])):  # the wrapper still works afterwards
            assert torch.equal(w(torch.arange(7)), torch.arange(7))
    finally:
        w.close()


@pytest.mark.parametrize("executor", ["greenlet", "threads"])
def test_a_closed_wrapper_raises_at_once(executor: str) -> None:
    from ubatch.wrapper import WrapperClosedError

    w = UBatchWrapper(_identity, UBatchConfig(executor=executor, handoff_timeout_s=1.0))
    w.close()
    w.close()  # idempotent
    with set_forward_context(ubatch_slices=slices([0, 3, 7])), pytest.raises(WrapperClosedError, match="was closed"):
        w(torch.arange(7))
    with pytest.raises(WrapperClosedError):
        w(torch.arange(7))


def test_stuck_workers_are_bounded_and_reported_at_close() -> None:
    import threading

    from ubatch.context import DBOTimeoutError
    from ubatch.wrapper import StuckWorkersError

    release = threading.Event()

    def hangs(x: torch.Tensor) -> torch.Tensor:
        if dbo_current_ubatch_id() == 0:
            release.wait(30)  # stands for a collective whose peer died
        dbo_yield()
        return x

    w = UBatchWrapper(hangs, UBatchConfig(handoff_timeout_s=0.2, max_stuck_workers=1))
    threads_before = threading.active_count()
    try:
        for _ in range(2):
            with set_forward_context(ubatch_slices=slices([0, 3, 7])), pytest.raises(DBOTimeoutError):
                w(torch.arange(7))
        assert len(w._pool.stuck) == 2
        with set_forward_context(ubatch_slices=slices([0, 3, 7])), \
                pytest.raises(StuckWorkersError, match="2 ubatch workers .* max_stuck_workers=1"):
            w(torch.arange(7))
        assert threading.active_count() == threads_before + 2  # refused: no third thread was abandoned
        with pytest.warns(RuntimeWarning, match="still stuck in model code"):
            w.close()
    finally:
        release.set()
