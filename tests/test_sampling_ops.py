"""Each logits transform of the sampler equals transformers' own processor on the same logits, over batches that
mix settings, greedy rows and rows with everything off.

The logits a random row is about to draw from are captured inside the real sampler (the draw is wrapped),
so the comparisons cover the batched stages with their row subsets, not only the ops in isolation.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import runner.worker.sampler as sampler_module
from runner.core.scheduler_output import ScheduledChunk
from runner.sampling_params import SamplingParams
from runner.worker import sampling_ops as ops
from runner.worker.sampler import Sampler
from runner.worker.sampling_metadata import RowSpec

V = 64


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The random rows' logits right before the draw, per sampler call."""
    seen: list[torch.Tensor] = []
    real = sampler_module.draw_by_inverse_cdf_

    def spy(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        seen.append(logits.clone())
        return real(logits, uniforms)

    monkeypatch.setattr(sampler_module, "draw_by_inverse_cdf_", spy)
    return seen


def hf(processor: Any, scores: torch.Tensor, input_ids: list[int] | None = None) -> torch.Tensor:
    ids = torch.tensor([input_ids if input_ids is not None else [0]])
    return processor(ids, scores[None].clone())[0]


def logits_batch(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


WARPER_ROWS = [  # (temperature, top_k, top_p, min_p); temperature 0 = greedy
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.1),
    (1.0, 10, 0.9, 0.0), (0.5, 3, 0.95, 0.05), (0.0, 0, 1.0, 0.0), (1.7, 0, 0.3, 0.2), (1.0, 1, 1.0, 0.0),
    (0.8, 64, 0.999, 0.0), (1.1, 100, 1.0, 0.0),  # top_k at and above the vocabulary: no effect
]


def warped_by_transformers(row: torch.Tensor, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> torch.Tensor:
    """vLLM's order: temperature, min-p, top-k, top-p; each step transformers' warper."""
    x = hf(TemperatureLogitsWarper(temperature), row)
    if min_p > 0:
        x = hf(MinPLogitsWarper(min_p), x)
    if top_k > 0:
        x = hf(TopKLogitsWarper(top_k), x)
    if top_p < 1.0:
        x = hf(TopPLogitsWarper(top_p), x)
    return x


def test_temperature_min_p_top_k_top_p_equal_transformers_in_a_mixed_batch(captured: list[torch.Tensor]) -> None:
    logits = logits_batch(len(WARPER_ROWS), 0)
    rows = [RowSpec(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m), seed=i)
            for i, (t, k, p, m) in enumerate(WARPER_ROWS)]
    out = Sampler(V, "cpu").sample(logits.clone(), rows)
    random_rows = [i for i, (t, *_) in enumerate(WARPER_ROWS) if t > 0]
    (warped,) = captured
    assert warped.shape == (len(random_rows), V)
    for j, i in enumerate(random_rows):
        ref = warped_by_transformers(logits[i], *WARPER_ROWS[i])
        assert torch.equal(warped[j], ref), f"row {i}: {WARPER_ROWS[i]}"
        assert torch.isfinite(ref[out.token_ids[i]]), "drew a token the warpers removed"
    for i, (t, *_) in enumerate(WARPER_ROWS):
        if t == 0:
            assert out.token_ids[i] == int(logits[i].argmax())
    kept = [int(torch.isfinite(w).sum()) for w in warped]
    assert min(kept) == 1 and max(kept) == V  # top_k=1 keeps one token; an all-off row keeps everything


@pytest.mark.parametrize("top_k", [1, 2, 7, 63])
def test_top_k_alone_equals_transformers(top_k: int) -> None:
    """Per-row k (the gathered ``width`` largest: a ``topk``, no sort of the vocabulary)."""
    logits = logits_batch(4, top_k)
    logits[1, :5] = logits[1].max()  # ties at the top are kept together, as transformers does
    ks = torch.tensor([top_k, max(top_k - 1, 1), top_k, 63])
    for floor in (None, torch.full((4,), -1.0)):  # -1: no top-p for the row
        got = ops.apply_top_k_(logits.clone(), ks, int(ks.max()), floor)
        for i in range(4):
            assert torch.equal(got[i], hf(TopKLogitsWarper(int(ks[i])), logits[i])), i


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_after_top_k_equals_transformers(top_p: float) -> None:
    """Top-p computed over the top-k kept tokens only equals transformers' TopK then TopP over the vocabulary."""
    logits = logits_batch(4, 13)
    ks = torch.tensor([5, 20, 40, 3])
    ps = [top_p, top_p, None, 1 - (1 - top_p) / 2]
    floor = torch.tensor([1 - p if p is not None else -1.0 for p in ps], dtype=torch.float32)
    got = ops.apply_top_k_(logits.clone(), ks, int(ks.max()), floor)
    for i in range(4):
        ref = hf(TopKLogitsWarper(int(ks[i])), logits[i])
        p = ps[i]
        if p is not None:
            ref = hf(TopPLogitsWarper(p), ref)
        assert torch.equal(got[i], ref), i


def test_top_k_where_leaves_rows_without_top_k_and_equals_top_k_on_the_others() -> None:
    """The graph head's top-k (every row computed): a row with ``top_k`` 0 is untouched; the others equal
    :func:`apply_top_k_` on those rows alone, bit for bit, with and without top-p (floor ``-1``: as if none)."""
    logits = logits_batch(6, 17)
    ks = torch.tensor([0, 5, 20, 0, 1, 40])
    floor = torch.tensor([0.5, -1.0, 0.1, -1.0, 0.3, -1.0])
    got = ops.apply_top_k_where_(logits.clone(), ks, ops.TOP_K_WIDTH, floor)
    on = torch.tensor([1, 2, 4, 5])
    want = ops.apply_top_k_(logits[on].clone(), ks[on], ops.TOP_K_WIDTH, floor[on])
    assert torch.equal(got[on], want)
    assert torch.equal(got[[0, 3]], logits[[0, 3]])
    without_p = torch.tensor([1, 5])  # floor -1 gives top-k's threshold exactly, as no floor at all
    assert torch.equal(got[without_p], ops.apply_top_k_(logits[without_p].clone(), ks[without_p], ops.TOP_K_WIDTH))


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_alone_equals_transformers(top_p: float) -> None:
    logits = logits_batch(3, 7)
    floor = torch.tensor([1 - top_p, -1.0, 1 - top_p / 2], dtype=torch.float32)
    got = ops.apply_top_p_(logits.clone(), floor)
    assert torch.equal(got[0], hf(TopPLogitsWarper(top_p), logits[0]))
    assert torch.equal(got[1], logits[1])  # -1: off for this row
    assert torch.equal(got[2], hf(TopPLogitsWarper(top_p / 2), logits[2]))


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.2, 0.9, 1.0])
def test_min_p_alone_equals_transformers(min_p: float) -> None:
    logits = logits_batch(2, 11)
    got = ops.apply_min_p_(logits.clone(), torch.tensor([min_p, min_p / 2]))
    assert torch.equal(got[0], hf(MinPLogitsWarper(min_p), logits[0]))
    assert torch.equal(got[1], hf(MinPLogitsWarper(min_p / 2), logits[1]))


def chunk_with_history(req: int, params: SamplingParams, prompt: list[int], outputs: list[int]) -> ScheduledChunk:
    """The recompute-style chunk of a request: prompt + outputs so far, sampling the next output."""
    tokens = prompt + outputs
    return ScheduledChunk(req, tokens, 0, [], True, params, seed=req, slot=req, prompt_len=len(prompt))


# SamplingParams keyword arguments: min_tokens, bias, repetition, frequency, presence, greedy
PROCESSOR_ROWS: list[dict[str, Any]] = [
    dict(min_tokens=5), dict(min_tokens=2), dict(logit_bias={3: 2.5, 9: -7.0, 60: 100.0}),
    dict(repetition_penalty=1.5), dict(repetition_penalty=0.7), dict(frequency_penalty=0.6),
    dict(presence_penalty=-1.2), dict(frequency_penalty=1.1, presence_penalty=0.4, repetition_penalty=1.3),
    dict(), dict(min_tokens=9, logit_bias={1: 1.0}, repetition_penalty=1.2, presence_penalty=2.0),
]


def test_min_tokens_bias_and_penalties_equal_transformers_and_openai(captured: list[torch.Tensor]) -> None:
    """Rows at temperature 1 with no warper: what they draw from is exactly the processed logits. The same
    settings on greedy rows pick the argmax of the same processed logits."""
    eos, stop = [4, 17], [23]
    logits = logits_batch(2 * len(PROCESSOR_ROWS), 3)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, V, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist()
               for _ in range(2 * len(PROCESSOR_ROWS))]
    outputs = [torch.randint(0, V // 4, (3,), generator=g).tolist() for _ in prompts]  # repeats: counts > 1
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, stop_token_ids=stop, **PROCESSOR_ROWS[i // 2])
              for i in range(len(prompts))]
    chunks = [chunk_with_history(i, p, prompts[i], outputs[i]) for i, p in enumerate(params)]
    sampler = Sampler(V, "cpu", eos_token_ids=eos)
    sampler.record_inputs(chunks)
    out = sampler.sample(logits.clone(), chunks)
    (processed,) = captured
    for i, p in enumerate(params):
        x = logits[i]
        history = prompts[i] + outputs[i]
        x = hf(MinNewTokensLengthLogitsProcessor(len(prompts[i]), p.min_tokens, eos + stop), x, history)
        for tok, val in (p.logit_bias or {}).items():  # OpenAI: added to the logit
            x = x.clone()
            x[tok] += val
        if p.repetition_penalty != 1.0:
            x = hf(RepetitionPenaltyLogitsProcessor(p.repetition_penalty), x, history)
        counts = torch.bincount(torch.tensor(outputs[i]), minlength=V).float()  # OpenAI: over the output only
        x = x - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty
        if i % 2:
            torch.testing.assert_close(processed[i // 2], x, rtol=0, atol=1e-6, msg=f"row {i}")
        else:
            assert out.token_ids[i] == int(x.argmax()), f"greedy row {i}"
    masked = processed[0][eos + stop]  # min_tokens=5 with 3 outputs: every stop id is held back
    assert torch.isinf(masked).all() and not torch.isinf(processed[1][eos + stop]).any()  # 3 >= 2: released


def test_repetition_penalty_alone_equals_transformers() -> None:
    """``apply_penalties_`` on rows with different penalties; a seen token with a zero logit stays zero."""
    from runner.worker.penalties import apply_penalties_

    logits = logits_batch(3, 5)
    seen = [[1, 2, 2, 40], [0, 63], [5]]
    logits[0, 1] = 0.0
    counts = torch.zeros(3, V)
    mask = torch.zeros(3, V, dtype=torch.bool)
    for i, ids in enumerate(seen):  # the first token is the prompt, the rest outputs
        mask[i, ids] = True
        for t in ids[1:]:
            counts[i, t] += 1
    penalties = [1.3, 0.5, 2.0]
    got = apply_penalties_(logits.clone(), counts, mask, torch.tensor(penalties), None, None)
    for i in range(3):
        assert torch.equal(got[i], hf(RepetitionPenaltyLogitsProcessor(penalties[i]), logits[i], seen[i]))
    assert got[0, 1] == 0.0


def _hard_rows(seed: int) -> torch.Tensor:
    """Logits rounded to integers (many ties), with rows holding +inf, only -inf, NaN, one value throughout."""
    x = torch.randn(300, V, generator=torch.Generator().manual_seed(seed)).round()
    x[3, [5, 9]] = float("inf")
    x[4] = float("-inf")
    x[5, [2, 40]] = float("nan")
    x[6] = 7.0
    return x


def test_argmax_rows_equals_torch_argmax() -> None:
    """The CPU's numpy argmax returns torch's indices: the first on ties, +inf, rows of -inf only, NaN (the
    largest, as torch counts it), and on views that are not contiguous."""
    x = _hard_rows(8)
    for logits in (x, x[:, 3:], x[::2], x.t().contiguous().t()):
        assert ops.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
        assert ops.argmax_rows(logits).dtype == torch.int64
    with torch.inference_mode():
        assert ops.argmax_rows(x.clone()).tolist() == x.argmax(dim=-1).tolist()
    assert ops.argmax_rows(torch.empty(4, V, device="meta")).device.type == "meta"  # off the CPU: torch's


def test_greedy_tokens_equal_argmax_with_the_non_finite_check() -> None:
    """Both greedy paths (numpy on the CPU, ``torch.max`` elsewhere) give ``torch.argmax``'s index, and -1 exactly
    where the row's largest logit is not finite: ties, +inf, rows of -inf only, NaN, views that are not
    contiguous."""
    x = _hard_rows(9)
    for logits in (x, x[:, 3:], x[::2], x.t().contiguous().t()):
        ids = logits.argmax(dim=-1)
        best = logits.gather(1, ids.unsqueeze(1)).squeeze(1)
        expected = ids.masked_fill(~torch.isfinite(best), -1).tolist()
        for fn in (ops.greedy_tokens, ops.greedy_tokens_torch):
            got = fn(logits, -1)
            assert got.dtype == torch.int64 and got.tolist() == expected
    assert expected[3] == -1 and expected[4] == -1 and expected[5] == -1 and expected[6] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_tokens_of_the_models_dtype_equal_those_of_its_float32_cast(dtype: torch.dtype) -> None:
    """A greedy pick takes the LM head's logits in the model's dtype (no float32 copy): the cast is exact, so the
    indices and the non-finite rows are those of the cast, on both paths (numpy has no bfloat16: cast there)."""
    x = (_hard_rows(10) * 0.37).to(dtype)  # values that round in ``dtype``: ties appear that float32 would split
    want = ops.greedy_tokens(x.float(), -1).tolist()
    for fn in (ops.greedy_tokens, ops.greedy_tokens_torch):
        assert fn(x, -1).tolist() == want
    assert want[3] == want[4] == want[5] == -1
