"""The model runner's persistent step inputs (``runner/worker/step_inputs.py``): metadata written into reused,
dirty staging buffers equals the metadata built from fresh arrays, the fields never overlap, and a runner's steps
read their inputs through views that keep their addresses."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from runner.attention.kv_cache import BlockRows, BlockTable, attention_arrays, build_attention_metadata
from runner.worker.step_inputs import StagedFields, StepInputs, StepInputSizes

BS = 4


def random_batch(rng: random.Random, table: BlockTable) -> tuple[np.ndarray, np.ndarray, BlockRows]:
    """Decode, prefill and chunked-prefill requests over rows of ``table``; some hold more blocks than they need
    (the scheduler appended blocks for a later step)."""
    n = rng.randint(1, 12)
    rows = np.array(rng.sample(range(table.table.shape[0]), n), dtype=np.int64)
    ctx = np.array([rng.choice([0, rng.randint(1, 20)]) for _ in range(n)], dtype=np.int64)
    q = np.array([1 if c and rng.random() < 0.6 else rng.randint(1, 7) for c in ctx], dtype=np.int64)
    held = np.empty(n, dtype=np.int64)
    for i, r in enumerate(rows.tolist()):
        table.clear(r)
        need, extra = -(-(int(ctx[i]) + int(q[i])) // BS), rng.randint(0, 2)
        table.append(r, [rng.randrange(1, 500) for _ in range(need + extra)])
        held[i] = need + rng.randint(0, extra)
    return ctx, q, BlockRows(table, rows, held)


def test_staged_metadata_equals_fresh_metadata_on_dirty_buffers() -> None:
    rng = random.Random(3)
    table = BlockTable(32, 12)
    inputs = StepInputs(StepInputSizes(max_tokens=128, max_reqs=16, max_blocks=12), torch.device("cpu"))
    for k in range(60):
        ctx, q, rows = random_batch(rng, table)
        padded = int(q.sum()) + rng.randint(0, 5)
        host = inputs.stage()
        for field in (host.positions, host.slot_mapping, host.query_start_loc, host.seq_lens, host.block_table):
            field[:] = rng.randrange(-9, 9)  # whatever a previous step left there

        def buffers(r: int, width: int, t: int, host: StagedFields = host
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            return (host.query_start_loc[:r + 1], host.seq_lens[:r], host.block_table[:r * width].reshape(r, width),
                    host.slot_mapping[:t], host.positions[:t])

        got = attention_arrays(ctx, q, rows, BS, num_padded_tokens=padded, buffers=buffers)
        want = build_attention_metadata(ctx, q, rows, BS, num_padded_tokens=padded)
        assert np.array_equal(got.query_start_loc, want.query_start_loc_cpu.numpy()), k
        assert np.array_equal(got.seq_lens, want.seq_lens_cpu.numpy()), k
        assert np.array_equal(got.block_table, want.block_table.numpy()), k
        assert np.array_equal(got.slot_mapping, want.slot_mapping.numpy()), k
        assert want.positions is not None and np.array_equal(got.positions, want.positions.numpy()), k
        assert (got.num_actual_tokens, got.max_query_len, got.max_seq_len) == (
            want.num_actual_tokens, want.max_query_len, want.max_seq_len), k


def test_fields_are_aligned_and_disjoint_and_prefix_views_are_kept() -> None:
    inputs = StepInputs(StepInputSizes(max_tokens=10, max_reqs=3, max_blocks=5), torch.device("cpu"))
    views = inputs._device_views
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views.values())
    assert all(a % 16 == 0 for a, _ in spans)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:], strict=False))  # neighbouring pairs
    assert inputs.prefix("input_ids", 4) is inputs.prefix("input_ids", 4)
    assert inputs.prefix("input_ids", 4).data_ptr() == inputs.input_ids.data_ptr()
    assert inputs.prefix("block_table", 3, 5).shape == (3, 5)
    host = inputs.stage()
    host.input_ids[:4] = [7, 8, 9, 10]  # on the CPU the staging buffer is the device buffer
    assert inputs.prefix("input_ids", 4).tolist() == [7, 8, 9, 10]
    with pytest.raises(ValueError, match="positive sizes"):
        StepInputs(StepInputSizes(max_tokens=0, max_reqs=3, max_blocks=5), torch.device("cpu"))


def test_a_runner_reads_its_inputs_through_fixed_buffers() -> None:
    """The runner's input ids, positions and mask are the step-input buffer's fields, and a step longer than
    ``--max-num-seqs`` requests is refused with a clear error."""
    import tempfile

    from runner.config import RunnerConfig
    from runner.core.scheduler_output import ScheduledChunk, SchedulerOutput
    from runner.sampling_params import SamplingParams
    from runner.worker.model_runner import ModelRunner

    with tempfile.TemporaryDirectory() as cache:
        runner = ModelRunner(RunnerConfig(model="tiny-qwen3-moe", cache_dir=cache, max_num_seqs=2,
                                          max_num_batched_tokens=64, max_model_len=64, num_kv_blocks=32))
        try:
            assert runner.input_ids.data_ptr() == runner.inputs.input_ids.data_ptr()
            chunks = [ScheduledChunk(i, [3, 4], 0, [i], True, SamplingParams(temperature=0.0), slot=i)
                      for i in range(3)]
            with pytest.raises(ValueError, match="3 requests exceeds the 2"):
                runner.step(SchedulerOutput(chunks))
            out = runner.step(SchedulerOutput(chunks[:2]))
            assert out is not None and len(out.sampled_token_ids) == 2
        finally:
            runner.close()


@pytest.mark.cuda
def test_cuda_staged_fields_reach_the_device_and_the_staging_buffers_alternate() -> None:
    """On CUDA each step's fields go up with one copy from one of two pinned staging buffers, used in turn; a
    buffer whose last copy has run is rewritten without waiting."""
    inputs = StepInputs(StepInputSizes(max_tokens=64, max_reqs=8, max_blocks=4), torch.device("cuda"))
    seen = set()
    for k in range(6):
        host = inputs.stage()
        seen.add(host.input_ids.ctypes.data)
        host.input_ids[:5] = np.arange(5) + 10 * k
        host.block_table[:6] = k
        inputs.upload(6)
        assert inputs.prefix("input_ids", 5).tolist() == list(range(10 * k, 10 * k + 5))  # a sync: the copy ran
        assert inputs.prefix("block_table", 2, 3).tolist() == [[k] * 3] * 2
    assert len(seen) == 2 and inputs.num_staging_waits == 0
