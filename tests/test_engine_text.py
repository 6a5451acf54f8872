"""The engine client (``runner/engine/``) on its own: tokenizer loading, incremental detokenization and stop
strings, generation_config.json, and the output processor fed hand-made engine-core outputs (output kinds,
n > 1, log-probabilities, aborts). No model runs here; ``test_offline_api.py`` runs them end to end."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from runner.core.logprob_rows import LogprobRows, TokenLogprobs
from runner.core.requests import EngineCoreOutput
from runner.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from runner.engine.generation_config import GenerationConfig, GenerationConfigError, load_generation_config
from runner.engine.output_processor import OutputProcessor
from runner.engine.parallel_sampling import CHILD_SEED_STRIDE
from runner.engine.tokenizer import (
    NoChatTemplateError,
    TokenizersAdapter,
    apply_chat_template,
    encode,
    load_tokenizer_from_dir,
)
from runner.outputs import Logprob
from runner.sampling_params import RequestOutputKind, SamplingParams

transformers = pytest.importorskip("transformers")

from tiny_checkpoint import CHAT_TEMPLATE, build_tokenizer  # noqa: E402

TEXT = "One, two, three: stop here. END"
UTF8 = "Caf\u00e9 cr\u00e8me, \u6771\u4eac and \u65e5\u672c\u8a9e text."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tok_dir(tok, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}))
    return path


def stream(tok, prompt: str, text: str, params: SamplingParams) -> tuple[list[str], IncrementalDetokenizer, int]:
    """Feed ``text``'s tokens one at a time; returns the DELTA texts, the detokenizer, the tokens fed."""
    det = IncrementalDetokenizer(tok, tok.encode(prompt), params)
    deltas, fed = [], 0
    for token in tok.encode(text, add_special_tokens=False):
        fed += 1
        stop = det.update([token], stop_terminated=False)
        deltas.append(det.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, det, fed
    deltas.append(det.get_next_output_text(finished=True, delta=True))
    return deltas, det, fed


# ---------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_is_transformers_with_bos_and_chat_template(tok, tok_dir: Path) -> None:
    loaded = load_tokenizer_from_dir(tok_dir)
    assert isinstance(loaded, transformers.PreTrainedTokenizerBase)
    assert encode(loaded, "hello there") == tok.encode("hello there")
    assert encode(loaded, "hello there")[0] == tok.bos_token_id  # add_bos_token: the tokenizer's own default
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    text, ids = apply_chat_template(loaded, conversation, model="m")
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert ids == tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_tokenizer_without_config_reads_tokenizer_json_as_is(tmp_path: Path) -> None:
    """Only tokenizer.json under a qwen3_moe config.json: AutoTokenizer would pick Qwen2Tokenizer, which
    rebuilds its own pipeline and encodes a WordLevel vocabulary to nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "fox": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path)).encode("the fox") == []  # the trap
    assert encode(load_tokenizer_from_dir(tmp_path), "the fox") == [1, 2]


def test_tokenizers_fallback_only_where_transformers_fails_and_says_so(tok_dir: Path, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from ubatch.log_once import forget_logged

    forget_logged()
    bad = tmp_path / "bad"
    shutil.copytree(tok_dir, bad)
    (bad / "tokenizer_config.json").write_text('{"tokenizer_class": ')  # truncated: transformers cannot parse it
    with caplog.at_level(logging.WARNING, "ubatch.engine"):
        loaded = load_tokenizer_from_dir(bad)
    assert isinstance(loaded, TokenizersAdapter)
    assert f"{bad / 'tokenizer.json'}: transformers could not load it (JSONDecodeError" in caplog.text
    assert "read with the tokenizers library instead: no chat template" in caplog.text
    assert encode(loaded, "hello there") == encode(load_tokenizer_from_dir(tok_dir), "hello there")
    with pytest.raises(NoChatTemplateError, match="model 'bad-model' has no chat template"):
        apply_chat_template(loaded, [{"role": "user", "content": "hi"}], model="bad-model")
    assert load_tokenizer_from_dir(tmp_path / "nothing-here") is None


def test_no_chat_template_names_the_model(tok_dir: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tok_dir, plain)
    (plain / "chat_template.jinja").unlink()
    loaded = load_tokenizer_from_dir(plain)
    with pytest.raises(NoChatTemplateError, match=r"model '/x/y' has no chat template \(no 'chat_template' in "
                                                  r"tokenizer_config.json and no chat_template.jinja\)"):
        apply_chat_template(loaded, [{"role": "user", "content": "hi"}], model="/x/y")
    text, _ = apply_chat_template(loaded, [{"role": "user", "content": "hi"}], model="/x/y",
                                  chat_template=CHAT_TEMPLATE)
    assert text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------- detokenizer
def test_stream_never_shows_a_replacement_character_mid_character(tok) -> None:
    ids = tok.encode(UTF8, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens are pieces of a character
    deltas, det, _ = stream(tok, "Hello", UTF8, SamplingParams())
    assert "".join(deltas) == det.output_text == UTF8
    assert not any("\ufffd" in d for d in deltas)
    assert det.token_ids == ids


def test_first_output_token_keeps_its_leading_space(tok) -> None:
    deltas, det, _ = stream(tok, "The quick", " brown fox", SamplingParams())
    assert det.output_text == " brown fox" and deltas[0].startswith(" ")


def test_stop_string_spanning_tokens_cuts_the_text(tok) -> None:
    pieces = [tok.decode([t]) for t in tok.encode(TEXT, add_special_tokens=False)]
    assert "stop" not in pieces and "s" in pieces and "to" in pieces  # "stop" spans three tokens
    deltas, det, fed = stream(tok, "Go", TEXT, SamplingParams(stop=["stop"]))
    assert det.output_text == "One, two, three: " and "".join(deltas) == det.output_text
    assert "".join(pieces[:fed]).endswith("stop")  # it stopped on the token that completed the stop string
    # while streaming, the last len("stop") - 1 characters were held back: no delta ever showed "s" or "st"
    assert all("s" not in d for d in deltas)
    _, kept, _ = stream(tok, "Go", TEXT, SamplingParams(stop=["stop"], include_stop_str_in_output=True))
    assert kept.output_text == "One, two, three: stop"


def test_earliest_stop_string_wins_and_text_after_it_is_dropped() -> None:
    assert find_stop_string("abcXYdefZ", 9, ["Z", "XY"], include_in_output=False) == ("XY", 3)
    assert find_stop_string("abcXYdef", 4, ["XY"], include_in_output=True) == ("XY", 5)  # "def" dropped
    assert find_stop_string("abcXYdef", 3, ["XY"], include_in_output=False) is None  # ended before the new text
    assert find_stop_string("abcXYdef", 4, ["XY"], include_in_output=False) == ("XY", 3)  # "Y" is new


def test_stop_token_is_not_decoded_unless_asked(tok) -> None:
    prompt = tok.encode("Go")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("fine", add_special_tokens=False) + [end]
    for include, skip, want in ((False, False, "fine"), (True, False, "fine<|im_end|>"), (True, True, "fine")):
        det = IncrementalDetokenizer(tok, prompt, SamplingParams(include_stop_str_in_output=include,
                                                                 skip_special_tokens=skip))
        det.update(ids, stop_terminated=True)
        assert det.get_next_output_text(finished=True, delta=False) == want
        assert det.token_ids == ids


# ---------------------------------------------------------------------------------------------- generation config
def test_generation_config_defaults_and_eos(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, 154], "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 300,
         "do_sample": True, "min_p": None}))
    gen = load_generation_config(tmp_path, "auto", model_eos_token_ids=[1])
    assert gen.extra_eos_token_ids == (154,)
    assert gen.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 300}
    d = gen.default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens, d.min_p) == (0.6, 20, 0.95, 300, 0.0)
    params = SamplingParams(stop_token_ids=[7])
    applied = gen.apply(params)
    assert applied.stop_token_ids == [154, 7] and applied.all_stop_token_ids == {1, 7, 154}
    assert params.stop_token_ids == [7]  # the caller's object is untouched
    ignoring = gen.apply(SamplingParams(ignore_eos=True))
    assert ignoring.stop_token_ids == [] and ignoring.all_stop_token_ids == {1, 154}  # min_tokens still holds both
    described = gen.describe()
    assert described is not None and "EOS token ids [1, 154]" in described and "temperature=0.6" in described
    vllm = load_generation_config(tmp_path, "vllm", model_eos_token_ids=[1])
    assert vllm.extra_eos_token_ids == () and vllm.sampling_defaults == {} and vllm.describe() is None
    assert vllm.default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert load_generation_config(tmp_path / "nowhere", str(other), [1]).extra_eos_token_ids == (9,)
    assert load_generation_config(tmp_path / "nowhere", "auto", [1]) == GenerationConfig(frozenset({1}))


@pytest.mark.parametrize("content,message", [
    ({"temperature": -1.0}, "temperature: temperature must be a finite number >= 0 (vLLM's range), got -1.0"),
    ({"max_new_tokens": 0}, "max_new_tokens: max_tokens must be an integer >= 1"),
    ({"eos_token_id": "x"}, "eos_token_id must be a token id or a list of them, got 'x'"),
    ([1, 2], "must hold a JSON object, got list"),
])
def test_bad_generation_config_names_the_file_and_field(tmp_path: Path, content, message: str) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(GenerationConfigError, match="generation_config.json: ") as info:
        load_generation_config(tmp_path)
    assert message in str(info.value)


def test_generation_config_field_is_validated() -> None:
    from runner.config import ConfigError, RunnerConfig

    assert RunnerConfig(generation_config="vllm").generation_config == "vllm"
    with pytest.raises(ConfigError, match="generation_config '/nonexistent' is neither") as info:
        RunnerConfig(generation_config="/nonexistent")
    assert info.value.flag == "--generation-config"


# ---------------------------------------------------------------------------------------------- output processor
def out(rid: int, tokens: list[int], finish: str | None = None, stop_reason: int | None = None,
        logprobs: list[TokenLogprobs] | None = None, error: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, tokens, None if logprobs is None else LogprobRows.of_entries(logprobs), finish,
                            stop_reason, error)


def test_output_kinds(tok) -> None:
    ids = tok.encode(" brown fox jumps", add_special_tokens=False)
    steps = [ids[:2], ids[2:5], ids[5:]]
    results = {}
    for kind in RequestOutputKind:
        proc = OutputProcessor(tok, max_model_len=64)
        proc.add_request("r", "The quick", tok.encode("The quick"), SamplingParams(output_kind=kind, max_tokens=9),
                         engine_request_ids=[7])
        seen = []
        for k, step in enumerate(steps):
            done = k == len(steps) - 1
            ros, aborts = proc.process_outputs([out(7, step, "length" if done else None)], now=100.0 + k)
            assert aborts == []
            seen += [(ro.finished, ro.outputs[0].text, ro.outputs[0].token_ids) for ro in ros]
        results[kind] = seen
        assert not proc.has_unfinished_requests()
    full = tok.decode(ids)
    assert results[RequestOutputKind.FINAL_ONLY] == [(True, full, ids)]
    assert [r[2] for r in results[RequestOutputKind.DELTA]] == steps
    assert "".join(r[1] for r in results[RequestOutputKind.DELTA]) == full
    assert [r[2] for r in results[RequestOutputKind.CUMULATIVE]] == [ids[:2], ids[:5], ids]
    assert results[RequestOutputKind.CUMULATIVE][-1][1] == full
    assert [r[0] for r in results[RequestOutputKind.CUMULATIVE]] == [False, False, True]


def test_stop_string_aborts_the_engine_request_and_metrics(tok) -> None:
    proc = OutputProcessor(tok, max_model_len=64)
    (req,) = proc.add_request("r", None, [1, 2], SamplingParams(stop="stop", output_kind=RequestOutputKind.DELTA),
                              arrival_time=10.0, engine_request_ids=[3])
    assert req.request_id == 3 and req.sampling_params.max_tokens == 16
    ids = tok.encode(TEXT, add_special_tokens=False)
    texts, abort_at = [], None
    for k, token in enumerate(ids):
        ros, aborts = proc.process_outputs([out(3, [token])], now=11.0 + k)
        texts += [ro.outputs[0].text for ro in ros]
        if aborts:
            abort_at = k
            assert aborts == [3] and ros[0].finished
            assert (ros[0].outputs[0].finish_reason, ros[0].outputs[0].stop_reason) == ("stop", "stop")
            metrics = ros[0].metrics
            break
    assert "".join(texts) == "One, two, three: " and abort_at is not None and metrics is not None
    assert (metrics.arrival_time, metrics.first_token_time, metrics.last_token_time, metrics.finished_time) == \
        (10.0, 11.0, 11.0 + abort_at, 11.0 + abort_at)
    assert proc.process_outputs([out(3, [5], "length")]) == ([], [])  # the core's late outputs are ignored


def test_parallel_sampling_seeds_and_final_aggregation(tok) -> None:
    proc = OutputProcessor(tok, max_model_len=64)
    seeded = proc.add_request("a", None, [1, 2], SamplingParams(n=3, seed=5, max_tokens=4,
                                                                 output_kind=RequestOutputKind.FINAL_ONLY),
                              engine_request_ids=[10, 11, 12], default_seed=99)
    assert [r.sampling_params.seed for r in seeded] == [5, 6, 7] and all(r.sampling_params.n == 1 for r in seeded)
    unseeded = proc.add_request("b", None, [1], SamplingParams(n=2, max_tokens=4), engine_request_ids=[20, 21],
                                default_seed=99)
    assert [r.default_seed for r in unseeded] == [99, (99 + CHILD_SEED_STRIDE) % 2**64]
    assert [r.sampling_params.seed for r in unseeded] == [None, None]
    with pytest.raises(ValueError, match="engine request id 10 is already in use"):
        proc.add_request("c", None, [1], SamplingParams(), engine_request_ids=[10])
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        proc.add_request("a", None, [1], SamplingParams(), engine_request_ids=[30])
    assert proc.process_outputs([out(11, [5, 6], "length"), out(10, [7], "stop", 7)])[0] == []  # not all done yet
    ros, _ = proc.process_outputs([out(12, [], "error", error="boom")])
    (ro,) = ros
    assert ro.request_id == "a" and ro.finished and ro.error == "boom"
    assert [(c.index, c.token_ids, c.finish_reason) for c in ro.outputs] == \
        [(0, [7], "stop"), (1, [5, 6], "length"), (2, [], "error")]
    # streaming (CUMULATIVE): each child's output as it comes, with its index
    ros, _ = proc.process_outputs([out(21, [3]), out(20, [4], "length")])
    assert [(r.outputs[0].index, r.finished) for r in ros] == [(1, False), (0, False)]
    (aborted,), engine_ids = proc.abort_requests(["b", "unknown"])
    assert engine_ids == [21] and not proc.has_unfinished_requests()
    assert aborted.finished and [(c.index, c.finish_reason) for c in aborted.outputs] == [(1, "abort")]


def test_logprobs_become_vllm_dicts_with_decoded_tokens(tok) -> None:
    proc = OutputProcessor(tok, max_model_len=64)
    proc.add_request("r", None, [1], SamplingParams(logprobs=2, max_tokens=2,
                                                    output_kind=RequestOutputKind.FINAL_ONLY),
                     engine_request_ids=[0])
    a, b = tok.encode("fox", add_special_tokens=False)[:1] + tok.encode(" brown", add_special_tokens=False)[:1]
    entries = [TokenLogprobs(a, -0.5, 1, [a, b, 9], [-0.5, -1.5, -2.0]),
               TokenLogprobs(b, -3.0, 4, [a, 9, b], [-0.25, -1.0, -3.0])]
    (ro,), _ = proc.process_outputs([out(0, [a, b], "length", logprobs=entries)])
    c = ro.outputs[0]
    assert c.cumulative_logprob == -3.5
    assert c.logprobs == [
        {a: Logprob(-0.5, 1, tok.decode([a])), b: Logprob(-1.5, 2, tok.decode([b]))},
        {b: Logprob(-3.0, 4, tok.decode([b])), a: Logprob(-0.25, 1, tok.decode([a])),
         9: Logprob(-1.0, 2, tok.decode([9]))},
    ]
    assert list(c.logprobs[1]) == [b, a, 9]  # the sampled token first, then the top ones by rank


def test_missing_logprobs_fail_that_request_only(tok) -> None:
    proc = OutputProcessor(tok, max_model_len=64)
    for rid, lp in (("with", 1), ("without", None)):
        proc.add_request(rid, None, [1], SamplingParams(logprobs=lp, max_tokens=4,
                                                        output_kind=RequestOutputKind.FINAL_ONLY),
                         engine_request_ids=[0 if lp else 1])
    ros, aborts = proc.process_outputs([out(0, [5]), out(1, [6])])
    assert aborts == [0] and [r.request_id for r in ros] == ["with"]
    assert ros[0].outputs[0].finish_reason == "error"
    error = ros[0].error
    assert error is not None
    assert "logprobs=1 was asked for, but the engine core returned log-probabilities for 0 of 1" in error
    assert proc.unfinished_engine_request_ids() == [1]


def test_max_tokens_none_is_up_to_max_model_len_and_eos_ids_are_added(tok) -> None:
    gen = GenerationConfig(frozenset({2}), (7,))
    proc = OutputProcessor(tok, max_model_len=50, generation_config=gen)
    (req,) = proc.add_request("r", None, list(range(8)), SamplingParams(max_tokens=None), engine_request_ids=[0])
    assert req.sampling_params.max_tokens == 42
    assert req.sampling_params.stop_token_ids == [7] and req.sampling_params.all_stop_token_ids == {2, 7}
    with pytest.raises(ValueError, match="stop strings .* need a tokenizer"):
        OutputProcessor(None, 50).add_request("s", None, [1], SamplingParams(stop="x"), engine_request_ids=[1])
    no_text = OutputProcessor(None, 50)
    no_text.add_request("t", None, [1], SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY),
                        engine_request_ids=[0])
    (ro,), _ = no_text.process_outputs([out(0, [4, 5], "length")])
    assert (ro.outputs[0].text, ro.outputs[0].token_ids) == ("", [4, 5])


def test_llm_takes_vllms_engine_argument_names() -> None:
    from runner.config import make_config

    names: dict[str, Any] = dict(
        model="tiny-qwen3-moe", dtype="bfloat16", seed=3, data_parallel_size=2, enable_expert_parallel=True,
        enable_dbo=True, max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.5, generation_config="vllm")
    cfg = make_config(**names)
    assert {k: getattr(cfg, k) for k in names} == names
