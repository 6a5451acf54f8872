"""vLLM's engine arguments that this engine has no use for, accepted where their value asks for nothing it
cannot do, and refused otherwise with what to use instead; and those that name one of this engine's settings
differently (``num_gpu_blocks_override`` is ``num_kv_blocks``).

vLLM scripts pass ``trust_remote_code=True``, ``tensor_parallel_size=1``, ``enable_chunked_prefill=True`` and
the like routinely; ``LLM(...)`` and every CLI take them (``check_vllm_engine_args``) so such a script runs
as written. A value the engine cannot honour (``tensor_parallel_size=2``, ``kv_cache_dtype="fp8"``) raises
:class:`~runner.config.ConfigError` naming the argument, its value and the alternative, rather than being
silently ignored.
"""
from __future__ import annotations

import argparse
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runner.config import ConfigError


def _any_bool(value: object) -> bool:
    return isinstance(value, bool)


def _one(value: object) -> bool:
    return value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == 1)


def _non_negative_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) >= 0


def _none_or(*allowed: object) -> Callable[[object], bool]:
    return lambda value: value is None or value in allowed


@dataclass(frozen=True)
class VllmEngineArg:
    """One vLLM engine argument with no effect here: which values are accepted, and what to do instead."""

    name: str
    accepts: Callable[[object], bool]
    accepted: str  # the accepted values, in words
    instead: str  # what a user wanting another value should do


EP_INSTEAD = ("this engine does not shard layers over GPUs; use data_parallel_size=N (--data-parallel-size N) with "
              "enable_expert_parallel=True to spread a MoE model's experts over N GPUs")

VLLM_ENGINE_ARGS: tuple[VllmEngineArg, ...] = (
    VllmEngineArg("trust_remote_code", _any_bool, "True or False (no checkpoint code is ever run: the model "
                  "classes are this engine's own)", "pass a bool"),
    VllmEngineArg("tensor_parallel_size", _one, "1", EP_INSTEAD),
    VllmEngineArg("pipeline_parallel_size", _one, "1", EP_INSTEAD),
    VllmEngineArg("swap_space", _non_negative_number, "any size >= 0 (preempted requests are recomputed, never "
                  "swapped to CPU memory)", "pass a size in GiB >= 0"),
    VllmEngineArg("kv_cache_dtype", _none_or("auto"), "'auto' (the KV cache is kept in the model's dtype)",
                  "leave it 'auto'; dtype=... sets the model's and the KV cache's dtype together"),
    VllmEngineArg("disable_log_stats", _any_bool, "True or False (this engine logs no periodic stats)",
                  "pass a bool"),
    VllmEngineArg("enable_chunked_prefill", _none_or(True), "True (prefills are always chunked at "
                  "max_num_batched_tokens)", "raise max_num_batched_tokens to max_model_len so every prompt "
                  "prefills in one step"),
    VllmEngineArg("revision", _none_or(), "None (checkpoints are local directories or built-in models)",
                  "check the revision out into a local directory and pass that as the model"),
    VllmEngineArg("download_dir", _none_or(), "None (nothing is downloaded: checkpoints are local directories)",
                  "pass a local checkpoint directory as the model; cache_dir=... sets where built-in models are "
                  "written"),
    VllmEngineArg("tokenizer_mode", _none_or("auto"), "'auto' (transformers' tokenizer of the checkpoint)",
                  "leave it 'auto'"),
    VllmEngineArg("disable_custom_all_reduce", _any_bool, "True or False (there is no custom all-reduce)",
                  "pass a bool"),
    VllmEngineArg("distributed_executor_backend", _none_or("mp", "external_launcher"),
                  "None or 'mp' (DP ranks are processes the LLM starts, or the ranks of a torchrun world it runs "
                  "in), or 'external_launcher' (the ranks of a torchrun world only)",
                  "leave it unset; DP ranks run as processes (or under torchrun)"),
)
VLLM_ENGINE_ARG_NAMES = frozenset(a.name for a in VLLM_ENGINE_ARGS)
# vLLM's names of this engine's settings: vLLM's engine argument -> the RunnerConfig field it sets
VLLM_RENAMED_ARGS = {"num_gpu_blocks_override": "num_kv_blocks"}


def rename_vllm_engine_args(values: dict[str, Any]) -> None:
    """In place: each of vLLM's names in ``values`` (:data:`VLLM_RENAMED_ARGS`) becomes this engine's field; a
    None value is "not given". Both names given with different values: ``ConfigError`` naming both."""
    for vllm_name, name in VLLM_RENAMED_ARGS.items():
        value = values.pop(vllm_name, None)
        if value is None:
            continue
        if values.get(name) is not None and values[name] != value:
            raise ConfigError(vllm_name, f"{vllm_name}={value!r} and {name}={values[name]!r} set the same thing "
                                         "(vLLM's name and this engine's): give one")
        values[name] = value


def check_vllm_engine_args(values: dict[str, object]) -> None:
    """Every vLLM-only argument in ``values`` has an accepted value; ``ConfigError`` naming the first that has
    not (its ``flag`` is the CLI spelling)."""
    for arg in VLLM_ENGINE_ARGS:
        if arg.name in values and not arg.accepts(values[arg.name]):
            raise ConfigError(arg.name, f"{arg.name}={values[arg.name]!r} is not supported by this engine (accepted: "
                                        f"{arg.accepted}); {arg.instead}")


def pop_vllm_engine_args(kwargs: dict[str, Any]) -> None:
    """Check and remove the vLLM-only arguments from ``LLM(**kwargs)`` (``check_vllm_engine_args``), and give
    vLLM's names of this engine's settings their names here (``rename_vllm_engine_args``)."""
    check_vllm_engine_args({k: v for k, v in kwargs.items() if k in VLLM_ENGINE_ARG_NAMES})
    for name in VLLM_ENGINE_ARG_NAMES:
        kwargs.pop(name, None)
    rename_vllm_engine_args(kwargs)


def add_vllm_engine_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for the arguments above (``--tensor-parallel-size/-tp``, ...), default None: not given."""
    g = p.add_argument_group("vLLM flags this engine has no use for (accepted at their no-op values, refused "
                             "otherwise)")
    add = g.add_argument
    add("--trust-remote-code", action="store_true", default=None,
        help="accepted: no checkpoint code is run (default: off)")
    add("--tensor-parallel-size", "-tp", type=int, metavar="N", help="1 only: use --data-parallel-size with "
        "--enable-expert-parallel (default: 1)")
    add("--pipeline-parallel-size", "-pp", type=int, metavar="N", help="1 only (default: 1)")
    add("--swap-space", type=float, metavar="GIB", help="accepted: preempted requests are recomputed (default: 4)")
    add("--kv-cache-dtype", metavar="DTYPE", help="auto only: the KV cache is in the model's dtype (default: auto)")
    add("--disable-log-stats", action="store_true", default=None,
        help="accepted: no periodic stats are logged (default: off)")
    add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="prefills are always chunked, --no-enable-chunked-prefill is refused (default: on)")
    add("--revision", metavar="REV", help="none only: checkpoints are local directories (default: none)")
    add("--download-dir", metavar="DIR", help="none only: nothing is downloaded (default: none)")
    add("--tokenizer-mode", metavar="MODE", help="auto only (default: auto)")
    add("--disable-custom-all-reduce", action="store_true", default=None,
        help="accepted: there is no custom all-reduce (default: off)")
    add("--distributed-executor-backend", metavar="BACKEND", help="mp: DP ranks are processes this command starts; "
        "external_launcher (generate, bench): each process of a torchrun world is one rank (default: mp)")


def check_vllm_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The flags of :func:`add_vllm_engine_args`; a refused value exits 2 naming its flag."""
    given = {a.name: getattr(args, a.name) for a in VLLM_ENGINE_ARGS if getattr(args, a.name, None) is not None}
    try:
        check_vllm_engine_args(given)
    except ConfigError as e:
        parser.error(f"argument {e.flag}: {e}")
