"""LLM.generate over a fake model runner: ordering, outputs, errors per request, prompts forms, stats."""
from __future__ import annotations

import io

import pytest

from fake_runner import FakeRunner, reference_generate
from runner.config import RunnerConfig
from runner.entrypoints.llm import LLM, GenerationStats
from runner.sampling_params import SamplingParams

VOCAB = 64


class ToyTokenizer:
    """Characters -> ids (mod vocab), ids -> letters: enough to see text round-trip through the engine."""

    def encode(self, text: str) -> list[int]:
        return [ord(ch) % VOCAB for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def make_llm(**cfg) -> LLM:
    cfg.setdefault("max_num_batched_tokens", 16)
    runner = FakeRunner(vocab_size=VOCAB, num_kv_blocks=128, max_model_len=cfg.get("max_model_len") or 256)
    return LLM(RunnerConfig(**cfg), runner=runner, tokenizer=ToyTokenizer())


def test_outputs_in_input_order_match_reference_and_stats() -> None:
    llm = make_llm(max_num_seqs=3, seed=5)
    prompts = [[1, 2, 3], list(range(20)), [7], [9, 9, 9, 9]]
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=2, temperature=1.0),
              SamplingParams(max_tokens=5, temperature=0.7, top_p=0.5, seed=3), SamplingParams(max_tokens=1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1", "2", "3"]
    for i, (o, p, s) in enumerate(zip(outs, prompts, params, strict=True)):
        assert o.prompt_token_ids == p and o.error is None and o.finished and o.prompt is None
        (c,) = o.outputs
        assert (c.token_ids, c.finish_reason) == reference_generate(p, s, VOCAB, 5 * 1_000_003 + i)
        assert c.text == ToyTokenizer().decode(c.token_ids) and c.index == 0
        m = o.metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        assert m.finished_time is not None
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    st = llm.last_stats
    assert isinstance(st, GenerationStats)
    assert (st.num_requests, st.num_errors, st.num_prompt_tokens, st.num_output_tokens) == (4, 0, 28, 12)
    assert st.num_steps == llm.runner.num_steps > 0 and "requests: 4 (0 errors)" in st.summary()
    again = llm.generate(prompts, params, use_tqdm=False)  # state fully released between calls
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert [o.request_id for o in again] == ["4", "5", "6", "7"]  # ids continue across calls, as vLLM's


@pytest.mark.parametrize("bad, message", [
    ([], "prompt 1: the prompt is empty: at least one token is needed"),
    ([1, 99], "prompt 1: token id 99 at position 1 is outside the vocabulary [0, 64)"),
    (list(range(10)), "prompt 1: the prompt has 10 tokens but max_model_len is 10: prompt + 1 generated token must "
                      "fit (prompt length <= 9)"),
])
def test_a_bad_prompt_raises_naming_it_and_the_limit_before_any_step(bad: list[int], message: str) -> None:
    llm = make_llm(max_model_len=10)
    with pytest.raises(ValueError) as info:
        llm.generate([[1, 2], bad, [3]], SamplingParams(max_tokens=2))
    assert str(info.value) == message
    assert llm.runner.num_steps == 0  # refused before any step ran
    assert [len(o.outputs[0].token_ids) for o in llm.generate([[1, 2], [3]], SamplingParams(max_tokens=2))] == [2, 2]


def test_a_bad_text_prompt_is_named_with_its_text() -> None:
    llm = make_llm(max_model_len=10)
    with pytest.raises(ValueError, match=r"^prompt 0 \('a very long prompt indeed'\): the prompt has 25 tokens but "
                                         "max_model_len is 10"):
        llm.generate("a very long prompt indeed", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^prompt 0 \(''\): the prompt is empty"):
        llm.generate("")


def test_dict_sampling_params_is_a_clear_error() -> None:
    llm = make_llm()
    with pytest.raises(TypeError, match=r"sampling_params is a dict \(\{'max_tokens': 2\}\); pass "
                                        r"SamplingParams\(\*\*that dict\)"):
        llm.generate("Hi", {"max_tokens": 2})  # type: ignore[arg-type]  # the refused type
    with pytest.raises(TypeError, match=r"sampling_params\[1\] is dict, not SamplingParams; pass SamplingParams"):
        llm.generate(["Hi", "yo"], [SamplingParams(), {"max_tokens": 2}])  # type: ignore[list-item]  # refused


def test_prompt_forms() -> None:
    llm = make_llm()
    outs = llm.generate(["hi", {"prompt": "yo"}, {"prompt_token_ids": [4, 5]}, [4, 5]],
                        SamplingParams(temperature=0.0, max_tokens=3))
    assert outs[0].prompt_token_ids == ToyTokenizer().encode("hi")
    assert (outs[0].prompt, outs[1].prompt, outs[2].prompt, outs[3].prompt) == ("hi", "yo", None, None)
    assert outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids
    # a single string is one prompt
    assert len(llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=1))) == 1
    with pytest.raises(TypeError, match=r"flat list of ints; pass a list of prompts, e.g. \[\[1, 2, 3\]\]"):
        llm.generate([1, 2, 3])
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(TypeError, match="prompt 1 must be a string or a list of token ids, got float"):
        llm.generate([[1], 2.5])


def test_text_prompt_without_tokenizer_is_a_clear_error() -> None:
    llm = LLM(RunnerConfig(), runner=FakeRunner(vocab_size=VOCAB))
    llm._tokenizer_loaded = True  # what load_tokenizer returns for the built-in models: no tokenizer files
    with pytest.raises(ValueError, match="prompt 1 is text but model 'tiny-qwen3-moe' has no tokenizer"):
        llm.generate([[1, 2], "hello"])
    with pytest.raises(ValueError, match=r"stop strings \['x'\] need a tokenizer .* model 'tiny-qwen3-moe' has none"):
        llm.generate([[1, 2]], SamplingParams(stop="x"))


def test_external_launcher_without_a_launched_world_explains_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="'external_launcher' needs a world launched outside this LLM: .*torchrun "
                                           "--nproc-per-node 2"):
        LLM(data_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        LLM(max_num_seq=4)


def test_progress_bar_only_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm()
    assert llm._progress_bar(3, disable=False) is None  # pytest captures stderr: not a TTY

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Tty())
    bar = llm._progress_bar(3, disable=False)
    assert bar is not None and bar.total == 3
    bar.close()
    assert llm._progress_bar(3, disable=True) is None
    llm.generate([[1, 2]], SamplingParams(max_tokens=2))  # the loop drives the bar without errors


def test_text_prompts_with_a_real_tokenizer_and_model(tmp_path) -> None:
    """A local model directory with tokenizer.json: text in, text out, through the real model runner."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from runner.models.loader import resolve_model_path

    src = resolve_model_path("tiny-qwen3-moe")
    model_dir = tmp_path / "tiny-with-tokenizer"
    model_dir.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, model_dir / f)
    words = ["[UNK]", "the", "quick", "brown", "fox", "jumps"] + [f"w{i}" for i in range(100)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    llm = LLM(model=str(model_dir))
    outs = llm.generate(["the quick brown fox", "jumps"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert outs[0].prompt_token_ids == [1, 2, 3, 4] and outs[1].prompt_token_ids == [5]
    for o in outs:
        (c,) = o.outputs  # the text continues the prompt's: WordLevel's decoder puts a space between words
        whole, prompt = tok.decode(o.prompt_token_ids + c.token_ids), tok.decode(o.prompt_token_ids)
        assert len(c.token_ids) == 3 and c.text == whole[len(prompt):]
    by_ids = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3))[0].outputs[0]
    assert by_ids.token_ids == outs[0].outputs[0].token_ids and by_ids.text == outs[0].outputs[0].text
    llm.close()


def test_numpy_and_torch_integer_token_ids_are_accepted() -> None:
    import numpy as np
    import torch

    llm = make_llm()
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    want = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], sp)]
    forms = [[np.int64(1), np.int32(2), np.uint8(3)], np.array([4, 5])]
    assert [o.outputs[0].token_ids for o in llm.generate(forms, sp)] == want
    # a 2-D array: one row each
    assert [o.outputs[0].token_ids for o in llm.generate(np.array([[1, 2, 3]]), sp)] == want[:1]
    assert [o.outputs[0].token_ids for o in llm.generate([torch.tensor([4, 5])], sp)] == want[1:]
    with pytest.raises(ValueError, match=r"^prompt 0: the token at position 0 is np.float64\(1.0\), not an integer"):
        llm.generate([[np.float64(1.0)], [2]], sp)  # still not token ids
    with pytest.raises(ValueError, match="^prompt 1: the token at position 0 is True, not an integer token id"):
        llm.generate([[2], [True, 2]], sp)
    with pytest.raises(TypeError, match="flat list of ints"):
        llm.generate(np.array([1, 2, 3]))


def test_prompt_token_count_leaves_out_rejected_prompts() -> None:
    runner = FakeRunner(vocab_size=VOCAB, num_kv_blocks=2, max_model_len=256)  # 32 tokens of KV cache
    llm = LLM(RunnerConfig(max_num_batched_tokens=16), runner=runner, tokenizer=ToyTokenizer())
    outs = llm.generate([[1, 2], list(range(40))], SamplingParams(max_tokens=2))  # the second never fits the cache
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error"]
    st = llm.last_stats
    assert st is not None
    assert (st.num_requests, st.num_errors, st.num_prompt_tokens) == (2, 1, 2)
    assert "prompt tokens: 2 |" in st.summary()


def test_max_model_len_above_the_models_positions_is_rejected() -> None:
    from runner.config import ConfigError

    with pytest.raises(ConfigError, match=r"max_model_len 4097 is above the model's max_position_embeddings "
                                          r"\(4096\); use at most 4096") as info:
        LLM(model="tiny-qwen3-moe", max_model_len=4097)
    assert info.value.flag == "--max-model-len"


def test_trace_file_in_a_missing_directory_is_refused_before_the_run(tmp_path) -> None:
    from runner.config import ConfigError

    with pytest.raises(ConfigError, match=f"trace_file: cannot write '{tmp_path}/no/t.json': its directory "
                                          f"'{tmp_path}/no' does not exist") as info:
        make_llm(trace_file=str(tmp_path / "no" / "t.json"))
    assert info.value.flag == "--trace-file" and not (tmp_path / "no").exists()
