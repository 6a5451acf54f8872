"""vLLM's ``prompt_logprobs``: each prompt token's log-probability equals ``log_softmax`` of transformers' logits
at the position before it, on the transformers-written chat checkpoint (``tiny_checkpoint.py``), with the prompt
prefilled in several chunks, with DBO splitting the steps, and for ``n > 1``; ranks and the top-N are
consistent with the values."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from runner.sampling_params import SamplingParams, SamplingParamsError
from tiny_checkpoint import TinyCheckpoint

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox jumps over the lazy dog. Hello world! How are you today?", "Hello world!",
           "Caf\u00e9 cr\u00e8me"]
ATOL = 2e-5  # float32 on both sides


@pytest.fixture(scope="module")
def hf_logprobs(tiny_chat_checkpoint: TinyCheckpoint) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_checkpoint.path, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


@pytest.mark.parametrize("engine", [dict(max_num_batched_tokens=16),
                                    dict(max_num_batched_tokens=64, enable_dbo=True, dbo_decode_token_threshold=2,
                                         dbo_prefill_token_threshold=4, dbo_cost_model="off")])
def test_prompt_logprobs_equal_transformers(tiny_chat_checkpoint: TinyCheckpoint, hf_logprobs: Any,
                                            engine: dict[str, Any]) -> None:
    from runner import LLM

    llm = LLM(model=str(tiny_chat_checkpoint.path), device="cpu", dtype="float32", **engine)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    finally:
        llm.close()
    for o, p in zip(outs, plain, strict=True):
        ids = o.prompt_token_ids
        assert o.outputs[0].token_ids == p.outputs[0].token_ids and p.prompt_logprobs is None
        assert len(o.prompt_logprobs) == len(ids) and o.prompt_logprobs[0] is None
        want = hf_logprobs(ids)
        for i in range(1, len(ids)):
            position = o.prompt_logprobs[i]
            assert position[ids[i]].logprob == pytest.approx(want[i - 1, ids[i]].item(), abs=ATOL)
            assert position[ids[i]].rank == int((want[i - 1] >= want[i - 1, ids[i]]).sum())
            top = sorted(((lp.rank, t) for t, lp in position.items() if lp.rank <= 3))
            assert [t for _, t in top] == want[i - 1].topk(3).indices.tolist()
            assert position[ids[i]].decoded_token is not None


def test_prompt_logprobs_with_n_samples_and_bad_values(tiny_chat_checkpoint: TinyCheckpoint,
                                                       hf_logprobs: Any) -> None:
    from runner import LLM

    llm = LLM(model=str(tiny_chat_checkpoint.path), device="cpu", dtype="float32")
    try:
        (o,) = llm.generate(PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=2,
                                                        prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.close()
    ids = o.prompt_token_ids
    assert len(o.outputs) == 2 and len(o.prompt_logprobs) == len(ids)
    assert all(list(o.prompt_logprobs[i]) == [ids[i]] for i in range(1, len(ids)))  # 0: the prompt token alone
    assert o.prompt_logprobs[-1][ids[-1]].logprob == pytest.approx(hf_logprobs(ids)[-2, ids[-1]].item(), abs=ATOL)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs must be an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
