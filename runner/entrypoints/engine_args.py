"""The engine's flags (vLLM's names over RunnerConfig) and the checks made before any rank starts, shared by
``generate``, ``bench`` and ``serve``.

Flags default to ``None`` so "not given" is visible: RunnerConfig's own defaults apply, and
``--all2all-backend`` becomes ``auto`` when DP > 1 with expert parallelism. Every bad value exits with code 2
and ``argument --flag: ...``.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cudagraph.sizes import parse_cuda_graph_sizes
from runner.batch_defaults import BATCH_FIELDS, UsageContext, with_batch_defaults
from runner.config import (
    ATTENTION_BACKENDS,
    DBO_COST_MODELS,
    DBO_DP_RULES,
    DBO_SCHEDULES,
    DTYPES,
    LOAD_FORMATS,
    UBATCH_SPLITS,
    ConfigError,
    RunnerConfig,
    all2all_backends,
    config_fields,
    experts_backends,
    fused_tails_choices,
    make_config,
)
from runner.distributed.device import DEVICE_CHOICES
from runner.engine.generation_config import GenerationConfig
from runner.entrypoints.tokenizer_args import add_tokenizer_arg
from runner.entrypoints.vllm_engine_args import add_vllm_engine_args, check_vllm_flags, rename_vllm_engine_args

if TYPE_CHECKING:
    from runner.models.configs import BaseMoEConfig  # imports torch: not at module load


def _cuda_graph_sizes(text: str) -> list[int]:
    try:
        return parse_cuda_graph_sizes(text)
    except ValueError as e:  # argparse would print only "invalid value" for a plain ValueError
        raise argparse.ArgumentTypeError(str(e)) from None


def _default_max_model_len() -> int:
    from runner.worker.model_runner import DEFAULT_MAX_MODEL_LEN  # where the engine applies it

    return DEFAULT_MAX_MODEL_LEN


def add_model_positional(p: argparse.ArgumentParser, required: bool = False) -> None:
    """``MODEL`` as the first positional argument (vLLM's ``vllm serve MODEL``); ``--model`` also works."""
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="a local HF checkpoint directory or a built-in "
                   "model (tiny-qwen3-moe, tiny-deepseek-v3, bench-qwen3-moe-120m, ...); --model also works "
                   + ("(required: default none)" if required else f"(default: {RunnerConfig().model})"))


def resolve_model_arg(args: argparse.Namespace, parser: argparse.ArgumentParser, required: bool) -> None:
    """``args.model`` from the positional ``MODEL`` or ``--model`` (both: they must agree); exit 2 when
    ``required`` and neither is given."""
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"argument --model: {args.model!r} differs from the positional MODEL {args.model_tag!r}")
    args.model = args.model_tag or args.model
    if args.model is None and required:
        parser.error("the following arguments are required: MODEL (or --model)")


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    """The engine flags; ``model_required``: no built-in default model (``serve``)."""
    g = p.add_argument_group("engine (vLLM names)")
    add = g.add_argument
    add("--model", help="a local HF directory or a built-in model (tiny-qwen3-moe, tiny-deepseek-v3, ...); "
        + ("required, here or as the positional MODEL (default: none)" if model_required
           else f"also the positional MODEL (default: {RunnerConfig().model})"))
    add("--dtype", choices=sorted(set(DTYPES) | {"half", "float", "bf16", "fp16", "fp32"}),
        help="default auto: the checkpoint's dtype; a float32 checkpoint runs in bfloat16 on a GPU")
    add("--quantization", "-q", metavar="METHOD",
        help="fp8: an FP8 checkpoint runs as it is (also without this flag); an unquantized one is quantized per "
             "128x128 block while loading (default: none)")
    add("--load-format", choices=LOAD_FORMATS,
        help="auto or safetensors: the checkpoint's weights; dummy: random weights from config.json alone, on the "
             "device, nothing read from disk (vLLM's, for benchmarks) (default: auto)")
    add("--data-parallel-size", "-dp", type=int, metavar="N",
        help="DP ranks (spawned here unless under torchrun, where it is the world size)")
    add("--enable-expert-parallel", action="store_true", default=None,
        help="spread experts over the DP ranks (default: off, every rank holds every expert)")
    add("--enable-dbo", action="store_true", default=None,
        help="dual-batch overlap: run steps as two ubatches (default: off)")
    add("--dbo-decode-token-threshold", type=int, metavar="N",
        help="a decode step ubatches only with at least this many tokens on the largest DP rank (default: "
             f"{RunnerConfig().dbo_decode_token_threshold}, vLLM's: at most every default --max-num-seqs)")
    add("--dbo-prefill-token-threshold", type=int, metavar="N",
        help="a step with prefill ubatches only with at least this many tokens on the largest DP rank (default: "
             f"{RunnerConfig().dbo_prefill_token_threshold}, vLLM's: at most every default "
             "--max-num-batched-tokens)")
    add("--ubatch-split", choices=UBATCH_SPLITS,
        help="where a step is cut in two: tokens (vLLM: at half the padded tokens) or balanced (SGLang TBO: "
             "balance the ubatches' attention work)")
    add("--dbo-cost-model", choices=DBO_COST_MODELS,
        help="measured: above the thresholds, ubatch only the step sizes where measured steps show DBO is "
             "faster (each side is tried, the loser re-checked now and then); off: the thresholds alone")
    add("--dbo-schedule", choices=DBO_SCHEDULES,
        help="where the two ubatches yield: moe (inside the MoE kernel only, vLLM's DBO) or deepseek "
             "(DeepSeek's decode pipeline: SHARED/ATTN-0/MLP/ATTN-1 stages, yields inside attention; "
             "DeepSeek-V2/V3 models; prefill steps keep moe)")
    add("--dbo-dp-rule", choices=DBO_DP_RULES,
        help="how DP ranks agree to ubatch: sglang (idle or small ranks never veto; the largest rank decides) "
             "or vllm (all ranks must vote yes)")
    add("--tbo-token-distribution-threshold", type=float, metavar="T",
        help="with --ubatch-split balanced: SGLang's two-chunk split applies when one ubatch would hold less than "
             "this share of the tokens (0 disables it)")
    add("--all2all-backend", choices=all2all_backends(),
        help="default: auto with DP > 1 and --enable-expert-parallel (high-throughput layout for prefill steps, "
             "low-latency for decode: DeepEP V2 where deep_ep with ElasticBuffer imports on a GPU, else "
             "torch_ht/torch_ll; auto_torch and auto_deepep_v1 name a pair), else none")
    add("--experts-backend", choices=experts_backends(),
        help="auto (default): grouped_mm (torch._grouped_mm, CUDA-graph capturable) on a compute capability "
             "9.x/10.x GPU, torch elsewhere")
    add("--attention-backend", choices=ATTENTION_BACKENDS,
        help="auto: triton (paged decode kernel, SDPA prefill) on CUDA, torch (plain reference) on CPU")
    add("--fused-tails", choices=fused_tails_choices(),
        help="the residual add with its RMSNorm, q/k RMSNorm with RoPE, the router's top-k and the sampler's draw "
             "as fused Triton kernels: auto (on CUDA where Triton imports, torch ops elsewhere), on (an error "
             "without CUDA and Triton), off (torch ops)")
    add("--emulate-link", metavar="SPEC", help="model the interconnect, e.g. latency_us=50,gbps=10 "
        "(default: none, the all-to-alls cost what they cost)")
    add("--emulate-device", metavar="SPEC",
        help="give every step an asynchronous device time of step_us + us_per_token x tokens, e.g. "
             "step_us=3000,us_per_token=0, for machines without a GPU (default: none; the overlap loop is the "
             "default with it)")
    add("--max-num-seqs", type=int, metavar="N",
        help="most requests in one step; default (vLLM's rule): on a GPU of >= 70 GiB other than an A100 1024, "
             "on another GPU 256; on the CPU, or with experts over DP ranks and no --max-dispatch-tokens-per-rank, "
             "64; then at most --max-num-batched-tokens")
    add("--max-num-batched-tokens", type=int, metavar="N",
        help="most tokens in one step (per DP rank); default (vLLM's rule): on a GPU of >= 70 GiB other than an "
             "A100 16384 for generate and bench, 8192 for serve; on another GPU 8192 for generate and bench, "
             "2048 for serve; on the CPU, or with experts over DP ranks and no --max-dispatch-tokens-per-rank "
             "(whose all-to-all buffers it sizes), 512; then at most --max-num-seqs x --max-model-len")
    add("--max-model-len", type=int, metavar="N",
        help=f"default: the model's max_position_embeddings, capped at {_default_max_model_len()}; a value above "
             "max_position_embeddings is rejected")
    add("--block-size", type=int, metavar="N", help="tokens per KV-cache block")
    add("--num-kv-blocks", type=int, metavar="N", help="default: sized for --max-num-seqs requests")
    add("--num-gpu-blocks-override", type=int, metavar="N", help="vLLM's name of --num-kv-blocks (default: none)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="reuse the KV blocks of a prompt prefix computed before (full blocks, found by a hash of their "
             "tokens); --no-enable-prefix-caching computes every prompt in full (default: on)")
    add("--gpu-memory-utilization", type=float, metavar="F",
        help="share of the GPU's memory for weights, activations, CUDA graphs and the KV cache when "
             "--num-kv-blocks is not given (default 0.9); ignored on CPU")
    add("--max-dispatch-tokens-per-rank", type=int, metavar="N", help="default: --max-num-batched-tokens")
    add("--enforce-eager", action="store_true", default=None,
        help="never capture CUDA graphs (default: off; graphs are captured on a GPU)")
    add("--cuda-graph-sizes", type=_cuda_graph_sizes, metavar="SIZES",
        help="decode batch sizes to capture, e.g. '1,2,4,8' (one value N: the ladder up to N); GPU only; default: "
             "a vLLM-like ladder up to --max-num-seqs")
    add("--disable-overlap-schedule", action="store_true", default=None,
        help="run one step at a time (default on a GPU: off, the host schedules step N+1 while step N runs; on "
             "the CPU, where that loses to the GIL, one step at a time)")
    add("--disable-consecutive-prefill-overlap", action="store_true", default=None,
        help="a prefill step waits for the previous prefill step's results, for time to first token "
             "(default: off)")
    add("--enable-single-batch-overlap", action="store_true", default=None,
        help="SGLang's single-batch overlap: the dispatch overlaps the shared experts (default: off)")
    add("--dist-timeout-s", type=float, metavar="S",
        help="timeout of every collective, and how long a spawned rank may send no heartbeat before it is named "
             "as having stopped responding")
    add("--seed", type=int, help="run seed: random sampling of prompt i without a seed of its own uses "
        "seed * 1000003 + i")
    add("--device", choices=DEVICE_CHOICES,
        help="where the ranks run: auto (CUDA when available, NCCL: one GPU per rank on a host), cuda, or cpu "
             "(gloo, nothing touches CUDA; any number of DP ranks on one machine)")
    add("--cache-dir", metavar="DIR", help="where built-in models are written; default: $UBATCH_CACHE_DIR or "
        "~/.cache/ubatch")
    add("--trace-file", metavar="PATH", help="write a per-ubatch timeline (Chrome trace JSON, one pid per DP rank) "
        "and print its overlap metrics; with bench, of the DBO-on run (default: none; its directory must exist)")
    add("--generation-config", metavar="auto|vllm|DIR",
        help="auto: the model's generation_config.json gives the EOS ids and the defaults of the sampling flags "
             "not given; vllm: ignore it; DIR: that directory's generation_config.json")
    defaults = RunnerConfig()
    for action in g._group_actions:  # show RunnerConfig's defaults (argparse's own are None: "not given")
        value = getattr(defaults, action.dest, None)
        shown = "default:" in (action.help or "") or "(default" in (action.help or "")
        if value is not None and not isinstance(value, bool) and not shown:
            action.help = f"{action.help + '; ' if action.help else ''}default: {value}"
    add_vllm_engine_args(p)
    add_tokenizer_arg(p)


@dataclass
class ModelInfo:
    vocab_size: int
    has_tokenizer: bool
    generation_config: GenerationConfig
    max_model_len: int  # the engine's: --max-model-len, else max_position_embeddings capped at the default


def model_info(cfg: RunnerConfig) -> ModelInfo:
    """Checked before any rank starts: the config, every checkpoint file's header, ``max_model_len`` against
    the model, the DBO schedule, the generation config. No weight is read."""
    from runner.engine.generation_config import load_generation_config, model_eos_token_ids
    from runner.engine.tokenizer import has_tokenizer_files
    from runner.models.loader import check_checkpoint_files, check_max_model_len, load_config, resolve_model_path
    from runner.models.registry import get_model_class
    from runner.models.schedules import check_schedule
    from runner.worker.model_runner import engine_max_model_len

    path = resolve_model_path(cfg.model, cfg.cache_dir)
    config = load_config(path)
    check_checkpoint_files(path)
    # the engine's default too, so that a model refusing it (a short sliding window) fails before any rank starts
    max_model_len = engine_max_model_len(cfg.max_model_len, config)
    check_max_model_len(max_model_len, config)
    check_expert_parallel(cfg, config)
    model_class = get_model_class(config.architectures[0])
    check_schedule(cfg.dbo_schedule, model_class.supported_dbo_schedules, model_class.__name__)
    try:
        generation = load_generation_config(path, cfg.generation_config, model_eos_token_ids(config))
    except ValueError as e:
        raise ConfigError("generation_config", str(e)) from None
    return ModelInfo(config.vocab_size, has_tokenizer_files(path), generation, max_model_len)


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RunnerConfig:
    """The engine flags as a validated RunnerConfig; a bad value exits 2 naming its flag."""
    from runner.distributed.launch import torchrun_env_present

    check_vllm_flags(args, parser)
    values = dict(vars(args))
    try:
        rename_vllm_engine_args(values)
    except ConfigError as e:
        parser.error(f"argument {e.flag}: {e}")
    engine = {k: v for k, v in values.items() if k in config_fields() and v is not None}
    if torchrun_env_present():  # under torchrun: one DP rank per process
        world = int(os.environ["WORLD_SIZE"])
        if engine.setdefault("data_parallel_size", world) != world:
            parser.error(f"argument --data-parallel-size: {engine['data_parallel_size']} does not match torchrun's "
                         f"WORLD_SIZE={world} (omit it under torchrun)")
    try:
        cfg = make_config(**engine)
        check_deep_ep_installed(cfg)
    except ConfigError as e:
        parser.error(f"argument {e.flag}: {e}")
    return cfg


def with_batch_defaults_from_args(cfg: RunnerConfig, args: argparse.Namespace, max_model_len: int,
                                  context: UsageContext) -> RunnerConfig:
    """``cfg`` with ``--max-num-seqs`` / ``--max-num-batched-tokens``, where not given, set to vLLM's defaults for
    this device and ``context`` (``runner/batch_defaults.py``); ``max_model_len``: the engine's (``ModelInfo``)."""
    given = [f for f in BATCH_FIELDS if getattr(args, f, None) is not None]
    return with_batch_defaults(cfg, given, max_model_len, context)


DEEP_EP_BACKENDS = ("deepep_low_latency", "deepep_high_throughput", "deepep_v2", "auto_deepep_v1")


def check_deep_ep_installed(cfg: RunnerConfig) -> None:
    """A DeepEP backend named with expert parallelism needs the ``deep_ep`` package: ``ConfigError`` before any
    rank starts, not an ImportError in every rank (whether it has V2's ``ElasticBuffer`` and a GPU to run on is
    the rank's check: it means importing DeepEP)."""
    import importlib.util

    if cfg.ep_size > 1 and cfg.all2all_backend in DEEP_EP_BACKENDS and importlib.util.find_spec("deep_ep") is None:
        raise ConfigError("all2all_backend", f"all2all_backend {cfg.all2all_backend!r} needs DeepEP (the 'deep_ep' "
                                             "package), which is not installed here; install it (pip install "
                                             "sgl-deep-ep, CUDA GPUs) or choose auto, auto_torch, torch_ll or torch_ht")


def check_expert_parallel(cfg: RunnerConfig, config: BaseMoEConfig) -> None:
    """The model's routed experts split evenly over the expert-parallel ranks (``ConfigError`` naming
    ``--data-parallel-size`` otherwise): checked here so it is refused before any rank starts."""
    from runner.models.configs import DeepseekV2Config
    from runner.models.standard_configs import StandardConfig

    if isinstance(config, StandardConfig):
        experts = config.num_experts
    elif isinstance(config, DeepseekV2Config):
        experts = config.n_routed_experts
    else:
        return  # another family: its layers check it when they are built
    if cfg.ep_size > 1 and experts and experts % cfg.ep_size:
        divisors = [d for d in range(2, experts + 1) if experts % d == 0]
        raise ConfigError("data_parallel_size", f"the model's {experts} experts cannot be spread evenly over "
                                                f"{cfg.ep_size} expert-parallel ranks (num_experts={experts} is not "
                                                f"divisible by ep_size={cfg.ep_size}); use a --data-parallel-size "
                                                f"that divides it ({', '.join(map(str, divisors))}), or drop "
                                                "--enable-expert-parallel")


def model_info_or_exit(cfg: RunnerConfig, parser: argparse.ArgumentParser) -> ModelInfo:
    """:func:`model_info`, with every problem an exit 2 naming the flag at fault."""
    from runner.models.loader import CacheDirError

    try:
        return model_info(cfg)
    except CacheDirError as e:
        parser.error(f"argument --cache-dir: {e}")
    except ConfigError as e:
        parser.error(f"argument {e.flag}: {e}")
    except (OSError, ValueError) as e:
        parser.error(f"argument --model: {e}")
