"""The sampler's fused draw (``runner/worker/fused_draw.py``) in Triton's interpreter, float32, small vocabularies.

Against a float64 inverse CDF of the same ``y`` (the token whose CDF interval holds ``u * total``), where the
target is not within rounding of an interval's end; never a removed token, whatever the uniform; NaN, ``+inf`` and
empty rows invalid, greedy rows (negative uniform) not read; the temperature and threshold folded in give what
dividing and masking beforehand give, bit for bit, and so does a peak given; rows alone and in a batch alike; a
vocabulary of many chunks.
On a GPU, compiled, Qwen3's vocabulary against the same reference, and a CUDA graph's replay.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.worker import fused_draw as fused_draw_module
from runner.worker.fused_draw import fused_draw
from runner.worker.sampling_noise import INVALID_TOKEN

NEG_INF = float("-inf")
U_MAX = 1 - 2.0 ** -24  # the largest uniform sampling_noise.row_uniform gives


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    pytest.importorskip("triton")


@pytest.fixture(params=[(4096, 4), (32, 2)], ids=["one-chunk", "chunks-of-64"])
def block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The kernels' block width and blocks per chunk: the defaults (one block, one chunk for these vocabularies)
    and chunks of two 32-wide blocks (several chunks to a row, the last one partial)."""
    width, per_chunk = request.param
    monkeypatch.setattr(fused_draw_module, "BLOCK", width)
    monkeypatch.setattr(fused_draw_module, "CHUNK_BLOCKS", per_chunk)
    return int(width)


def reference(y: torch.Tensor, u: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each row's token by a float64 inverse CDF over ``y`` (float32, -inf removed), and how far its target lies
    from the nearest end of a CDF interval, relative to the row's total."""
    y64 = y.double().numpy()
    p = np.exp(y64 - y64.max(axis=1, keepdims=True))
    cdf = np.cumsum(p, axis=1)
    target = u.double().numpy() * cdf[:, -1]
    tokens = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cdf, target, strict=True)])
    margin = np.min(np.abs(cdf - target[:, None]), axis=1) / cdf[:, -1]
    return tokens, margin


@pytest.mark.triton_interpreter
def test_draws_are_the_inverse_cdf_of_the_divided_and_cut_rows(block: int) -> None:
    g = torch.Generator().manual_seed(1)
    rows, vocab = 32, 203
    x = torch.randn(rows, vocab, generator=g) * 3
    u = torch.rand(rows, generator=g) * U_MAX
    t = torch.rand(rows, generator=g) * 1.5 + 0.2
    y = x / t[:, None]
    kth = y.topk(20, dim=-1).values[:, -1]
    kth[::3] = NEG_INF  # a third of the rows without a cut
    cut = y.masked_fill(y < kth[:, None], NEG_INF)
    got = fused_draw(x, u, t, kth).numpy()
    want, margin = reference(cut, u)
    clear = margin > 1e-5
    assert clear.sum() >= rows - 2
    assert np.array_equal(got[clear], want[clear])
    assert np.isfinite(cut.numpy()[np.arange(rows), got]).all()  # every token survived its row's cut
    # folded in or done beforehand: the same y (the kernel's division is IEEE's, as torch's), the same tokens
    assert np.array_equal(fused_draw(y, u, None, kth).numpy(), got)
    assert np.array_equal(fused_draw(cut, u).numpy(), got)
    # the peak given, as a graph head gives it (the row's maximum, divided): the same tokens without its launch
    assert np.array_equal(fused_draw(x, u, t, kth, peak=x.max(dim=-1).values / t).numpy(), got)


@pytest.mark.triton_interpreter
def test_a_removed_token_is_never_drawn_whatever_the_uniform(block: int) -> None:
    """Rows with most tokens removed, every uniform from 0 to the largest: the token is always one kept, the first
    kept one at 0 and the last kept one at the largest (each kept token holds a fair share here; with chunks of
    64, kept tokens sit in three chunks and none in the fourth)."""
    vocab = 200
    kept = [3, 17, 18, 64, 139]
    row = torch.full((vocab,), NEG_INF)
    row[kept] = torch.tensor([0.5, 0.0, 1.0, -0.5, 0.25])
    u = torch.cat([torch.tensor([0.0, U_MAX]), torch.linspace(0, U_MAX, 60)])
    got = fused_draw(row.expand(len(u), vocab).contiguous(), u).tolist()
    assert set(got) <= set(kept) and got[:2] == [kept[0], kept[-1]]
    assert set(got) == set(kept)  # and each is drawn somewhere along the uniforms
    # the same by a threshold instead of -inf: everything below 0 goes
    dense = torch.linspace(-1, 1, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]
    cut = fused_draw(dense.expand(len(u), vocab).contiguous(), u, None, torch.zeros(len(u)))
    assert (dense[cut] >= 0).all()


@pytest.mark.triton_interpreter
def test_rows_without_a_distribution_are_invalid_and_greedy_rows_are_not_read(block: int) -> None:
    vocab = 40
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2))
    x[0, 7] = float("nan")
    x[1, 30] = float("inf")
    x[2] = NEG_INF
    u = torch.tensor([0.5, 0.5, 0.5, 0.5, -1.0, 0.5])
    threshold = torch.tensor([NEG_INF, NEG_INF, NEG_INF, 100.0, NEG_INF, NEG_INF])  # row 3: all cut
    got = fused_draw(x, u, None, threshold).tolist()
    assert got[:5] == [INVALID_TOKEN] * 5  # row 4 is greedy: its token is the argmax's, taken elsewhere
    assert 0 <= got[5] < vocab
    given = fused_draw(x, u, None, threshold, peak=x.max(dim=-1).values)  # NaN and +inf peaks: no distribution
    assert given.tolist() == got


@pytest.mark.triton_interpreter
def test_a_row_draws_the_same_token_alone_and_in_any_batch(block: int) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 150, generator=g) * 4
    u, t = torch.rand(12, generator=g) * U_MAX, torch.rand(12, generator=g) + 0.5
    batch = fused_draw(x, u, t).tolist()
    alone = [fused_draw(x[i:i + 1], u[i:i + 1], t[i:i + 1]).item() for i in range(12)]
    assert batch == alone
    order = torch.randperm(12, generator=g)
    assert fused_draw(x[order], u[order], t[order]).tolist() == [batch[i] for i in order.tolist()]


@pytest.mark.triton_interpreter
def test_bad_arguments_are_named() -> None:
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"uniforms must be \[3\] float32, got \(2,\)"):
        fused_draw(x, torch.zeros(2))
    with pytest.raises(ValueError, match=r"temperature must be \[3\] float32, got \(3,\) torch.float64"):
        fused_draw(x, torch.zeros(3), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"peak must be \[3\] float32, got \(3, 1\)"):
        fused_draw(x, torch.zeros(3), peak=torch.zeros(3, 1))
    with pytest.raises(ValueError, match="unit stride along the vocabulary"):
        fused_draw(x.t(), torch.zeros(8))


@pytest.mark.cuda
@pytest.mark.triton_compiled
def test_cuda_qwen3_vocabulary_draws_and_graph_capture() -> None:
    """Compiled, 256 rows of Qwen3's vocabulary (151,936) with a temperature and top-k 20's threshold: the float64
    inverse CDF's tokens where the target is clear of an interval's end, only kept tokens, and a CUDA graph
    replayed on new inputs written in place gives the eager call's tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 256, 151_936
    x = torch.randn(rows, vocab, generator=g, device="cuda") * 4
    u = torch.rand(rows, generator=g, device="cuda") * U_MAX
    t = torch.rand(rows, generator=g, device="cuda") + 0.3
    kth = (x.topk(20, dim=-1).values / t[:, None])[:, -1]
    got = fused_draw(x, u, t, kth)
    y = x / t[:, None]
    cut = y.masked_fill(y < kth[:, None], NEG_INF)
    want, margin = reference(cut.cpu(), u.cpu())
    clear = margin > 1e-5
    assert clear.sum() >= rows - 4
    assert np.array_equal(got.cpu().numpy()[clear], want[clear])
    assert torch.isfinite(cut.gather(1, got[:, None])).all()
    assert torch.equal(fused_draw(x, u, t, kth, peak=x.max(dim=-1).values / t), got)  # a head's given peak
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_draw(x, u, t, kth)
    x2, u2 = torch.randn_like(x) * 4, torch.rand(rows, generator=g, device="cuda") * U_MAX
    kth2 = (x2.topk(20, dim=-1).values / t[:, None])[:, -1]
    for buf, new in ((x, x2), (u, u2), (kth, kth2)):
        buf.copy_(new)
    graph.replay()
    assert torch.equal(replayed, fused_draw(x, u, t, kth))
