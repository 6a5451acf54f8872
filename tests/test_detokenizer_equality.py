"""The incremental detokenizer's texts decoded from the tokens' bytes (byte-level tokenizers, ``byte_level.py``)
equal those of the tokenizer's two decodes per token, on random token streams: multi-byte characters split over
tokens, bytes that never make a character, special tokens skipped or kept, stop strings (kept in the output or
not), several tokens per step, stop-terminated ends, DELTA and cumulative reads. A third check needs no
detokenizer: without stop strings and stray bytes the whole text is the tokenizer's decode of every token."""
from __future__ import annotations

import random
from dataclasses import fields

import pytest

from runner.core.logprob_rows import LogprobRows, TokenLogprobs
from runner.core.requests import EngineCoreOutput
from runner.engine.byte_level import byte_level_table
from runner.engine.detokenizer import IncrementalDetokenizer
from runner.engine.output_processor import OutputProcessor
from runner.engine.tokenizer import make_decoder
from runner.outputs import CompletionOutput, RequestOutput
from runner.sampling_params import RequestOutputKind, SamplingParams

pytest.importorskip("transformers")

from tiny_checkpoint import SENTENCES, build_tokenizer

UTF8 = "Caf\u00e9 cr\u00e8me, \u6771\u4eac and \u65e5\u672c\u8a9e text \U0001f600, a real \ufffd."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def random_tokens(tok, rng: random.Random, length: int) -> list[int]:
    """Pieces of real text (whole and split characters) mixed with any ids of the vocabulary (stray bytes,
    special tokens)."""
    texts = list(SENTENCES) + [UTF8]
    out: list[int] = []
    while len(out) < length:
        if rng.random() < 0.6:
            ids = tok.encode(rng.choice(texts), add_special_tokens=False)
            start = rng.randrange(len(ids))
            out += ids[start:start + rng.randrange(1, 12)]
        else:
            out += [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 4))]
    return out[:length]


def random_params(tok, rng: random.Random, tokens: list[int]) -> SamplingParams:
    stop: list[str] | None = None
    if rng.random() < 0.5:
        whole = make_decoder(tok, skip_special_tokens=True)(tokens)
        stop = []
        for _ in range(rng.randrange(1, 3)):
            start = rng.randrange(max(1, len(whole)))
            piece = whole[start:start + rng.randrange(1, 5)]
            if piece:
                stop.append(piece)
        stop = stop or None
    return SamplingParams(max_tokens=len(tokens) + 1, stop=stop, include_stop_str_in_output=rng.random() < 0.5,
                          skip_special_tokens=rng.random() < 0.7, spaces_between_special_tokens=rng.random() < 0.5)


def run(det: IncrementalDetokenizer, steps: list[list[int]], stop_terminated: bool,
        reads: list[tuple[bool, bool]]) -> list[object]:
    """Everything the detokenizer says over a request: each step's stop string and text reads."""
    said: list[object] = []
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        stop = det.update(step, stop_terminated and last)
        finished = stop is not None or last
        for delta, early_finish in reads[i:i + 1]:
            said.append((stop, det.get_next_output_text(finished or early_finish, delta), det.output_text))
        if stop is not None:
            break
    said.append(det.get_next_output_text(True, False))
    return said


def test_the_tiny_tokenizer_is_byte_level(tok) -> None:
    table = byte_level_table(tok)
    assert table is not None
    assert table.get(tok.convert_tokens_to_ids("<|im_end|>")) is None  # added tokens: the tokenizer decodes them

    def piece(token: int) -> bytes:
        found = table.get(token)
        assert found is not None, f"token {token} is not in the byte-level table"
        return found

    assert b"".join(piece(t) for t in tok.encode("Caf\u00e9", add_special_tokens=False)) == "Caf\u00e9".encode()


@pytest.mark.parametrize("seed", range(6))
def test_byte_texts_equal_real_decodes_on_random_streams(tok, seed: int) -> None:
    rng = random.Random(seed)
    checked_whole = 0
    byte_table = byte_level_table(tok)
    for _ in range(60):
        tokens = random_tokens(tok, rng, rng.randrange(1, 40))
        prompt = random_tokens(tok, rng, rng.randrange(1, 10))
        params = random_params(tok, rng, tokens)
        steps, at = [], 0
        while at < len(tokens):
            size = 1 if rng.random() < 0.8 else rng.randrange(1, 4)
            steps.append(tokens[at:at + size])
            at += size
        stop_terminated = rng.random() < 0.3
        reads = [(rng.random() < 0.7, rng.random() < 0.05) for _ in steps]
        fast = IncrementalDetokenizer(tok, prompt, params, {}, byte_table)
        real = IncrementalDetokenizer(tok, prompt, params, {}, None)
        assert run(fast, steps, stop_terminated, reads) == run(real, steps, stop_terminated, reads), \
            (prompt, steps, params)
        if not params.stop:
            decoded = tokens[:-1] if stop_terminated and not params.include_stop_str_in_output else tokens
            whole = make_decoder(tok, skip_special_tokens=params.skip_special_tokens)(decoded)
            if "\ufffd" not in whole:  # stray bytes: the incremental text places them by its windows
                assert fast.output_text == whole
                checked_whole += 1
    assert checked_whole >= 1


def test_output_processor_streams_equal_with_and_without_bytes(tok) -> None:
    """Whole requests through the output processor (n > 1, every output kind, log-probabilities, stop strings
    kept or cut, several tokens per step): the same RequestOutputs and aborts, decoded from bytes or not."""
    rng = random.Random(7)
    with_bytes = OutputProcessor(tok, max_model_len=256)
    without = OutputProcessor(tok, max_model_len=256)
    without._byte_table = None  # the tokenizer's decodes only: the reference
    assert with_bytes._byte_table is not None
    engine_ids = iter(range(10**6))
    live: dict[int, list[int]] = {}  # engine request id -> its tokens still to come
    for r in range(40):
        tokens_of = random_tokens(tok, rng, 30)
        params = random_params(tok, rng, tokens_of)
        params.n = rng.choice([1, 1, 2, 3])
        params.logprobs = rng.choice([None, None, 1, 2])
        params.output_kind = rng.choice(list(RequestOutputKind))
        prompt = random_tokens(tok, rng, rng.randrange(1, 9))
        ids = [next(engine_ids) for _ in range(params.n)]
        for proc in (with_bytes, without):
            proc.add_request(f"r{r}", None, prompt, params.clone(), 5.0, engine_request_ids=ids)
        for eid in ids:
            live[eid] = random_tokens(tok, rng, rng.randrange(1, 30))
    step = 0
    while live:
        step += 1
        outputs = []
        for eid in rng.sample(sorted(live), min(len(live), 25)):
            left = live[eid]
            new = left[:rng.choice([1, 1, 1, 2, 3])]
            live[eid] = left[len(new):]
            finish = None if live[eid] else rng.choice(["length", "stop"])
            if finish is not None:
                del live[eid]
            entries = [TokenLogprobs(t, -0.5, 1, [t, 3], [-0.5, -1.0]) for t in new]
            outputs.append(EngineCoreOutput(eid, new, LogprobRows.of_entries(entries), finish, None))
        got = with_bytes.process_outputs(outputs, now=100.0 + step)
        assert got == without.process_outputs(outputs, now=100.0 + step)
        for eid in got[1]:
            live.pop(eid, None)
    assert not with_bytes.has_unfinished_requests() and not without.has_unfinished_requests()


def test_outputs_are_built_in_their_fields_order() -> None:
    """The output processor builds them positionally (per token, keywords cost more): the order it assumes."""
    assert [f.name for f in fields(CompletionOutput)] == ["index", "text", "token_ids", "cumulative_logprob",
                                                          "logprobs", "finish_reason", "stop_reason"]
    assert [f.name for f in fields(RequestOutput)] == ["request_id", "prompt", "prompt_token_ids", "outputs",
                                                       "finished", "metrics", "error", "prompt_logprobs",
                                                       "num_cached_tokens"]
