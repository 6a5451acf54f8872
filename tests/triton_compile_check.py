"""Compile every Triton kernel of the project ahead of time for an H100 (sm_90), on any machine.

Why: CPU test runs execute the kernels in Triton's interpreter, which accepts Python that the compiler
rejects (and the other way round). ``triton.compile`` with an explicit target needs no GPU or driver (the
Triton wheel ships ptxas), so this shows on CPU that the compiled path is valid Triton for the installed
version, down to a cubin. Run as a script in a process with ``TRITON_INTERPRET=0`` (kernels decorated in
interpreter mode cannot be compiled); ``test_triton_paged_decode.test_kernels_compile_for_sm90`` does.
Prints one ``kernel <name> <constexprs>: cubin ok`` line per compilation and exits non-zero on the first
failure.

Integer arguments the launcher would see as multiples of 16 (pointers, head dims, strides, block size) are
compiled with that divisibility, as Triton's launcher specialises them at run time: without it the K/V
loads cannot be vectorised, and the compiled code would not be the code that runs. For the split-KV kernel
the check also reads the TTGIR and fails unless its key loop is an ``scf.for`` whose K/V tile loads all
became asynchronous copies (software-pipelined), since that is what its memory bandwidth depends on.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ubatch.triton_runtime import interpreter_enabled

H100 = GPUTarget("cuda", 90, 32)


def compile_kernel(fn: Any, types: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4,
                   divisible: tuple[str, ...] = ()) -> Any:
    """Arguments not named in ``types`` or ``constexprs`` are int32 scalars; those in ``divisible`` are
    multiples of 16."""
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=H100,
                              options={"num_warps": num_warps, "num_stages": 2})
    if not compiled.asm.get("cubin"):
        raise RuntimeError(f"{fn.__name__} produced no cubin")
    print(f"kernel {fn.__name__} {constexprs}: cubin ok", flush=True)
    return compiled


def check_pipelined_key_loop(compiled: Any, tile_loads: int) -> None:
    """The TTGIR has one ``scf.for`` (no ``scf.while``) and each of its ``tile_loads`` 2-D loads is an async copy."""
    ttgir = compiled.asm["ttgir"]
    if "scf.while" in ttgir or ttgir.count("scf.for") != 1:
        raise RuntimeError("the key loop is not a single scf.for:\n" + ttgir)
    lines = ttgir.splitlines()
    head = next(i for i, line in enumerate(lines) if "scf.for" in line)
    indent = lines[head][: len(lines[head]) - len(lines[head].lstrip())]
    tail = next(i for i in range(head + 1, len(lines)) if lines[i].startswith(indent + "}"))
    body = "\n".join(lines[head + 1: tail])
    tile = r"tensor<\d+x\d+x!tt\.ptr<"
    synchronous = len(re.findall(r"tt\.load [^\n]*: " + tile, body))
    asynchronous = len(re.findall(r"ttg\.async_copy_global_to_local [^\n]*: " + tile, body))
    if synchronous or asynchronous != tile_loads:
        raise RuntimeError(f"key loop: {asynchronous} async and {synchronous} synchronous 2-D loads, wanted "
                           f"{tile_loads} async and none synchronous:\n{body}")
    print(f"  key loop: scf.for, {asynchronous} K/V tile loads as async copies, "
          f"{compiled.metadata.shared} bytes of shared memory", flush=True)


def check_moe_experts() -> None:
    from ubatch.modular_moe.experts import triton_experts

    triton_experts._import_triton()
    w13, w2 = triton_experts._load_kernels()
    ids = dict(sorted_ids_ptr="*i32", expert_ids_ptr="*i32", num_post_pad_ptr="*i32")
    blocks = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)
    # bf16 weights (the scale pointer is a placeholder the kernel never reads), and block-FP8 weights with
    # 128 x 128 scales in fp32, as the launcher specialises them (triton_experts._NO_FP8 / _scale_consts)
    for weight, scales in (("*bf16", dict(FP8_W=False, SCALE_BN=1, SCALE_BK=1)),
                           ("*fp8e4nv", dict(FP8_W=True, SCALE_BN=128, SCALE_BK=128))):
        s_ptr = "*fp32" if scales["FP8_W"] else weight
        compile_kernel(w13, dict(a_ptr="*bf16", w_ptr=weight, out_ptr="*fp32", s_ptr=s_ptr, **ids),
                       dict(K=256, **blocks, **scales))
        compile_kernel(w2, dict(a_ptr="*fp32", w_ptr=weight, out_ptr="*bf16", weights_ptr="*fp32", s_ptr=s_ptr, **ids),
                       dict(K=512, MUL_ROUTED_WEIGHT=True, **blocks, **scales))


def check_paged_decode() -> None:
    import runner.attention.triton_paged_decode as decode

    decode.triton, decode.tl = triton, triton.language  # what paged_decode_attention does before loading
    split, merge = decode._load_kernels()
    # As the launcher specialises them for a contiguous cache with head dims 128 / 576 and 512, blocks of 16;
    # the block-table column stride and seq_lens stride are 1. ``num_splits`` is a runtime i32 (never specialised).
    split_divisible = tuple(name for name in split.arg_names if name.endswith("_ptr") or name.startswith("stride_")
                            or name in ("head_dim_k", "head_dim_v", "block_size"))
    split_divisible = tuple(name for name in split_divisible if name not in ("stride_btc", "stride_sl"))
    # (dtype, Dk blocks, Dv block, block_n, warps, precision): GQA head dim 128 bf16 and fp32, MLA 576/512.
    # The last one: a gpt-oss layer, attention sinks (fp32) and a sliding window.
    for dtype, dk1, dk2, dv, block_n, warps, precision, options in (
            ("bf16", 128, 0, 128, 32, 4, "tf32", False), ("fp32", 128, 0, 128, 32, 4, "ieee", False),
            ("bf16", 512, 64, 512, 16, 8, "tf32", False), ("bf16", 64, 0, 64, 32, 4, "tf32", True)):
        for splits in (1, 4):
            out = dtype if splits == 1 else "fp32"
            types = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", block_table_ptr="*i32",
                         seq_lens_ptr="*i32", part_ptr=f"*{out}", lse_ptr=f"*{out}", sinks_ptr="*fp32",
                         qk_scale_log2="fp32")
            compiled = compile_kernel(
                split, types, dict(WRITE_LSE=splits > 1, DOT_PRECISION=precision, HAS_SINKS=options,
                                   HAS_WINDOW=options, BLOCK_H=16, BLOCK_N=block_n, BLOCK_DK1=dk1, BLOCK_DK2=dk2,
                                   BLOCK_DV=dv, INTERPRET=False, NUM_STAGES=decode.KEY_LOOP_STAGES),
                num_warps=warps, divisible=split_divisible)
            check_pipelined_key_loop(compiled, tile_loads=3 if dk2 else 2)
    compile_kernel(merge, dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16"),
                   dict(BLOCK_S=8, BLOCK_DV=128))


def check_device_wait() -> None:
    """The emulated link's wait: spins on %globaltimer (the nanosecond clock), never on clock cycles."""
    from ubatch.modular_moe.prepare_finalize import device_wait

    kernel = device_wait._load_kernel()
    for ns_type in ("i32", "i64"):  # the launcher passes counts past 2**31 ns as i64
        compiled = compile_kernel(kernel, dict(ns=ns_type), {}, num_warps=1)
        if "%globaltimer" not in compiled.asm["ptx"]:
            raise RuntimeError("the device wait does not read %globaltimer:\n" + compiled.asm["ptx"])


def check_fused_tails() -> None:
    """The fused tails (``fused_tails``) at Qwen3-MoE's shapes, bf16 activations: the residual add + RMSNorm
    (hidden 2048 and 4096), q/k norm + RoPE (head dim 128, full and half rotary, both layouts, with and without
    the norm) and the router (128 experts, top-8; softmax and sigmoid)."""
    from runner.models.kernels import add_rms_norm, qk_norm_rope
    from ubatch.modular_moe import fused_router

    # what each launcher does before loading its kernel
    add_rms_norm.triton, add_rms_norm.tl = triton, triton.language
    qk_norm_rope.triton, qk_norm_rope.tl = triton, triton.language
    fused_router.triton, fused_router.tl = triton, triton.language
    norm = add_rms_norm._load_kernel()
    ptrs: tuple[str, ...] = ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")
    for block_n in (2048, 4096):
        for has_residual in (True, False):
            compile_kernel(norm, {**{p: "*bf16" for p in ptrs}, "eps": "fp32"},
                           dict(HAS_RESIDUAL=has_residual, BLOCK_N=block_n),
                           num_warps=add_rms_norm.num_warps_for(block_n),
                           divisible=(*ptrs, "n_cols", "stride_x", "stride_r", "stride_o", "stride_ro"))
    rope = qk_norm_rope._load_kernel()
    ptrs = ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr", "q_out_ptr", "k_out_ptr")
    for has_norm, interleaved, tail in ((True, False, 0), (False, False, 0), (True, True, 0), (True, False, 64)):
        half = (128 - tail) // 2
        compile_kernel(rope, {**{p: "*bf16" for p in ptrs}, "eps_q": "fp32", "eps_k": "fp32"},
                       dict(HAS_NORM=has_norm, INTERLEAVED=interleaved, HAS_TAIL=tail > 0,
                            BLOCK_H=qk_norm_rope.TILE_ELEMENTS // (2 * half), BLOCK_HALF=half, BLOCK_TAIL=max(tail, 1)),
                       divisible=(*ptrs, "head_dim", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                  "stride_qot", "stride_qoh", "stride_kot", "stride_koh"))
    router = fused_router._load_kernel()
    for sigmoid in (False, True):
        compile_kernel(router, dict(logits_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64", scaling="fp32"),
                       dict(SIGMOID=sigmoid, RENORMALIZE=True, TOP_K=8, BLOCK_E=128, BLOCK_K=8), num_warps=1,
                       divisible=("logits_ptr", "weights_ptr", "ids_ptr", "num_experts", "stride_l", "stride_w",
                                  "stride_i"))


def check_fused_draw() -> None:
    """The sampler's fused draw (``runner/worker/fused_draw.py``: peak, total, walk) over float32 logits: plain,
    with a temperature, and with both a temperature and top-k's threshold."""
    from runner.worker import fused_draw

    fused_draw.triton, fused_draw.tl = triton, triton.language  # what the launcher does before loading its kernels
    row_args = dict(logits_ptr="*fp32", temp_ptr="*fp32", thr_ptr="*fp32", u_ptr="*fp32", peaks_ptr="*fp32",
                    sums_ptr="*fp32", out_ptr="*i64")
    for kernel in fused_draw._load_kernels():
        for has_temp, has_thr in ((False, False), (True, False), (True, True)):
            sizes = dict(HAS_TEMP=has_temp, HAS_THR=has_thr, BLOCK_V=fused_draw.BLOCK,
                         CHUNK_BLOCKS=fused_draw.CHUNK_BLOCKS)
            if "NCH" in kernel.arg_names:
                sizes["NCH"] = 16  # Qwen3's 10 chunks
            compile_kernel(kernel, {k: v for k, v in row_args.items() if k in kernel.arg_names}, sizes,
                           num_warps=fused_draw.NUM_WARPS, divisible=("logits_ptr", "stride", "n_cols"))

if __name__ == "__main__":
    if interpreter_enabled():
        sys.exit("run with TRITON_INTERPRET=0: interpreter-mode kernels cannot be compiled")
    print(f"triton {triton.__version__}, target {H100}")
    check_moe_experts()
    check_paged_decode()
    check_device_wait()
    check_fused_tails()
    check_fused_draw()
