"""The decode graphs' heads: a decode step samples in one more graph launch (the eager stand-in on CPU).

After each forward graph the runner captures four heads (``runner/worker/cuda_graphs.py``): the LM head with the
greedy pick of every row, with each row's draw by its staged temperature and uniform, with that draw after each
row's top-k and top-p, and after each row's top-p alone. A decode step whose graph replayed replays the greedy head
when every row is greedy with no other option, the draw head when every row is greedy or draws with at most a
temperature, the top-k head when rows also use top-k (at most ``TOP_K_WIDTH``) with or without top-p, the top-p head
when rows also use top-p without top-k (and none top-k); any other step samples eagerly from the graph's hidden
rows.
Tokens equal a runner without graphs in every case, by hand-built steps and through ``LLM.generate``, and the
graph that served each step is recorded, not only the tokens.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from cudagraph import GraphKey
from cudagraph.backends import EagerReplayBackend
from graph_replays import install_graphs
from runner.config import RunnerConfig
from runner.core.runner_output import ModelRunnerOutput
from runner.core.scheduler_output import ScheduledChunk, SchedulerOutput
from runner.sampling_params import SamplingParams
from runner.worker import cuda_graphs
from runner.worker.model_runner import ModelRunner
from runner.worker.sampler import SamplingHead
from runner.worker.sampling_noise import INVALID_TOKEN
from runner.worker.sampling_ops import TOP_K_WIDTH
from test_graph_memory import OomAbove, oom

NUM_REQS, PROMPT, BLOCKS_PER_REQ, DECODE_STEPS = 8, 5, 8, 4
GREEDY = SamplingParams(temperature=0.0)
ALL_DECODES = [GraphKey(8)] * DECODE_STEPS


def make_runner(dtype: str = "float32", fused_draw: bool = False) -> ModelRunner:
    """On the machine's device, float32 unless asked; the torch experts (a host sync) keep the runner from
    capturing graphs of its own on a GPU too, so the eager stand-in's are the only ones (gpu-check runs this
    file). ``fused_draw``: on the CPU, under Triton's interpreter (the marked tests), its sampler, and the heads then
    captured, draw with the fused kernels, as the fused tails set it on CUDA (``test_cudagraph_cuda.py``)."""
    runner = ModelRunner(RunnerConfig(dtype=dtype, experts_backend="torch", max_num_seqs=NUM_REQS,
                                      max_model_len=BLOCKS_PER_REQ * 4, max_num_batched_tokens=64, block_size=4,
                                      num_kv_blocks=NUM_REQS * BLOCKS_PER_REQ, device="cpu" if fused_draw else "auto"))
    runner.sampler.fused_draw = fused_draw
    return runner


def chunk(i: int, tokens: list[int], computed: int, params: SamplingParams) -> ScheduledChunk:
    return ScheduledChunk(i, tokens, computed, list(range(i * BLOCKS_PER_REQ, (i + 1) * BLOCKS_PER_REQ)), True,
                          params, 1000 + i, slot=i, prompt_len=PROMPT)


def prompt(i: int) -> list[int]:
    return [(5 * i + 3 * j) % 60 + 1 for j in range(PROMPT)]


def by_request(reqs: range, out: ModelRunnerOutput | None) -> dict[int, int]:
    """A step's sampled token per request (every request of these steps samples)."""
    assert out is not None and all(t is not None for t in out.sampled_token_ids), out
    return {i: int(t) for i, t in zip(reqs, out.sampled_token_ids, strict=True) if t is not None}


def decode_step(reqs: range, last: dict[int, int], step: int, params: list[SamplingParams]) -> SchedulerOutput:
    return SchedulerOutput([chunk(i, [last[i]], PROMPT + step, params[i]) for i in reqs])


def generate(runner: ModelRunner, params: list[SamplingParams], reqs: range = range(NUM_REQS)) -> list[dict[int, int]]:
    """A prefill of the requests ``reqs`` (eager: a mixed batch), then ``DECODE_STEPS`` decode steps of them."""
    steps = [by_request(reqs, runner.step(SchedulerOutput([chunk(i, prompt(i), 0, params[i]) for i in reqs])))]
    for s in range(DECODE_STEPS):
        steps.append(by_request(reqs, runner.step(decode_step(reqs, steps[-1], s, params))))
    return steps


def eager_tokens(params: list[SamplingParams], reqs: range = range(NUM_REQS),
                 fused_draw: bool = False) -> list[dict[int, int]]:
    runner = make_runner(fused_draw=fused_draw)
    try:
        assert runner.graph_runner is None  # no graphs of its own (make_runner)
        return generate(runner, params, reqs)
    finally:
        runner.close()


@pytest.fixture
def graphed() -> Any:
    runner = make_runner()
    replays = install_graphs(runner)
    yield runner, replays
    runner.close()


def test_greedy_decode_steps_sample_in_the_head_graph(graphed) -> None:
    runner, replays = graphed
    params = [GREEDY] * NUM_REQS
    assert generate(runner, params) == eager_tokens(params)
    assert replays.forward == ALL_DECODES and replays.heads == {"greedy": ALL_DECODES}
    assert runner.graph_runner.num_head_replays == {"greedy": DECODE_STEPS}


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.8, seed=7)] + [GREEDY] * (NUM_REQS - 1),
    [SamplingParams(temperature=t, seed=s) for t, s in zip([1.0, 0.5, 1.7, 0.8] * 2, range(NUM_REQS), strict=True)],
    [SamplingParams(temperature=1.0)] * NUM_REQS,
], ids=["one-draw-among-greedy", "temperatures", "unseeded"])
def test_decode_steps_that_draw_with_a_temperature_sample_in_the_draw_head(graphed, params) -> None:
    """Rows that draw with at most a temperature, alone or among greedy rows (seeded or with the engine's seed per
    request): each decode step replays the draw head after its forward graph, with the tokens of eager sampling."""
    runner, replays = graphed
    assert generate(runner, params) == eager_tokens(params)
    assert replays.forward == ALL_DECODES and replays.heads == {"draw": ALL_DECODES}


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.6, top_k=20, top_p=0.95)] * NUM_REQS,  # Qwen3's generation_config
    [GREEDY, SamplingParams(temperature=0.9, seed=3), SamplingParams(temperature=0.8, seed=7, top_k=5),
     *(SamplingParams(temperature=0.7 + 0.1 * i, seed=i, top_k=1 + 9 * i, top_p=1 - 0.05 * i) for i in range(4)),
     SamplingParams(temperature=1.2, seed=8, top_k=TOP_K_WIDTH)],
], ids=["qwen3-defaults", "mixed"])
def test_decode_steps_with_top_k_sample_in_the_top_k_head(graphed, params) -> None:
    """Rows that draw with top-k of at most ``TOP_K_WIDTH``, some with top-p, among greedy and plain drawing rows:
    each decode step replays the top-k head, with the tokens of eager sampling (which gathers the same width)."""
    runner, replays = graphed
    assert generate(runner, params) == eager_tokens(params)
    assert replays.forward == ALL_DECODES and replays.heads == {"top_k": ALL_DECODES}


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.6, top_p=0.9)] * NUM_REQS,  # Llama 3's generation_config
    [GREEDY, SamplingParams(temperature=0.9, seed=3),
     *(SamplingParams(temperature=0.7 + 0.1 * i, seed=i, top_p=0.5 + 0.1 * i) for i in range(6))],
], ids=["llama3-defaults", "mixed"])
def test_decode_steps_with_top_p_alone_sample_in_the_top_p_head(graphed, params) -> None:
    """Rows that draw with top-p and no top-k (a sort of the row), among greedy and drawing rows: each decode step
    replays the top-p head, with the tokens of eager sampling."""
    runner, replays = graphed
    assert generate(runner, params) == eager_tokens(params)
    assert replays.forward == ALL_DECODES and replays.heads == {"top_p": ALL_DECODES}


QWEN3 = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=i) for i in range(NUM_REQS)]
LLAMA3 = [SamplingParams(temperature=0.6, top_p=0.9, seed=i) for i in range(NUM_REQS)]


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("params,head", [
    ([GREEDY] * 2 + [SamplingParams(temperature=0.5 + 0.2 * i, seed=i) for i in range(NUM_REQS - 2)], "draw"),
    ([GREEDY, SamplingParams(temperature=0.9, seed=3), *QWEN3[2:]], "top_k"),
    ([GREEDY, SamplingParams(temperature=0.9, seed=3), *LLAMA3[2:]], "top_p"),
    ([*QWEN3[:4], SamplingParams(temperature=0.8, seed=9, min_p=0.1), *QWEN3[5:]], None),
], ids=["draw", "top-k", "top-p", "eager"])
def test_fused_draws_give_the_eager_samplers_tokens_in_every_head(monkeypatch, params, head: str | None) -> None:
    """With the fused draw (the fused tails on CUDA), each head draws with the kernel -- the draw and top-k heads
    dividing by the temperature and cutting at top-k's threshold inside it, the row left as it is -- and gives the
    tokens of the eager sampler, which draws with the same kernel after its torch transforms; a step no head takes
    draws with it eagerly. Every draw of both runners is the kernel's."""
    from runner.worker import fused_draw
    from runner.worker import sampler as sampler_module

    launches: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        launches.append(args[0].shape[0])
        if kwargs.get("peak") is not None:  # a head's: the largest of the row it draws from, as the kernels find it
            temperature = args[2] if len(args) > 2 else None
            y = args[0] if temperature is None else args[0] / temperature.unsqueeze(1)
            assert torch.equal(kwargs["peak"], y.max(dim=-1).values)
        return fused_draw.fused_draw(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "draw_fused", counted)
    monkeypatch.setattr(cuda_graphs, "fused_draw", counted)
    monkeypatch.setattr(sampler_module, "draw_by_inverse_cdf_", None)  # the torch draw is not called
    monkeypatch.setattr(cuda_graphs, "draw_by_inverse_cdf_", None)
    want = eager_tokens(params, fused_draw=True)
    eager_launches, launches[:] = len(launches), []
    runner = make_runner(fused_draw=True)
    try:
        replays = install_graphs(runner)
        launches.clear()  # the captures ran the heads
        assert generate(runner, params) == want
        assert replays.forward == ALL_DECODES and replays.heads == ({} if head is None else {head: ALL_DECODES})
    finally:
        runner.close()
    assert eager_launches == len(launches) == 1 + DECODE_STEPS  # the prefill's draw, then each decode step's


@pytest.mark.parametrize("other", [
    SamplingParams(temperature=0.8, seed=7, top_k=TOP_K_WIDTH + 1),
    SamplingParams(temperature=0.8, seed=7, top_p=0.9),
    SamplingParams(temperature=0.8, seed=7, top_k=5, min_p=0.1),
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, min_tokens=3),
    SamplingParams(temperature=0.0, logit_bias={5: 3.0}),
], ids=["wide-top-k", "top-p-alone-beside-top-k", "min-p", "logprobs", "penalty", "min-tokens", "logit-bias"])
def test_a_step_with_any_other_row_samples_eagerly_from_the_graphs_rows(graphed, other: SamplingParams) -> None:
    """One row that no head samples among greedy, drawing and top-k rows (or whose step none does: top-p alone beside
    top-k): the forward graphs replay, no head does, the tokens are eager's."""
    runner, replays = graphed
    params = [GREEDY] * (NUM_REQS - 3) + [SamplingParams(temperature=0.9, seed=3),
                                          SamplingParams(temperature=0.9, seed=4, top_k=3, top_p=0.9), other]
    assert generate(runner, params) == eager_tokens(params)
    assert replays.forward == ALL_DECODES and replays.heads == {}


@pytest.mark.parametrize("head", ["greedy", "draw"])
def test_steps_launched_before_either_is_read_keep_their_own_tokens(graphed, head: str) -> None:
    """A head's output is static, rewritten by the next replay of its size: a launched step's tokens are copied off
    it at launch, so two steps of one size in flight each read their own (the overlap loop's order). The draw head's
    inputs are one persistent buffer, rewritten for every draw step: the second step's temperatures and uniforms do
    not reach the first's draw (stream order on a GPU)."""
    runner, replays = graphed
    first, second = range(0, 4), range(4, 8)
    params = [GREEDY] * NUM_REQS if head == "greedy" else \
        [SamplingParams(temperature=0.6 + 0.2 * i, seed=i) for i in range(NUM_REQS)]
    want = eager_tokens(params, first)[-1] | eager_tokens(params, second)[-1]
    last: dict[int, int] = {}
    for reqs in (first, second):
        last |= by_request(reqs, runner.step(SchedulerOutput([chunk(i, prompt(i), 0, params[i]) for i in reqs])))
    for s in range(DECODE_STEPS):
        launched = [(reqs, runner.launch(decode_step(reqs, last, s, params))) for reqs in (first, second)]
        for reqs, pending in launched:
            assert pending is not None
            last |= by_request(reqs, pending.result(30.0))
    assert last == want
    assert replays.heads == {head: [GraphKey(4)] * (2 * DECODE_STEPS)}


class HeadOutOfMemory(OomAbove):
    """The eager stand-in, but the capture of the 4-token graph's ``fail_at``-th head (1: the greedy head, 2: the
    draw head, 3: the top-k head, 4: the top-p head) runs out of memory, after its forward graph and any earlier
    head were captured."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(0)
        self.fail_at, self.heads_of_4 = fail_at, 0

    def capture(self, fn: Any, pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
        graph, out = EagerReplayBackend.capture(self, fn, pool, stream)
        if out.dim() == 2:
            self.attempts.append(out.shape[0])
        elif out.shape[0] == 4:
            self.heads_of_4 += 1
            if self.heads_of_4 == self.fail_at:
                raise oom("a head of 4 tokens")
        return graph, out


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4], ids=["greedy-head", "draw-head", "top-k-head", "top-p-head"])
def test_a_head_out_of_memory_drops_its_size_and_releases_its_other_graphs(fail_at: int) -> None:
    """The size is dropped; what was captured of it is released, the heads before the forward graph that they read."""
    runner = make_runner()
    try:
        backend = HeadOutOfMemory(fail_at)
        gr = cuda_graphs.make_graph_runner(runner, backend=backend, num_warmups=0, progress=False)
        report = gr.capture()
        assert report.dropped == [GraphKey(4)] and sorted(gr.graphs) == [GraphKey(1), GraphKey(2), GraphKey(8)]
        assert backend.attempts == [8, 4, 2, 1]
        # the stand-in's graphs are (callable, output): a head's output is the sampled ids, the forward's 2-D
        assert [g[1].dim() for g in backend.released] == [1] * (fail_at - 1) + [2]
        assert all(g[1].shape[0] == 4 for g in backend.released)
    finally:
        runner.close()


def test_replay_head_names_what_is_missing() -> None:
    runner = make_runner()
    try:
        replays = install_graphs(runner)
        gr = runner.graph_runner
        assert gr is not None and not gr.head_ready("greedy") and replays.heads == {}
        with pytest.raises(RuntimeError, match=r"no graph with a 'draw' head .*\['draw', 'greedy', 'top_k', 'top_p'\]"):
            gr.replay_head("draw")
    finally:
        runner.close()


def test_the_heads_mark_rows_whose_logits_are_not_finite() -> None:
    """A row whose hidden state is NaN samples ``INVALID_TOKEN`` in every head (greedy and drawing rows), which the
    engine turns into an error for that request alone; the other rows are the sampler's."""
    runner = make_runner()
    try:
        hidden = torch.randn(4, runner.model_config.hidden_size, device=runner.device)
        hidden[1] = float("nan")
        uniforms = [0.25, 0.5, -1.0, 0.75]  # rows 0, 1 and 3 draw, row 2 is greedy
        lm_head = (runner.model.compute_logits, runner.vocab_size)
        runner.draw_inputs[:4] = torch.tensor([[1.0, u, 0.0, -1.0] for u in uniforms])  # no top-k, no top-p
        with torch.no_grad():  # as the capture runs them
            greedy = cuda_graphs.greedy_sampling_head(runner.model)(hidden)
            drawn = cuda_graphs.draw_sampling_head(*lm_head, runner.draw_inputs)(hidden)
            runner.draw_inputs[0, 2] = 1  # row 0: top-k 1, its argmax
            top_k = cuda_graphs.draw_sampling_head(*lm_head, runner.draw_inputs, SamplingHead.TOP_K)(hidden)
            # row 0: top-p 0.001 alone; the largest probability of 512 is above it, so the row keeps its argmax alone
            runner.draw_inputs[0, 2:] = torch.tensor([0.0, 0.999])
            top_p = cuda_graphs.draw_sampling_head(*lm_head, runner.draw_inputs, SamplingHead.TOP_P)(hidden)
            logits = runner.model.compute_logits(hidden)
            want_greedy = logits.argmax(dim=-1)
            cdf = logits.softmax(dim=-1).cumsum(dim=-1)
        assert greedy.tolist() == [int(want_greedy[0]), INVALID_TOKEN, int(want_greedy[2]), int(want_greedy[3])]
        want_drawn = [int((cdf[r] <= uniforms[r]).sum()) for r in (0, 3)]
        assert drawn.tolist() == [want_drawn[0], INVALID_TOKEN, int(want_greedy[2]), want_drawn[1]]
        assert top_k.tolist() == top_p.tolist() == [int(want_greedy[0]), INVALID_TOKEN, int(want_greedy[2]),
                                                    want_drawn[1]]
    finally:
        runner.close()


def test_llm_generate_samples_decode_steps_in_the_heads(tmp_path) -> None:
    """The public path, pipelined on the emulated device (a step launched before its predecessor is read, its
    placeholders resolved on the device from the head's tokens): with the stand-in graphs installed, every decode
    step of a greedy call replays the greedy head, of a call with seeded and unseeded draws the draw head, of a call
    with Qwen3's defaults (temperature, top-k, top-p) the top-k head, of a call with one top-p request without top-k
    the top-p head, and of a call with a min-p request none; the tokens equal the engine's without graphs."""
    from runner.entrypoints.llm import LLM

    prompts = [[(5 * i + j) % 400 for j in range(6)] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    mixed = [greedy] * 4 + [SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
                            SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)]
    qwen3 = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_tokens=8, ignore_eos=True)
    top_p = [*mixed[:5], SamplingParams(temperature=1.0, top_p=0.8, seed=5, max_tokens=8, ignore_eos=True)]
    min_p = [*mixed[:5], SamplingParams(temperature=1.0, min_p=0.1, seed=5, max_tokens=8, ignore_eos=True)]

    def run(graphs: bool) -> tuple[list[list[int]], list[tuple[int, ...]]]:
        llm = LLM(model="tiny-qwen3-moe", cache_dir=str(tmp_path / "cache"), device="cpu", dtype="float32",
                  experts_backend="torch", max_num_seqs=6, emulate_device="step_us=300")
        try:
            replays = install_graphs(llm.model_runner) if graphs else None
            tokens, counts = [], []
            for params in (greedy, mixed, qwen3, top_p, min_p):
                tokens += [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
                if replays is not None:
                    counts.append((len(replays.forward),
                                   *(len(replays.heads.get(h, [])) for h in ("greedy", "draw", "top_k", "top_p"))))
            assert llm.last_loop_stats is not None and llm.last_loop_stats.num_placeholders_resolved > 0
            return tokens, counts
        finally:
            llm.close()

    eager, _ = run(graphs=False)
    graphed, counts = run(graphs=True)
    assert graphed == eager
    # 7 decode steps a call, each replayed
    assert counts == [(7, 7, 0, 0, 0), (14, 7, 7, 0, 0), (21, 7, 7, 7, 0), (28, 7, 7, 7, 7), (35, 7, 7, 7, 7)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "head"])
def test_a_bfloat16_models_greedy_steps_pick_from_its_own_dtype(monkeypatch, graphs: bool) -> None:
    """Greedy rows take the argmax of the LM head's bfloat16 logits, eagerly and in the head, and the tokens are
    those of the float32 logits (the cast is exact): a run whose every step upcasts gives the same."""
    from runner.models.base import MoECausalLM
    from runner.worker import sampler as sampler_module

    seen: set[torch.dtype] = set()
    greedy_rows = sampler_module.greedy_rows

    def recording(logits: torch.Tensor) -> torch.Tensor:
        seen.add(logits.dtype)
        return greedy_rows(logits)

    def run() -> list[dict[int, int]]:
        runner = make_runner("bfloat16")
        try:
            if graphs:
                install_graphs(runner)
                seen.clear()  # the captures ran both heads (the draw head's pick is of float32 logits)
            return generate(runner, [GREEDY] * NUM_REQS)
        finally:
            runner.close()

    monkeypatch.setattr(sampler_module, "greedy_rows", recording)
    monkeypatch.setattr(cuda_graphs, "greedy_rows", recording)
    tokens = run()
    assert seen == {torch.bfloat16}
    compute_logits = MoECausalLM.compute_logits
    monkeypatch.setattr(MoECausalLM, "compute_logits", lambda self, hidden, upcast=True: compute_logits(self, hidden))
    seen.clear()
    assert run() == tokens and seen == {torch.float32}
