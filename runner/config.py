"""RunnerConfig: every engine setting the CLI exposes, under vLLM's names, validated in one place.

Validation lives here (not in argparse) so the Python API (``LLM(**kwargs)``) and the CLI reject the same
bad values with the same message. Errors are :class:`ConfigError` (a ``ValueError``) carrying the field name,
which the CLI turns into an argparse-style ``argument --flag-name: ...`` message with exit code 2.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UBATCH_SPLITS = ("tokens", "balanced")
DBO_DP_RULES = ("sglang", "vllm")  # runner.distributed.dp: how DP ranks agree to ubatch
DBO_COST_MODELS = ("measured", "off")  # runner.worker.dbo_cost_model: above the thresholds, ubatch only where it pays
# runner.models.schedules: where the two ubatches yield. "moe": inside the MoE kernel only (vLLM's DBO);
# "deepseek": DeepSeek's decode pipeline (yields inside attention too) on decode steps, "moe" on prefill.
DBO_SCHEDULES = ("moe", "deepseek")
# runner.attention.backends: auto = triton (paged decode kernel + SDPA prefill) on CUDA, torch on CPU
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# vLLM accepts these spellings for --dtype; they are normalised to "auto" (the checkpoint's torch_dtype; a float32
# checkpoint runs in bfloat16 on a GPU: runner.models.loader.auto_dtype) or a name such that
# ``getattr(torch, cfg.dtype)`` works.
DTYPE_ALIASES = {"auto": "auto", "float32": "float32", "float": "float32", "fp32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "half": "float16", "fp16": "float16"}
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("fp8",)  # --quantization (runner/models/quantization/scheme.py)
# --load-format: the checkpoint's safetensors ("auto", "safetensors"), or random weights from config.json alone
# ("dummy", vLLM's, for benchmarks: runner/models/dummy_weights.py)
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# DP > 1 with expert parallelism needs a real all-to-all; this is what the CLI and LLM() pick when unset: the
# phase-aware one (SGLang's default ``--deepep-mode auto``), high-throughput layout for prefill, low-latency
# for decode.
DEFAULT_EP_ALL2ALL_BACKEND = "auto"


def all2all_backends() -> tuple[str, ...]:
    from ubatch.modular_moe.prepare_finalize import ALL2ALL_CHOICES  # imports torch: keep it out of module load

    return tuple(ALL2ALL_CHOICES)


def experts_backends() -> tuple[str, ...]:
    from ubatch.modular_moe.experts import EXPERTS_CHOICES  # "auto" and every backend

    return tuple(EXPERTS_CHOICES)


def fused_tails_choices() -> tuple[str, ...]:
    from ubatch.fused_tails import FUSED_TAILS_CHOICES  # imports torch: keep it out of module load

    return FUSED_TAILS_CHOICES


def _check_device(value: Any) -> None:
    """A known choice, and ``cuda`` only where CUDA is available (an error here is before any rank starts)."""
    from runner.distributed.device import DEVICE_CHOICES, DeviceUnavailableError, resolve_device_type

    _choice("device", value, DEVICE_CHOICES)
    if value == "cuda":
        try:
            resolve_device_type(value)
        except DeviceUnavailableError as e:
            raise ConfigError("device", str(e)) from None


def check_gpu_memory_utilization(u: Any) -> None:
    """``--gpu-memory-utilization`` is a share of the GPU's memory: ``ValueError`` naming the value otherwise."""
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1] (a share of the GPU's memory), got {u!r}")


def _check_generation_config(value: Any) -> None:
    """``auto``, ``vllm``, or a directory with a generation_config.json (vLLM's three forms)."""
    if value in ("auto", "vllm"):
        return
    if not isinstance(value, str) or not value:
        raise ConfigError("generation_config",
                          f"generation_config must be 'auto', 'vllm' or a directory, got {value!r}")
    if not (Path(value) / "generation_config.json").is_file():
        raise ConfigError("generation_config", f"generation_config {value!r} is neither 'auto', 'vllm' nor a "
                                               "directory holding a generation_config.json")


def _check_fused_tails(value: Any, device: str) -> None:
    """A known choice, and ``on`` only where the kernels can run: the ranks' device is CUDA and Triton imports."""
    from ubatch.fused_tails import resolve_fused_tails

    _choice("fused_tails", value, fused_tails_choices())
    if value == "on":
        from runner.distributed.device import resolve_device_type

        try:
            resolve_fused_tails(value, resolve_device_type(device))
        except ValueError as e:
            raise ConfigError("fused_tails", str(e)) from None


class ConfigError(ValueError):
    """A bad setting; ``field`` is the RunnerConfig field (``flag`` its CLI spelling) so callers can point at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


def _int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(name, f"{name} must be >= {minimum}, got {value}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class RunnerConfig:
    """Everything one engine rank needs; field names are vLLM's flag names with ``_`` for ``-``."""

    model: str = "tiny-qwen3-moe"
    dtype: str = "auto"  # the checkpoint's dtype; float32 checkpoints run bf16 on a GPU (vLLM's auto)
    # None | "fp8": an FP8 checkpoint runs as it is either way; "fp8" quantises an unquantised one while loading
    quantization: str | None = None
    load_format: str = "auto"  # LOAD_FORMATS
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    ubatch_split: str = "tokens"  # "tokens" (vLLM: cut at padded // 2) | "balanced" (SGLang TBO)
    dbo_dp_rule: str = "sglang"  # idle / small ranks never veto DBO ("sglang") | all-or-nothing ("vllm")
    dbo_cost_model: str = "measured"  # above the thresholds, ubatch where measured steps say it pays | "off"
    dbo_schedule: str = "moe"  # yields in the MoE kernel only | "deepseek": DeepSeek's decode pipeline
    tbo_token_distribution_threshold: float = 0.48
    all2all_backend: str = "none"
    # auto: on CUDA, a layer with a backend-choice table for its shape and GPU (benchmarks/tune_moe.py writes it)
    # runs the fastest measured of triton/grouped_mm per token-count bucket (experts.auto); otherwise, and for
    # device-only decisions (graph capture, SBO), grouped_mm on a 9.x/10.x GPU, else torch (resolve_experts_backend)
    experts_backend: str = "auto"
    attention_backend: str = "auto"  # auto: triton on CUDA, torch (the plain reference) on CPU
    # residual add + RMSNorm, q/k norm + RoPE and router top-k as Triton kernels: auto (on CUDA with Triton) | on | off
    fused_tails: str = "auto"
    emulate_link: str | None = None
    # runner.worker.emulated_device: every step gets an asynchronous device time of step_us + us_per_token x tokens
    emulate_device: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: enough for max_num_seqs * max_model_len
    gpu_memory_utilization: float = 0.9  # GPU without num_kv_blocks: KV gets this share less weights/activations/graphs
    enable_prefix_caching: bool = True  # reuse the KV of cached full blocks of a common prefix (vLLM V1's default)
    max_dispatch_tokens_per_rank: int | None = None  # None: derived from max_num_batched_tokens
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None  # None: a vLLM-like ladder up to --max-num-seqs
    disable_overlap_schedule: bool | None = None  # None: overlap loop on a GPU, one step at a time on the CPU
    disable_consecutive_prefill_overlap: bool = False  # a prefill step waits for the previous prefill's results
    enable_single_batch_overlap: bool = False
    dist_timeout_s: float = 120.0
    seed: int = 0
    device: str = "auto"  # runner.distributed.device: auto (CUDA when available) | cuda | cpu (gloo ranks, no CUDA)
    cache_dir: str | None = None
    trace_file: str | None = None
    # vLLM's --generation-config: "auto" (the model's generation_config.json: EOS ids, sampling defaults),
    # "vllm" (ignore it), or a directory holding the generation_config.json to use (runner/engine/generation_config.py)
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", f"model must be a non-empty name or directory, got {self.model!r}")
        dtype = DTYPE_ALIASES.get(str(self.dtype).lower()) if isinstance(self.dtype, str) else None
        if dtype is None:
            raise ConfigError("dtype", f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        self.dtype = dtype
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError("quantization", f"quantization={self.quantization!r} is not supported by this engine "
                                              "(accepted: None, or 'fp8': an FP8 checkpoint runs as it is, an "
                                              "unquantized one is quantized per 128x128 block while loading); use "
                                              "an FP8 or unquantized checkpoint")
        for name in ("data_parallel_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
                     "max_num_seqs", "max_num_batched_tokens", "block_size"):
            _int(name, getattr(self, name), 1)
        for name in ("max_model_len", "num_kv_blocks", "max_dispatch_tokens_per_rank"):
            _int(name, getattr(self, name), 1, optional=True)
        _int("seed", self.seed, 0)
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if not isinstance(sizes, (list, tuple)) or not sizes or any(
                    isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
                raise ConfigError("cuda_graph_sizes", f"cuda_graph_sizes must be a non-empty list of positive "
                                                      f"integers, got {sizes!r}")
        for name in ("enable_expert_parallel", "enable_dbo", "enforce_eager", "disable_overlap_schedule",
                     "disable_consecutive_prefill_overlap", "enable_single_batch_overlap", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool) and not (name == "disable_overlap_schedule"
                                                                  and self.disable_overlap_schedule is None):
                raise ConfigError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        _choice("load_format", self.load_format, LOAD_FORMATS)
        if self.load_format == "safetensors":  # what "auto" reads: checkpoints here are safetensors only
            self.load_format = "auto"
        _choice("ubatch_split", self.ubatch_split, UBATCH_SPLITS)
        _choice("dbo_dp_rule", self.dbo_dp_rule, DBO_DP_RULES)
        _choice("dbo_cost_model", self.dbo_cost_model, DBO_COST_MODELS)
        _choice("dbo_schedule", self.dbo_schedule, DBO_SCHEDULES)
        t = self.tbo_token_distribution_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 0.5:
            raise ConfigError("tbo_token_distribution_threshold",
                              f"tbo_token_distribution_threshold must lie in [0, 0.5] (0 disables the two-chunk "
                              f"split), got {t!r}")
        _choice("all2all_backend", self.all2all_backend, all2all_backends())
        _choice("experts_backend", self.experts_backend, experts_backends())
        _check_device(self.device)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_fused_tails(self.fused_tails, self.device)
        if self.emulate_link is not None:
            from ubatch.modular_moe.prepare_finalize.emulated_link import parse_link

            try:
                parse_link(self.emulate_link)
            except ValueError as e:
                raise ConfigError("emulate_link", f"emulate_link {self.emulate_link!r}: {e}") from None
        if self.emulate_device is not None:
            from runner.worker.emulated_device import DeviceSpec

            try:
                DeviceSpec.parse(self.emulate_device)
            except ValueError as e:
                raise ConfigError("emulate_device", f"emulate_device {self.emulate_device!r}: {e}") from None
        try:
            check_gpu_memory_utilization(self.gpu_memory_utilization)
        except ValueError as e:
            raise ConfigError("gpu_memory_utilization", str(e)) from None
        _check_generation_config(self.generation_config)
        d = self.dist_timeout_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0:
            raise ConfigError("dist_timeout_s", f"dist_timeout_s must be > 0 seconds, got {d!r}")
        if self.data_parallel_size > 1 and self.enable_expert_parallel and self.all2all_backend == "none":
            raise ConfigError(
                "all2all_backend",
                f"all2all_backend 'none' cannot move tokens between {self.data_parallel_size} expert-parallel "
                f"ranks; pick one of {', '.join(b for b in all2all_backends() if b != 'none')} "
                f"(e.g. '{DEFAULT_EP_ALL2ALL_BACKEND}'), or drop enable_expert_parallel")

    @property
    def ep_size(self) -> int:
        """Experts are spread over the DP ranks only with --enable-expert-parallel (vLLM semantics)."""
        return self.data_parallel_size if self.enable_expert_parallel else 1

    @property
    def dispatch_tokens_per_rank(self) -> int:
        """Capacity of the fixed-size all-to-all buffers: a step never has more tokens than the budget."""
        return self.max_dispatch_tokens_per_rank or self.max_num_batched_tokens

    def replace(self, **changes: Any) -> RunnerConfig:
        """A validated copy with ``changes`` applied (e.g. ``cfg.replace(enable_dbo=True)`` for a bench)."""
        return dataclasses.replace(self, **changes)


def config_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(RunnerConfig)]


def make_config(base: RunnerConfig | None = None, **kwargs: Any) -> RunnerConfig:
    """RunnerConfig from keyword arguments (on top of ``base`` if given), with defaults that depend on other fields.

    Unknown names raise ``TypeError`` with the closest field. An ``all2all_backend`` left unset (absent or None,
    and 'none' in ``base``) becomes ``auto`` when DP > 1 with expert parallelism — the CLI's rule too —
    since 'none' cannot move tokens between ranks.
    """
    fields = config_fields()
    for key in kwargs:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"unknown engine argument {key!r}{hint}")
    merged = {f: getattr(base, f) for f in fields} if base is not None else {}
    backend_given = kwargs.get("all2all_backend") is not None or merged.get("all2all_backend", "none") != "none"
    merged.update({k: v for k, v in kwargs.items() if not (k == "all2all_backend" and v is None)})
    dp = merged.get("data_parallel_size", 1)
    if not backend_given and merged.get("enable_expert_parallel") and isinstance(dp, int) and dp > 1:
        merged["all2all_backend"] = DEFAULT_EP_ALL2ALL_BACKEND
    return RunnerConfig(**merged)
