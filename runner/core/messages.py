"""The messages between the engine client and the per-rank engine-core processes, encoded with msgspec's
msgpack (vLLM V1's choice: typed, fast, no pickle from the network side).

Clients -> rank ``r`` (rank ``r`` binds one PULL socket; every client, one per API-server process, connects a
PUSH to it): :class:`AddRequest` (or :class:`AddRequests`), :class:`AbortRequests`, :class:`Wake`,
:class:`Shutdown`, :class:`ResetPrefixCache`. Every rank ->
client ``c`` (client ``c`` binds one PULL socket; every rank connects a PUSH to it): :class:`Ready` once
loaded, :class:`Outputs` after steps (the outputs of the requests client ``c`` sent, with the rank's stats),
:class:`PrefixCacheReset` answering that client's :class:`ResetPrefixCache`,
:class:`WaveStarted` / :class:`WaveDone` (see ``runner/core/engine_core_proc.py`` for the wave protocol),
:class:`CoreFailed` when the rank's loop raised. A request carries the index of the client that sent it, and
the rank sends its outputs to that client only (vLLM's ``client_index``).
"""
from __future__ import annotations

import msgspec
import numpy as np

from runner.core.logprob_rows import LogprobTokens
from runner.core.requests import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


class CoreInfo(msgspec.Struct):
    """What the client needs to know of a loaded rank."""

    rank: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    dtype: str  # what the model computes in: "bfloat16", "float32", ...
    experts_backend: str  # the MoE experts' kernels the rank resolved ("auto" -> "triton", ...)


class DBOBucketStat(msgspec.Struct):
    """One bucket of a rank's measured DBO cost model (``runner.worker.dbo_cost_model.BucketDecision``)."""

    bucket: str  # "decode 256-511 tok replayed"
    dbo_on: bool
    speedup: float  # DBO off time / on time per token (> 1: DBO is faster)


class CoreStats(msgspec.Struct):
    """A rank's load and DBO counters, sent with its outputs."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_steps: int = 0
    num_ubatched_steps: int = 0
    comm_s: float = 0.0  # modelled all-to-all time in flight (emulated link, CPU)
    comm_exposed_s: float = 0.0  # of which a ubatch waited for it
    dbo_buckets: list[DBOBucketStat] = []  # the measured DBO cost model's buckets that ran both ways
    num_preemptions: int = 0  # requests preempted (recomputed) so far
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests looked up in the prefix cache, cumulative
    prefix_cache_hits: int = 0  # of which found there (their KV reused), cumulative


# ---- client -> rank ---------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest
    client_index: int = 0  # which client's output socket gets this request's outputs


class AddRequests(msgspec.Struct, tag="add_many"):
    """Several requests at once, all added before the rank steps again: a batch handed over together (the offline
    client's) starts in the same step on every rank, as it would in one process; an API server's engine client
    sends the requests it took in one event-loop turn this way (one message instead of one per request)."""

    requests: list[EngineCoreRequest]
    client_index: int = 0


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[int]


class Wake(msgspec.Struct, tag="wake"):
    """Some rank started wave ``wave``: every rank must step in it (the DP collectives pair up)."""

    wave: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Leave the loop once the current wave (if any) has ended, so no peer is left alone in a collective."""


class StartProfile(msgspec.Struct, tag="start_profile"):
    """Start recording this rank's timeline (``runner/tracing.py``) until :class:`StopProfile`."""


class StopProfile(msgspec.Struct, tag="stop_profile"):
    """Stop recording and send the spans back (:class:`Profile`) to client ``client_index``."""

    client_index: int = 0


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    """Drop every cached prefix block (vLLM's ``reset_prefix_cache``); answered to client ``client_index`` with
    :class:`PrefixCacheReset`."""

    client_index: int = 0


InputMessage = AddRequest | AddRequests | AbortRequests | Wake | Shutdown | StartProfile | StopProfile | \
    ResetPrefixCache


# ---- rank -> client ---------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    info: CoreInfo


class Outputs(msgspec.Struct, tag="outputs"):
    """A rank's outputs for one client (``requests.EngineCoreOutputs``): the plain tokens as two arrays of
    little-endian int64 in bytes (request ids, token ids; ``np.frombuffer`` reads them without a copy), the
    tokens with log-probabilities as arrays too (a ``LogprobTokens`` per step), then one array-like struct per
    other output (values only, no field names)."""

    rank: int
    outputs: list[EngineCoreOutput]
    stats: CoreStats
    token_request_ids: bytes = b""
    token_ids: bytes = b""
    logprob_tokens: list[LogprobTokens] = []

    @classmethod
    def of(cls, rank: int, outputs: EngineCoreOutputs, stats: CoreStats) -> Outputs:
        return cls(rank, outputs.outputs, stats, _int64_bytes(outputs.request_ids), _int64_bytes(outputs.token_ids),
                   outputs.logprob_tokens)

    @property
    def has_array_tokens(self) -> bool:
        return bool(self.token_ids) or bool(self.logprob_tokens)

    def engine_core_outputs(self, outputs: list[EngineCoreOutput] | None = None) -> EngineCoreOutputs:
        """The outputs as the engine core made them (``outputs``: these structs instead of the message's)."""
        return EngineCoreOutputs(self.outputs if outputs is None else outputs,
                                 np.frombuffer(self.token_request_ids, dtype=INT64),
                                 np.frombuffer(self.token_ids, dtype=INT64), self.logprob_tokens)


INT64 = np.dtype("<i8")


def _int64_bytes(a: np.ndarray) -> bytes:
    return a.astype(INT64, copy=False).tobytes()


class WaveStarted(msgspec.Struct, tag="wave_started"):
    """Rank ``rank`` got work while idle and started wave ``wave``: the client wakes every rank for it."""

    rank: int
    wave: int


class WaveDone(msgspec.Struct, tag="wave_done"):
    """No rank had work in the last step of wave ``wave``; rank ``rank`` is idle."""

    rank: int
    wave: int


class CoreFailed(msgspec.Struct, tag="failed"):
    rank: int
    message: str


class Profile(msgspec.Struct, tag="profile"):
    """A rank's recorded timeline: a pickled ``runner.tracing.RankTrace`` (None when nothing was recording).
    Pickle, not msgpack: it only ever travels between this server's own processes, over a private socket."""

    rank: int
    payload: bytes


class PrefixCacheReset(msgspec.Struct, tag="prefix_cache_reset"):
    """Rank ``rank``'s answer to :class:`ResetPrefixCache`: ``reset`` is False when requests held KV blocks
    (nothing was dropped)."""

    rank: int
    reset: bool


OutputMessage = Ready | Outputs | WaveStarted | WaveDone | CoreFailed | Profile | PrefixCacheReset

ENCODER = msgspec.msgpack.Encoder()
INPUT_DECODER = msgspec.msgpack.Decoder(InputMessage)
OUTPUT_DECODER = msgspec.msgpack.Decoder(OutputMessage)
