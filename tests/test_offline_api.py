"""The offline ``LLM`` as vLLM users drive it, on a transformers-written Qwen3-MoE with a real tokenizer, chat
template and generation_config.json (``tiny_checkpoint.py``): text in and out, chat, stop strings, the
checkpoint's two EOS ids against transformers' own ``generate`` (DBO off and on, DP 1 and 2), ``n > 1``."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from devices import device_for
from runner.distributed.launch import launch
from runner.sampling_params import SamplingParams
from tiny_checkpoint import PROMPT, SAMPLING_DEFAULTS, TinyCheckpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [PROMPT, "Hello world!", "One, two, three:", "Dual batch overlap"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)  # copied per request (replace): the engine may fill fields in
# tiny thresholds and no cost model, so these 4-prompt batches really run as two ubatches
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4, dbo_cost_model="off")
ENGINE = dict(dtype="float32", max_num_seqs=8, dist_timeout_s=60.0)


@pytest.fixture(scope="module")
def ck(tiny_chat_checkpoint: TinyCheckpoint) -> TinyCheckpoint:
    return tiny_chat_checkpoint


@pytest.fixture(scope="module")
def llm(ck: TinyCheckpoint):
    from runner import LLM

    engine = LLM(model=str(ck.path), device=device_for(1), **ENGINE)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf(ck: TinyCheckpoint) -> tuple[Any, Any]:
    model = transformers.AutoModelForCausalLM.from_pretrained(ck.path, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(ck.path)


def hf_greedy(hf: tuple[Any, Any], prompt: str, **overrides: Any) -> list[int]:
    """transformers' greedy continuation with the checkpoint's generation config (its two EOS ids)."""
    model, tok = hf
    ids = tok.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, pad_token_id=0, **overrides)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------------------------------------- text and chat
def test_text_prompts_are_encoded_as_transformers_does(llm, hf) -> None:
    outs = llm.generate(PROMPTS, replace(GREEDY), use_tqdm=False)
    for prompt, o in zip(PROMPTS, outs, strict=True):
        assert o.prompt == prompt and o.prompt_token_ids == hf[1].encode(prompt)  # BOS first: add_bos_token
        assert o.prompt_token_ids[0] == hf[1].bos_token_id and o.finished and o.error is None


def test_chat_builds_the_ids_of_apply_chat_template(llm, hf) -> None:
    tok = hf[1]
    conversations = [[{"role": "user", "content": "Hello world"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Caf\u00e9?"},
                      {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Two."}]]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for conversation, o in zip(conversations, outs, strict=True):
        want = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert o.prompt_token_ids == want
        assert o.prompt == tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert len(o.outputs[0].token_ids) > 0
    (single,) = llm.chat(conversations[0], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert single.prompt_token_ids == outs[0].prompt_token_ids  # one conversation, not a list of them


def test_chat_without_a_template_is_an_error_naming_the_model(ck: TinyCheckpoint, tmp_path: Path) -> None:
    from runner import LLM
    from runner.engine.tokenizer import NoChatTemplateError

    plain = tmp_path / "no-template"
    shutil.copytree(ck.path, plain)
    (plain / "chat_template.jinja").unlink()
    engine = LLM(model=str(plain), device=device_for(1), **ENGINE)
    try:
        with pytest.raises(NoChatTemplateError, match=f"model '{plain}' has no chat template"):
            engine.chat([{"role": "user", "content": "hi"}])
    finally:
        engine.close()


def test_stop_strings_cut_the_text_also_across_tokens(llm, hf) -> None:
    ref = llm.generate([PROMPT], replace(GREEDY, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    tok = hf[1]
    assert ref.text == tok.decode(ref.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    # per-token text ends, then a two-character stop string across the first boundary that can take one
    ends = [len(tok.decode(ref.token_ids[:k], skip_special_tokens=True).rstrip("\ufffd"))
            for k in range(len(ref.token_ids) + 1)]
    k, stop = next((k, ref.text[ends[k] - 1:ends[k] + 1]) for k in range(2, len(ends) - 1)
                   if 0 < ends[k] < len(ref.text) and ends[k - 1] < ends[k] < ends[k + 1]
                   and ref.text.find(ref.text[ends[k] - 1:ends[k] + 1]) == ends[k] - 1
                   and "\ufffd" not in ref.text[ends[k] - 1:ends[k] + 1])
    cut = ends[k] - 1
    for include, text in ((False, ref.text[:cut]), (True, ref.text[:cut + 2])):
        (o,) = llm.generate([PROMPT], replace(GREEDY, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=include), use_tqdm=False)
        c = o.outputs[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (text, "stop", stop)
        assert c.token_ids == ref.token_ids[:k + 1]  # it stopped on the token that completed the stop string
    assert llm.last_stats.num_output_tokens == k + 1  # the engine core stopped too (aborted at once)


# ---------------------------------------------------------------------------------------------- generation config
def test_default_sampling_params_come_from_generation_config(llm, ck: TinyCheckpoint) -> None:
    from runner import LLM

    d = llm.get_default_sampling_params()
    assert {k: getattr(d, k) for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    plain = LLM(model=str(ck.path), generation_config="vllm", device=device_for(1), **ENGINE)
    try:
        assert plain.get_default_sampling_params() == SamplingParams()
    finally:
        plain.close()


def test_two_eos_ids_stop_where_transformers_stops(llm, hf, ck: TinyCheckpoint) -> None:
    outs = llm.generate(PROMPTS, replace(GREEDY), use_tqdm=False)
    for prompt, o in zip(PROMPTS, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, prompt), prompt
    first = outs[0].outputs[0]
    assert first.token_ids[-1] == ck.second_eos_token_id and len(first.token_ids) < 16  # the file's EOS ended it
    assert (first.finish_reason, first.stop_reason) == ("stop", ck.second_eos_token_id)
    assert first.token_ids == ck.greedy_no_eos[:len(first.token_ids)]


def test_generation_config_vllm_ignores_the_file(ck: TinyCheckpoint, hf) -> None:
    from runner import LLM

    engine = LLM(model=str(ck.path), generation_config="vllm", device=device_for(1), **ENGINE)
    try:
        (o,) = engine.generate([PROMPT], replace(GREEDY), use_tqdm=False)
    finally:
        engine.close()
    assert o.outputs[0].token_ids == hf_greedy(hf, PROMPT, eos_token_id=ck.eos_token_id)
    assert ck.second_eos_token_id in o.outputs[0].token_ids[:-1]  # went on past the file's second EOS


def _dbo_off_and_on(path: str, prompts: list[str], device: str, dp: int) -> dict[str, Any]:
    """Rank body (also run in-process for DP=1): greedy tokens with DBO off and on, and the ubatched steps."""
    from runner import LLM

    extra = dict(data_parallel_size=dp, enable_expert_parallel=dp > 1) if dp > 1 else {}
    result: dict[str, Any] = {}
    for name, dbo in (("off", {}), ("on", DBO)):
        engine = LLM(model=path, device=device, **ENGINE, **extra, **dbo)
        try:
            outs = engine.generate(prompts, replace(GREEDY), use_tqdm=False)
            result[name] = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].stop_reason for o in outs],
                            engine.last_stats.num_ubatched_steps)
        finally:
            engine.close()
    return result


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_generation_config_eos_with_dbo_and_dp_equals_transformers(ck: TinyCheckpoint, hf, dp: int) -> None:
    prompts = PROMPTS * 2
    if dp == 1:
        result = _dbo_off_and_on(str(ck.path), prompts, device_for(1), 1)
    else:
        per_rank = launch(_dbo_off_and_on, 2, args=(str(ck.path), prompts, device_for(2), 2), timeout_s=180,
                          device=device_for(2))
        assert per_rank[0] == per_rank[1]  # every rank returns every output
        result = per_rank[0]
    want = [hf_greedy(hf, p) for p in prompts]
    assert result["off"][0] == want and result["on"][0] == want
    assert result["off"][2] == 0 and result["on"][2] > 0  # DBO really ran
    assert ck.second_eos_token_id in result["on"][1]


# ---------------------------------------------------------------------------------------------- n > 1
def test_n_samples_differ_and_are_reproducible(llm) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (o,) = llm.generate([PROMPT], params, use_tqdm=False)
    a, b = o.outputs
    assert (a.index, b.index) == (0, 1) and len(a.token_ids) == len(b.token_ids) == 8
    assert a.token_ids != b.token_ids
    (again,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [a.token_ids, b.token_ids]
    # vLLM's seeds: sample k of a request with seed s draws as a single request with seed s + k
    single = SamplingParams(temperature=1.0, seed=8, max_tokens=8, ignore_eos=True)
    assert llm.generate([PROMPT], single, use_tqdm=False)[0].outputs[0].token_ids == b.token_ids
    unseeded = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True)
    x = [c.token_ids for c in llm.generate([PROMPT], unseeded, use_tqdm=False)[0].outputs]
    assert x[0] != x[1] and x == [c.token_ids for c in llm.generate([PROMPT], unseeded, use_tqdm=False)[0].outputs]
