"""``python -m runner serve`` on every standard-decoder family, through the official ``openai`` client: Mixtral
over DP=2 with expert parallelism and DBO, Qwen2-MoE and OLMoE with DBO, and the dense Llama, Qwen2 and Qwen3
with ``--enable-dbo``, which the server runs without DBO and says so in its log. Greedy completions equal
transformers' greedy continuation of the same token ids. The servers start concurrently (start-up is most of this
module's time).

The checkpoints are ``standard_families.py``'s, with the trained tokenizer of ``tiny_checkpoint.py``.
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from openai_extra import extra_fields
from runner.entrypoints.benchserve.server_proc import ServerProcess, scrape
from standard_families import make_hf
from tiny_checkpoint import build_tokenizer

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

from transformers import GenerationMixin, PreTrainedModel  # noqa: E402

ENGINE = "--device cpu --dtype float32 --max-num-seqs 8 --max-model-len 128 --dist-timeout-s 30 " \
         "--enable-dbo --dbo-decode-token-threshold 2 --dbo-prefill-token-threshold 2 --dbo-cost-model off"
SERVED = {"mixtral": "-dp 2 --enable-expert-parallel", "qwen2_moe": "", "olmoe": "", "llama": "", "qwen2": "",
          "qwen3": ""}
DENSE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PROMPTS = ["The quick brown fox", "Hello world! How are", "Caf\u00e9 cr\u00e8me and", "One, two, three:"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    tok = build_tokenizer()
    out = {}
    for family in SERVED:
        path = tmp_path_factory.mktemp(f"serve-{family}")
        hf = make_hf(family, vocab_size=len(tok))
        assert isinstance(hf, PreTrainedModel)
        hf.save_pretrained(path)
        tok.save_pretrained(path)
        out[family] = (hf, path)
    return out


@pytest.fixture(scope="module")
def servers(checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> Iterator[dict[str, ServerProcess]]:
    started = {family: ServerProcess(str(checkpoints[family][1]), f"{ENGINE} {extra}", startup_timeout_s=300,
                                     name=family) for family, extra in SERVED.items()}
    try:
        with ThreadPoolExecutor(len(started)) as pool:
            for done in [pool.submit(srv.start) for srv in started.values()]:
                done.result()
        yield started
    finally:
        codes = {name: srv.stop() for name, srv in started.items()}
    assert all(code == 0 for code in codes.values()), codes


@pytest.mark.parametrize("family", list(SERVED))
def test_greedy_completions_equal_transformers(servers: dict[str, ServerProcess],
                                               checkpoints: dict[str, tuple[PreTrainedModel, Path]],
                                               family: str) -> None:
    hf, path = checkpoints[family]
    assert isinstance(hf, GenerationMixin)  # a ...ForCausalLM
    tok = transformers.AutoTokenizer.from_pretrained(path)
    want = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        want.append(out[0, len(ids):].tolist())
    srv = servers[family]
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.completions.create(model=str(path), prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    choices = sorted(got.choices, key=lambda ch: ch.index)
    assert [extra_fields(ch)["token_ids"] for ch in choices] == want
    steps = scrape(srv.base_url, ("ubatch:dbo_ubatched_steps_total",))["ubatch:dbo_ubatched_steps_total"]
    if family in DENSE:
        assert steps == 0
        assert f"{DENSE[family]} has no MoE layers: --enable-dbo has nothing to overlap" in srv.log_tail(400)
    else:
        assert steps > 0  # DBO really ran in the server's steps
