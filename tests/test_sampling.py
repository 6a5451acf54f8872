"""The batched sampler: greedy rows exact, the draw's distribution, seeded reproducibility independent of the
batch, logprobs, stages skipped when unused, no host sync on the device side, parameter validation."""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from runner.sampling_params import SamplingParams, SamplingParamsError
from runner.worker.sampler import Sampler, request_seed, sample_on_device
from runner.worker.sampling_metadata import RowSpec
from sync_counter import SyncCounter

V = 40


def draw(logits: torch.Tensor, rows: list[RowSpec], eos: tuple[int, ...] = ()) -> list[int]:
    return Sampler(logits.shape[1], "cpu", eos).sample(logits.clone(), rows).token_ids


def test_greedy_is_argmax_first_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 2.0, 0.0]])
    assert draw(logits, [RowSpec(SamplingParams(temperature=0.0))] * 2) == [1, 0]
    assert draw(logits[:1], [RowSpec(SamplingParams(temperature=1e-7), seed=3)]) == [1]  # below eps: greedy
    assert Sampler(4, "cpu").sample(torch.zeros(0, 4), []).token_ids == []


def seeded_draws(position: int, batch_size: int, num_draws: int = 60) -> list[int]:
    """``num_draws`` successive tokens of one seeded request (seed 7, temperature 1.5, top-p 0.9) sitting at
    ``position`` of a batch of ``batch_size`` rows. The other rows mix greedy rows and random rows with their own
    seeds and every other option (top-k, min-p, top-p, logit bias, min_tokens, logprobs), so the stages run
    on row subsets that change with the layout, and every row's logits change at every draw: any leak between
    rows or from the batch shape shows."""
    target = SamplingParams(temperature=1.5, top_p=0.9, seed=7)
    kinds = [partial(SamplingParams, temperature=0.0, logit_bias={3: 5.0}),
             partial(SamplingParams, temperature=0.8, top_k=5, logprobs=2),
             partial(SamplingParams, temperature=1.2, min_p=0.1, min_tokens=3, stop_token_ids=[1]),
             partial(SamplingParams, temperature=0.5, top_p=0.5)]
    others = [kinds[i % len(kinds)](seed=100 + i) for i in range(batch_size)]
    params = others[:position] + [target] + others[position + 1:]
    table = torch.randn(num_draws, V, generator=torch.Generator().manual_seed(0))  # the target's logits per draw
    noise = torch.Generator().manual_seed(1000 + batch_size * 10 + position)  # the other rows' logits
    sampler = Sampler(V, "cpu", eos_token_ids=[2])
    out = []
    for d in range(num_draws):
        logits = torch.randn(batch_size, V, generator=noise) * 3
        logits[position] = table[d]
        rows = [RowSpec(p, request_seed(p, 0), output_index=d) for p in params]
        out.append(sampler.sample(logits, rows).token_ids[position])
    return out


def test_seeded_row_does_not_depend_on_batch() -> None:
    """60 draws of one seeded request: alone, and at the first, a middle and the last position of larger,
    differently composed batches. A sampler that let the batch shape, the row index or another row's
    settings reach the target row would change some of the 60 draws, where a single draw can match by
    chance."""
    alone = seeded_draws(0, 1)
    assert len(set(alone)) >= 10, f"the draws must vary for the comparison to mean anything: {alone}"
    for position, batch_size in [(0, 4), (2, 5), (4, 5), (7, 8)]:
        assert seeded_draws(position, batch_size) == alone, f"position {position} of {batch_size}"


def test_a_draw_depends_on_seed_and_output_index_only() -> None:
    logits = torch.zeros(1, V)  # uniform: every token equally likely, so the noise alone decides
    p = SamplingParams(temperature=1.0)
    by_index = [draw(logits, [RowSpec(p, seed=5, output_index=i)])[0] for i in range(40)]
    by_seed = [draw(logits, [RowSpec(p, seed=s, output_index=0)])[0] for s in range(40)]
    assert len(set(by_index)) >= 15 and len(set(by_seed)) >= 15
    assert by_index == [draw(logits, [RowSpec(p, seed=5, output_index=i)])[0] for i in range(40)]
    assert draw(logits, [RowSpec(p, seed=-3)]) == draw(logits, [RowSpec(p, seed=2**64 - 3)])  # mod 2**64


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None]
    drawn = {draw(logits, [RowSpec(SamplingParams(top_p=0.8), output_index=i)])[0] for i in range(300)}
    assert drawn == {0, 1}
    drawn = {draw(logits, [RowSpec(SamplingParams(top_p=1e-6), output_index=i)])[0] for i in range(50)}
    assert drawn == {0}


@pytest.mark.parametrize("over", ["output_index", "seed"])
def test_temperature_one_matches_softmax(over: str) -> None:
    """4000 draws of one distribution, over successive outputs of one request or over requests' seeds: each
    token's frequency within 4 standard deviations of its probability."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    rows = [RowSpec(SamplingParams(), seed=i if over == "seed" else 11, output_index=0 if over == "seed" else i)
            for i in range(n)]
    tokens = draw(probs.log().expand(n, 4).contiguous(), rows)
    for t, p in enumerate(probs.tolist()):
        assert abs(tokens.count(t) / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 3000
    freq = {}
    for t in (0.5, 2.0):
        toks = draw(logits.expand(n, 4).contiguous(), [RowSpec(SamplingParams(temperature=t), 1, i) for i in range(n)])
        freq[t] = toks.count(0) / n
    expected = {t: torch.softmax(logits[0] / t, -1)[0].item() for t in (0.5, 2.0)}
    for t in (0.5, 2.0):
        assert abs(freq[t] - expected[t]) < 4 * math.sqrt(expected[t] * (1 - expected[t]) / n)


def test_top_k_one_at_temperature_one_is_greedy() -> None:
    logits = torch.randn(200, V, generator=torch.Generator().manual_seed(3))
    rows = [RowSpec(SamplingParams(top_k=1), seed=i, output_index=i) for i in range(200)]
    assert draw(logits, rows) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_exact_argmax_in_a_mixed_batch() -> None:
    """Greedy rows next to random rows using every warper: each greedy row is the argmax of its own biased and
    min_tokens-masked logits, computed here by hand."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, V, generator=g) * 2
    params = []
    for i in range(8):
        if i % 2:
            params.append(SamplingParams(temperature=0.7, top_k=4, top_p=0.8, min_p=0.05, seed=i))
        else:
            params.append(SamplingParams(temperature=0.0, min_tokens=2 if i % 4 == 0 else 0,
                                         logit_bias={i: 4.0, 2 * i + 1: -3.0}, stop_token_ids=[9]))
    eos = (int(logits[0].argmax()), int(logits[4].argmax()))
    out = draw(logits, [RowSpec(p, output_index=1) for p in params], eos)
    mask_mattered = False
    for i in range(0, 8, 2):
        ref = logits[i].clone()
        ref[i] += 4.0
        ref[2 * i + 1] -= 3.0
        if i % 4 == 0:
            mask_mattered |= int(ref.argmax()) in set(eos) | {9}
            ref[list(set(eos) | {9})] = float("-inf")
        assert out[i] == int(ref.argmax()), i
    assert mask_mattered


def test_min_tokens_holds_back_every_stop_token_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6], logits[0, 7] = 9.0, 8.0, 7.0  # EOS 5, a stop token 6, then 7
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])
    assert [draw(logits, [RowSpec(p, output_index=i)], eos=(5,))[0] for i in range(5)] == [7, 7, 7, 5, 5]
    p.all_stop_token_ids.add(7)  # what the engine adds (generation_config's EOS ids)
    assert draw(logits, [RowSpec(p, output_index=0)], eos=(5,)) == [0]


def test_logprobs_are_raw_log_softmax_with_rank_and_top_n() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, V, generator=g) * 2
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={0: 100.0}),  # bias changes the token...
              SamplingParams(temperature=0.9, seed=1),  # no logprobs
              SamplingParams(temperature=0.9, seed=2, logprobs=0, repetition_penalty=1.0),
              SamplingParams(temperature=0.9, seed=3, logprobs=5, top_k=3)]
    out = Sampler(V, "cpu").sample(logits.clone(), [RowSpec(p) for p in params])
    assert out.logprobs is not None and out.logprobs[1] is None
    raw = torch.log_softmax(logits, -1)  # ...but not the logprobs, which are the model's (vLLM's raw_logprobs)
    for i in (0, 2, 3):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-6)
        assert lp.rank == int((raw[i] >= raw[i, lp.token_id]).sum())
        n = params[i].logprobs
        assert n is not None
        top = raw[i].topk(n)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    lp0 = out.logprobs[0]
    assert out.token_ids[0] == 0 and lp0 is not None and lp0.rank > 1  # the bias won; the raw rank says it was not top
    assert Sampler(V, "cpu").sample(logits.clone(), [RowSpec(params[1])] * 4).logprobs is None


def test_rows_with_everything_off_skip_every_stage() -> None:
    sampler = Sampler(V, "cpu")
    meta = sampler.metadata([RowSpec(SamplingParams(temperature=0.0)), RowSpec(SamplingParams())])
    assert meta.num_random == 1 and meta.random_rows is not None
    assert all(getattr(meta, f) is None for f in ("temperature", "min_p", "top_k", "top_p_floor", "stop_mask",
                                                  "bias", "penalty_slots", "logprob_rows"))
    meta = sampler.metadata([RowSpec(SamplingParams(top_k=3, min_p=0.2, temperature=0.5)),
                             RowSpec(SamplingParams(top_p=0.5)), RowSpec(SamplingParams()),
                             RowSpec(SamplingParams(top_k=V + 5, top_p=0.75))])  # top_k past the vocab: off
    assert meta.random_rows is None and meta.temperature is not None  # every row draws: no gather
    assert meta.min_p_rows is not None and meta.top_k_rows is not None and meta.top_k is not None
    assert meta.min_p_rows.tolist() == [0] and meta.top_k_rows.tolist() == [0] and meta.top_k.tolist() == [3]
    assert meta.top_k_p_floor is None  # the top-k row has no top-p
    assert meta.top_p_rows is not None and meta.top_p_floor is not None
    assert meta.top_p_rows.tolist() == [1, 3] and meta.top_p_floor.tolist() == [0.5, 0.25]


class _DeviceSide(torch.nn.Module):
    def __init__(self, sampler: Sampler, meta) -> None:
        super().__init__()
        self.sampler, self.meta = sampler, meta

    def forward(self, logits: torch.Tensor):
        return sample_on_device(logits, self.meta, self.sampler.penalties)


def test_device_side_makes_no_host_sync_with_every_option_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything between the metadata copy and the one read-back runs without a sync (``sync_counter.py``).

    The greedy rows' argmax is the one op that differs by device: on the CPU ``argmax_rows`` and
    ``greedy_tokens`` read the logits' host memory through numpy (there is no device to wait for), elsewhere they
    are tensor work, which is what runs here."""
    from runner.core.scheduler_output import ScheduledChunk
    from runner.worker import sampling_ops

    monkeypatch.setattr(sampling_ops, "argmax_rows", lambda x: x.argmax(dim=-1))
    monkeypatch.setattr(sampling_ops, "greedy_tokens", sampling_ops.greedy_tokens_torch)

    sampler = Sampler(V, "cpu", eos_token_ids=[1])
    everything = partial(SamplingParams, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, top_k=5,
                         top_p=0.9, min_p=0.05, min_tokens=4, logit_bias={2: 1.0}, logprobs=3, stop_token_ids=[3])
    params = [everything(temperature=0.8, seed=i) if i % 3 else SamplingParams(temperature=0.0)
              for i in range(6)]
    chunks = [ScheduledChunk(i, [4, 5, 6, 7], 0, [], True, p, seed=i, slot=i, prompt_len=2)
              for i, p in enumerate(params)]
    sampler.record_inputs(chunks)
    meta = sampler.metadata(chunks)
    counter = SyncCounter()
    module = _DeviceSide(sampler, meta)
    with counter.watching(module):
        module(torch.randn(6, V))
    assert counter.forward_calls == 1 and counter.count == 0, counter.summary()


def test_request_seed() -> None:
    assert request_seed(SamplingParams(seed=11), 5) == 11
    assert request_seed(SamplingParams(), 5) == 5
    assert request_seed(SamplingParams(seed=-1), 5) == 5  # -1: no seed (vLLM, OpenAI)


@pytest.mark.parametrize("kwargs,msg", [
    ({"max_tokens": 0}, r"max_tokens must be an integer >= 1 \(or None\), got 0"),
    ({"temperature": -1}, r"temperature must be a finite number >= 0 \(vLLM.s range\), got -1"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, "top_p must be a number in"),
    ({"seed": "x"}, "seed must be an integer or None"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids must be non-negative integers, got -2"),
    ({"ignore_eos": 1}, "ignore_eos must be True or False"),
])
def test_sampling_params_validation(kwargs: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_sample_shape_and_vocab_errors() -> None:
    with pytest.raises(ValueError, match="got 2 logit rows but 1 rows to sample"):
        Sampler(3, "cpu").sample(torch.zeros(2, 3), [RowSpec(SamplingParams())])
    with pytest.raises(ValueError, match=r"logits must be \[num_rows, 3\]"):
        Sampler(3, "cpu").sample(torch.zeros(3), [RowSpec(SamplingParams())])
    with pytest.raises(SamplingParamsError, match=r"logit_bias names token id 7, outside the vocabulary \[0, 3\)"):
        Sampler(3, "cpu").sample(torch.zeros(1, 3), [RowSpec(SamplingParams(logit_bias={7: 1.0}))])
    with pytest.raises(ValueError, match="row 0 uses penalties but has no request slot"):
        Sampler(3, "cpu").sample(torch.zeros(1, 3), [RowSpec(SamplingParams(presence_penalty=1.0))])


def test_clone_equals_and_shares_nothing_mutable() -> None:
    import copy

    params = SamplingParams(n=2, temperature=0.7, seed=5, stop=["x", "yz"], stop_token_ids=[3, 4],
                            logit_bias={"7": 1.5},  # type: ignore[dict-item]  # a JSON key: made an int
                            max_tokens=9)
    params.all_stop_token_ids |= {11}
    clone = params.clone()
    assert clone == params == copy.deepcopy(params) and type(clone) is SamplingParams
    assert isinstance(clone.stop, list) and clone.stop_token_ids is not None and clone.logit_bias is not None
    clone.stop.append("w")
    clone.stop_token_ids.append(5)
    clone.logit_bias[8] = 1.0
    clone.all_stop_token_ids.add(12)
    clone.max_tokens = 1
    assert (params.stop, params.stop_token_ids, params.logit_bias, params.all_stop_token_ids, params.max_tokens) == \
        (["x", "yz"], [3, 4], {7: 1.5}, {3, 4, 11}, 9)
