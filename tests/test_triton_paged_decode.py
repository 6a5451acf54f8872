"""The split-KV paged decode kernel (runner/attention/triton_paged_decode.py) against a plain-torch reference.

The kernel tests run in Triton's CPU interpreter (``triton_interpreter``; on a GPU machine conftest runs
them in a TRITON_INTERPRET=1 child), where every program costs milliseconds: a handful of requests, a few
heads, blocks of 8 tokens. Every cache is NaN outside the slots a request wrote, and block-table entries past
a request's blocks point at an all-NaN block, so a key read past ``seq_len`` shows up as NaN in the output.
Each launch is recorded (``launches``), so a test comparing N splits checks that N splits ran.

Valid compiled Triton is checked on CPU too: ``test_kernels_compile_for_sm90`` compiles every kernel of the
project ahead of time for an H100 (``tests/triton_compile_check.py``). The compiled run and CUDA-graph
capture at a realistic shape need a GPU (``test_cuda_*``).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import runner.attention.triton_paged_decode as tpd
from runner.attention.triton_paged_decode import (
    MAX_SPLITS,
    DecodeShape,
    choose_num_splits,
    paged_decode_attention,
    plan_decode_launch,
)
from ubatch.triton_runtime import interpreter_enabled

BS = 8  # tokens per cache block in the interpreter tests


# ------------------------------------------------------------------------------------------------- reference
def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Gather every position of each request's blocks, mask positions >= seq_len, softmax in fp32.

    Masked values are replaced by zeros before the weighted sum (a zero weight times a NaN slot is NaN);
    a request of length 0 gives zeros.
    """
    num_req, num_q_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(block_table.shape[1] * block_size)
    blocks = block_table[:, pos // block_size].long()  # [R, S]
    k = k_cache[blocks, pos % block_size].float()  # [R, S, Hkv, Dk]
    v = v_cache[blocks, pos % block_size].float()
    k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=2)
    v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=2)
    valid = pos[None, :] < seq_lens.long()[:, None]  # [R, S]
    k = torch.where(valid[:, :, None, None], k, 0.0)
    v = torch.where(valid[:, :, None, None], v, 0.0)
    scores = torch.einsum("rhd,rshd->rhs", q.float(), k) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf (seq_len 0) -> zeros
    return torch.einsum("rhs,rshd->rhd", probs, v)


# ------------------------------------------------------------------------------------------------ test cases
@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    scale: float

    def args(self) -> tuple[Any, ...]:
        return self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.scale

    def to(self, device: torch.device) -> Case:
        """Every tensor on ``device`` (each copied alone: for the ``separate`` layout only, whose caches are
        not views of one another)."""
        return Case(self.q.to(device), self.k_cache.to(device), self.v_cache.to(device),
                    self.block_table.to(device), self.seq_lens.to(device), self.scale)


def make_case(seq_lens: list[int], num_q_heads: int, num_kv_heads: int, dk: int, dv: int, *,
              layout: str = "separate", dtype: torch.dtype = torch.float32, seed: int = 0) -> Case:
    """A NaN-filled paged cache with each request's positions written through a shuffled block table.

    ``layout``: ``separate`` K and V caches; ``mla`` one ``[NB, BS, 1, dk]`` cache with V its first ``dv``
    dims; ``mha`` one ``[NB, BS, 2, Hkv, d]`` cache with K and V strided views into it.
    """
    gen = torch.Generator().manual_seed(seed)
    used = [math.ceil(n / BS) for n in seq_lens]
    max_blocks = max(used) + 1  # one more column than any request needs: its entry must never be read
    num_blocks = sum(used) + 1  # block 0 is never written: all NaN
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for r, n in enumerate(used):
        block_table[r, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    nan = float("nan")
    if layout == "mha":
        assert dk == dv
        cache = torch.full((num_blocks, BS, 2, num_kv_heads, dk), nan, dtype=dtype)
        k_cache, v_cache = cache[:, :, 0], cache[:, :, 1]
    elif layout == "mla":
        assert num_kv_heads == 1 and dv <= dk
        k_cache = torch.full((num_blocks, BS, 1, dk), nan, dtype=dtype)
        v_cache = k_cache[..., :dv]
    else:
        k_cache = torch.full((num_blocks, BS, num_kv_heads, dk), nan, dtype=dtype)
        v_cache = torch.full((num_blocks, BS, num_kv_heads, dv), nan, dtype=dtype)
    for r, n in enumerate(seq_lens):
        pos = torch.arange(n)
        blocks, slots = block_table[r, pos // BS].long(), pos % BS
        k_cache[blocks, slots] = torch.randn(n, num_kv_heads, dk, generator=gen).to(dtype)
        if layout != "mla":
            v_cache[blocks, slots] = torch.randn(n, num_kv_heads, dv, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_q_heads, dk, generator=gen).to(dtype)
    return Case(q, k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), dk ** -0.5)


class _Recorder:
    """Wraps a kernel so every launch's grid is logged: proof of how many splits (and merges) ran."""

    def __init__(self, kernel: Any, name: str, log: list[tuple[str, tuple[int, ...]]]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.log.append((self.name, tuple(grid)))
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    log: list[tuple[str, tuple[int, ...]]] = []
    real = tpd._load_kernels

    def recording() -> tuple[Any, Any]:
        split, merge = real()
        return _Recorder(split, "split", log), _Recorder(merge, "merge", log)

    monkeypatch.setattr(tpd, "_load_kernels", recording)
    return log


def expected_launches(case: Case, splits: int) -> list[tuple[str, tuple[int, ...]]]:
    """The grids written out from the kernel's design: (request, kv head x head blocks, split), then the merge."""
    num_req, num_q_heads, _ = case.q.shape
    num_kv_heads = case.k_cache.shape[2]
    head_blocks = math.ceil(num_q_heads // num_kv_heads / 16)
    grids: list[tuple[str, tuple[int, ...]]] = [("split", (num_req, num_kv_heads * head_blocks, splits))]
    if splits > 1:
        grids.append(("merge", (num_req, num_q_heads)))
    return grids


# Ragged lengths: padding (0), one token, exactly one and two blocks, and lengths that end mid-block.
RAGGED = [5, 0, 1, BS, 2 * BS, 3 * BS + 3]


# ---------------------------------------------------------------------------------------- kernel vs reference
@pytest.mark.triton_interpreter
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_reference(heads: tuple[int, int], splits: int, launches: list) -> None:
    case = make_case(RAGGED, *heads, dk=32, dv=32)
    out = paged_decode_attention(*case.args(), num_splits=splits)
    assert launches == expected_launches(case, splits)
    assert out.dtype == torch.float32 and out.shape == (len(RAGGED), heads[0], 32)
    torch.testing.assert_close(out, reference(*case.args()), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # seq_len 0: exact zeros


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_mla_like_dims(splits: int, launches: list) -> None:
    """Dk=72 (a power-of-two part and a padded rest, as 576 = 512 + 64), Dv=64, V aliasing K's first dims."""
    case = make_case([3, 0, 2 * BS, 4 * BS + 1], 4, 1, dk=72, dv=64, layout="mla")
    assert case.v_cache.data_ptr() == case.k_cache.data_ptr()
    out = paged_decode_attention(*case.args(), num_splits=splits)
    assert launches == expected_launches(case, splits)
    torch.testing.assert_close(out, reference(*case.args()), rtol=1e-5, atol=1e-5)


@pytest.mark.triton_interpreter
def test_more_splits_than_blocks_and_odd_head_dims() -> None:
    """Splits outnumber a short request's tiles (most splits empty); Dk=Dv=24 pads to 32 masked lanes."""
    case = make_case([1, BS + 1, 3], 6, 2, dk=24, dv=24, seed=1)
    out = paged_decode_attention(*case.args(), num_splits=7)
    torch.testing.assert_close(out, reference(*case.args()), rtol=1e-5, atol=1e-5)


@pytest.mark.triton_interpreter
def test_strided_mha_cache_and_strided_inputs() -> None:
    """K and V are views into one [NB, BS, 2, Hkv, D] cache; q, seq_lens and the block table are strided too."""
    case = make_case(RAGGED, 4, 2, dk=16, dv=16, layout="mha", seed=2)
    assert not case.k_cache.is_contiguous() and case.k_cache.stride(2) == 16
    wide_q = torch.randn(case.q.shape[0], 4, 48)
    wide_q[..., 5:21] = case.q
    q = wide_q[..., 5:21]
    seq_lens = torch.stack([case.seq_lens, torch.full_like(case.seq_lens, -99)], dim=1)[:, 0]
    table = torch.cat([case.block_table, torch.full_like(case.block_table, -99)], dim=1)[:, :case.block_table.shape[1]]
    assert seq_lens.stride(0) == 2 and table.stride(0) == 2 * case.block_table.shape[1]
    out = paged_decode_attention(q, case.k_cache, case.v_cache, table, seq_lens, case.scale, num_splits=2)
    torch.testing.assert_close(out, reference(*case.args()), rtol=1e-5, atol=1e-5)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 2])
def test_16bit_inputs_and_out_argument(dtype: torch.dtype, splits: int) -> None:
    """16-bit q and cache: the result is the fp32 reference on the same values, rounded once to ``dtype``."""
    case = make_case(RAGGED, 4, 2, dk=32, dv=32, dtype=dtype, seed=3)
    out = torch.full((len(RAGGED), 4, 32), 7.0, dtype=dtype)
    returned = paged_decode_attention(*case.args(), out=out, num_splits=splits)
    assert returned is out and out.dtype == dtype
    ref = reference(*case.args())
    # One rounding of the output to dtype: 2**-8 (bf16) or 2**-11 (fp16) relative, plus fp32 ordering noise.
    tol = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.triton_interpreter
def test_automatic_split_choice_on_cpu(launches: list) -> None:
    """Without ``num_splits`` the interpreter counts as one SM: 4 programs' worth, capped by length."""
    case = make_case([40 * BS, 3], 2, 1, dk=16, dv=16, seed=4)  # 41 blocks of 8 = 328 tokens -> at most 2 splits
    out = paged_decode_attention(*case.args())
    assert launches == expected_launches(case, 2)
    torch.testing.assert_close(out, reference(*case.args()), rtol=1e-5, atol=1e-5)


@pytest.mark.triton_interpreter
def test_no_requests() -> None:
    case = make_case([3], 2, 1, dk=16, dv=16)
    empty = paged_decode_attention(case.q[:0], case.k_cache, case.v_cache, case.block_table[:0],
                                   case.seq_lens[:0], 1.0)
    assert empty.shape == (0, 2, 16)


@pytest.mark.triton_interpreter
def test_concurrent_threads() -> None:
    """Ranks-as-threads call at once: interpreted launches are serialised by the project's one lock."""
    cases = [make_case([BS + 2, 5], 4, 2, dk=16, dv=16, seed=s) for s in range(3)]
    refs = [reference(*c.args()) for c in cases]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(2):
                torch.testing.assert_close(paged_decode_attention(*cases[i].args(), num_splits=2), refs[i],
                                           rtol=1e-5, atol=1e-5)
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


# ---------------------------------------------------------------------------------------- host-side planning
def test_split_choice_from_shapes() -> None:
    # Enough (request, kv head) programs already: one split.
    assert choose_num_splits(512, 4, 8192, 132) == 1
    assert choose_num_splits(256, 4, 4096, 132) == 1
    # Few requests: fill 4 programs per SM, but no split under 256 tokens of a full-length request.
    assert choose_num_splits(16, 4, 8192, 132) == 9  # cdiv(528, 64)
    assert choose_num_splits(1, 4, 8192, 132) == 32  # 8192 / 256
    assert choose_num_splits(1, 1, 10 ** 6, 132) == MAX_SPLITS
    assert choose_num_splits(1, 4, 100, 132) == 1
    with pytest.raises(ValueError, match="num_sms=0"):
        choose_num_splits(1, 4, 100, 0)


def test_plan_depends_on_shapes_only() -> None:
    def plan(dk: int, dv: int, hq: int = 32, hkv: int = 4, dtype: torch.dtype = torch.bfloat16, **kw: Any):
        return plan_decode_launch(DecodeShape(8, hq, hkv, dk, dv, 16, 64), (dtype,) * 3, 132, **kw)

    p = plan(128, 128)
    assert (p.block_dk1, p.block_dk2, p.block_dv, p.block_h, p.head_blocks) == (128, 0, 128, 16, 1)
    assert p.dot_precision == "tf32" and plan(128, 128, dtype=torch.float32).dot_precision == "ieee"
    mla = plan(576, 512, hq=128, hkv=1)
    assert (mla.block_dk1, mla.block_dk2, mla.block_dv, mla.block_h, mla.head_blocks) == (512, 64, 512, 16, 8)
    small = plan(72, 64)
    assert (small.block_dk1, small.block_dk2, small.block_dv) == (64, 16, 64)
    assert plan(128, 128, num_splits=5).num_splits == 5 and plan(128, 128, num_splits=5).block_s == 8
    assert plan(128, 128, num_splits=3).workspace_bytes(DecodeShape(8, 32, 4, 128, 128, 16, 64)) == 4 * 8 * 32 * 3 * 129
    assert plan(128, 128, num_splits=1).workspace_bytes(DecodeShape(8, 32, 4, 128, 128, 16, 64)) == 0
    for bad in (0, MAX_SPLITS + 1, 2.0, True):
        with pytest.raises(ValueError, match="num_splits="):
            plan(128, 128, num_splits=bad)


# ------------------------------------------------------------------------------------------------ bad input
def launch_device() -> torch.device:
    """Where this process's Triton mode launches kernels: CPU tensors interpreted, CUDA tensors compiled."""
    if interpreter_enabled():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 without a CUDA GPU: this process can launch no Triton kernel")
    return torch.device("cuda", torch.cuda.current_device())


def _bad_inputs(device: torch.device) -> tuple[list[tuple[str, dict[str, Any], type[Exception], str]], Case]:
    c = make_case([3, 9], 4, 2, dk=16, dv=16).to(device)
    return [
        ("q_2d", dict(q=c.q[0]), ValueError, r"q must be \[R, Hq, Dk\], got shape \(4, 16\)"),
        ("q_int", dict(q=c.q.to(torch.int32)), TypeError, "q dtype torch.int32"),
        ("k_f64", dict(k_cache=c.k_cache.double()), TypeError, "k_cache dtype torch.float64"),
        ("q_last_stride", dict(q=c.q.transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         "q needs a unit-stride"),
        ("heads", dict(q=torch.randn(2, 3, 16, device=device)), ValueError,
         "3 query heads are not a multiple of 2 KV heads"),
        ("dk", dict(q=torch.randn(2, 4, 8, device=device)), ValueError, "k_cache head dim 16 != q head dim 8"),
        ("v_shape", dict(v_cache=c.v_cache[:, :4]), ValueError, r"v_cache shape \(\d+, 4, 2, 16\) does not match"),
        ("table_dtype", dict(block_table=c.block_table.long()), TypeError,
         "block_table must be int32, got torch.int64"),
        ("seq_dtype", dict(seq_lens=c.seq_lens.long()), TypeError, "seq_lens must be int32"),
        ("table_rows", dict(block_table=c.block_table[:1]), ValueError, r"block_table shape \(1, 3\) must be \[2,"),
        ("seq_rows", dict(seq_lens=c.seq_lens[:1]), ValueError, r"seq_lens shape \(1,\) must be \[2\]"),
        ("scale", dict(scale=float("nan")), ValueError, "scale=nan must be a finite float"),
        ("out_dtype", dict(out=torch.empty(2, 4, 16, dtype=torch.float16, device=device)), ValueError,
         "out must be .* torch.float16"),
        ("out_shape", dict(out=torch.empty(2, 4, 8, device=device)), ValueError, r"got \[2, 4, 8\]"),
        ("out_device", dict(out=torch.empty(2, 4, 16, device="meta")), ValueError, r"got \[2, 4, 16\] .* on meta"),
        ("splits", dict(num_splits=0), ValueError, "num_splits=0"),
    ], c


def test_bad_input_raises_naming_the_value() -> None:
    """On the device this process launches on (CPU interpreted, a GPU compiled), so every check runs, the
    ones after the device check (``num_splits``) included."""
    cases, c = _bad_inputs(launch_device())
    for name, change, exc, pattern in cases:
        kwargs: dict[str, Any] = dict(q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, block_table=c.block_table,
                                      seq_lens=c.seq_lens, scale=c.scale)  # and bad values: any type
        kwargs.update(change)
        with pytest.raises(exc, match=pattern):
            paged_decode_attention(**kwargs)
        assert name  # every row names what it breaks (shown by pytest on failure)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_case([3], 2, 1, dk=16, dv=16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET=1 they need CUDA tensors"):
        paged_decode_attention(*c.args())


def test_missing_triton_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_case([3], 2, 1, dk=16, dv=16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(ImportError,
                       match=r"paged_decode_attention needs the Triton package: pip install ubatch\[triton\]"):
        paged_decode_attention(*c.args())


def test_module_imports_without_triton() -> None:
    code = ("import sys; sys.modules['triton'] = None; import runner.attention.triton_paged_decode, "
            "ubatch.triton_runtime; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ------------------------------------------------------------------------------------------------ compiled
@pytest.mark.slow  # compiles every kernel in a child process
def test_kernels_compile_for_sm90() -> None:
    """Every Triton kernel of the project compiles to an sm_90 cubin (ahead of time: no GPU needed)."""
    pytest.importorskip("triton")
    script = Path(__file__).with_name("triton_compile_check.py")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=script.parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("kernel ")]
    # 2 MoE GEMMs, each for bf16 and for block-FP8 weights; split-KV stage 1 for 4 dtype/dim/option sets x (one
    # split, several: WRITE_LSE); the merge; the emulated link's wait on the global timer (i32 and i64 counts);
    # the fused tails: add + RMSNorm at two widths with and without the residual, q/k norm + RoPE in four variants,
    # the router with softmax and with sigmoid; the sampler's fused draw (its three kernels), plain, with a
    # temperature, and with both a temperature and top-k's threshold.
    assert len(compiled) == 34 and all(line.endswith(": cubin ok") for line in compiled), proc.stdout
    # Each stage-1 compilation's key loop is a software-pipelined scf.for (the script checks its TTGIR).
    loops = [line for line in proc.stdout.splitlines() if line.startswith("  key loop: scf.for")]
    assert len(loops) == 8, proc.stdout


@pytest.mark.cuda
@pytest.mark.triton_compiled
def test_cuda_realistic_shape_and_graph_capture() -> None:
    """32 query / 4 KV heads, head dim 128, blocks of 16, bf16: equal to the reference, eager and replayed."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    num_req, hq, hkv, d, bs, max_blocks = 64, 32, 4, 128, 16, 64
    num_blocks = num_req * max_blocks + 1
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=torch.bfloat16, device=dev)
    v_cache = torch.full_like(k_cache, float("nan"))
    table = (torch.randperm(num_blocks - 1, device=dev)[: num_req * max_blocks] + 1).to(torch.int32)
    table = table.view(num_req, max_blocks)

    def fill(seq_lens: torch.Tensor) -> None:
        pos = torch.arange(max_blocks * bs, device=dev)
        valid = pos[None, :] < seq_lens[:, None].long()
        blocks, slots = table[:, pos // bs].long()[valid], (pos % bs).expand(num_req, -1)[valid]
        k_cache[blocks, slots] = torch.randn(blocks.numel(), hkv, d, device=dev, dtype=torch.bfloat16)
        v_cache[blocks, slots] = torch.randn(blocks.numel(), hkv, d, device=dev, dtype=torch.bfloat16)

    seq_lens = torch.randint(0, max_blocks * bs + 1, (num_req,), device=dev, dtype=torch.int32)
    seq_lens[:4] = torch.tensor([0, 1, bs, max_blocks * bs], device=dev, dtype=torch.int32)
    fill(seq_lens)
    q = torch.randn(num_req, hq, d, device=dev, dtype=torch.bfloat16)
    scale = d ** -0.5
    for splits in (None, 1, 4):
        out = paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, num_splits=splits)
        ref = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), table.cpu(), seq_lens.cpu(), scale)
        torch.testing.assert_close(out.float().cpu(), ref, rtol=2 ** -7, atol=2 ** -7)

    static_out = torch.empty(num_req, hq, d, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles outside the capture
        paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, out=static_out, num_splits=4)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, out=static_out, num_splits=4)
    # New lengths and queries, written in place: the replay reads them on the device.
    seq_lens.copy_(torch.randint(0, max_blocks * bs + 1, (num_req,), device=dev, dtype=torch.int32))
    fill(seq_lens)
    q.copy_(torch.randn_like(q))
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), table.cpu(), seq_lens.cpu(), scale)
    torch.testing.assert_close(static_out.float().cpu(), ref, rtol=2 ** -7, atol=2 ** -7)
