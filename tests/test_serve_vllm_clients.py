"""What common vLLM clients ask of ``python -m runner serve`` beyond completions and chat: ``/tokenize`` and
``/detokenize`` with vLLM's shapes, ``--tokenizer`` (a model whose tokenizer lives elsewhere), ``--chat-template``
(the template applied is the one given) and ``--max-logprobs``; one real server over the transformers-written chat
checkpoint (``tiny_checkpoint.py``), its tokenizer files moved to a directory of their own."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runner.engine.tokenizer import TOKENIZER_FILES
from runner.entrypoints.benchserve.server_proc import ServerProcess
from runner.entrypoints.cli import main
from tiny_checkpoint import TinyCheckpoint

transformers = pytest.importorskip("transformers")

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}" \
           "{% if add_generation_prompt %}<<assistant|{% endif %}"
MESSAGES = [{"role": "user", "content": "Hello world"}]


def split_checkpoint(ck: TinyCheckpoint, root: Path) -> tuple[Path, Path]:
    """(a model directory without tokenizer files, a directory with only them)."""
    model, tok = root / "model", root / "tokenizer"
    model.mkdir()
    tok.mkdir()
    for f in ck.path.iterdir():
        is_tokenizer = f.name in TOKENIZER_FILES or f.name in ("special_tokens_map.json", "chat_template.jinja")
        shutil.copy(f, (tok if is_tokenizer else model) / f.name)
    return model, tok


@pytest.fixture(scope="module")
def dirs(tiny_chat_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return split_checkpoint(tiny_chat_checkpoint, tmp_path_factory.mktemp("split"))


@pytest.fixture(scope="module")
def server(dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess(str(dirs[0]), f"--device cpu --max-num-seqs 4 --tokenizer {dirs[1]} --chat-template "
                                      f"{template} --max-logprobs 3", startup_timeout_s=300, name="clients")
    srv.start()
    try:
        yield srv
    finally:
        code = srv.stop()
        srv.finish_log(keep=False)
    assert code == 0


@pytest.fixture(scope="module")
def tok(dirs: tuple[Path, Path]) -> Any:
    return transformers.AutoTokenizer.from_pretrained(dirs[1])


def post(srv: ServerProcess, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{route}", json=body, timeout=60)


def test_tokenize_and_detokenize_round_trip(server: ServerProcess, tok: Any) -> None:
    text = "Caf\u00e9 cr\u00e8me, the quick brown fox."
    got = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])  # with BOS, as a completion
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"]) and got["max_model_len"] > 0
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == got["tokens"][1:] and bare["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": text}
    err = post(server, "/detokenize", {"tokens": [1, 10 ** 6]})
    assert err.status_code == 400
    assert "token id 1000000, outside the model's vocabulary" in err.json()["error"]["message"]
    err = post(server, "/tokenize", {"prompt": "x", "model": "other"})
    assert err.status_code == 404 and "The model `other` does not exist" in err.json()["error"]["message"]


def test_the_chat_template_given_is_the_one_applied(server: ServerProcess, tok: Any) -> None:
    rendered = "<<user|Hello world>><<assistant|"
    want = tok(rendered, add_special_tokens=False)["input_ids"]
    assert post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"] == want
    chat = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                                 "return_token_ids": True}).json()
    assert chat["usage"]["prompt_tokens"] == len(want) and chat["choices"][0]["prompt_token_ids"] == want


def test_max_logprobs_bounds_requests(server: ServerProcess) -> None:
    ok = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, "logprobs": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["tokens"]) == 1
    err = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, "logprobs": 4})
    assert err.status_code == 400 and "logprobs must be an integer in [0, 3], got 4" in err.json()["error"]["message"]


@pytest.mark.parametrize("flags, message", [
    (["--chat-template", "/nonexistent/t.jinja"], "argument --chat-template: cannot read '/nonexistent/t.jinja'"),
    (["--chat-template", "{% for m in messages %}"], "argument --chat-template: not a valid Jinja template"),
    (["--tokenizer", "/nonexistent"], "argument --tokenizer: '/nonexistent' is not a directory holding tokenizer"),
    (["--max-logprobs", "-2"], "argument --max-logprobs: must be -1 or lie in [0, "),
])
def test_bad_client_flags_exit_2_before_any_rank_starts(dirs: tuple[Path, Path], flags: list[str], message: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", str(dirs[0]), "--device", "cpu", *flags])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_generate_with_a_tokenizer_from_elsewhere(dirs: tuple[Path, Path], tmp_path: Path, tok: Any) -> None:
    out = tmp_path / "o.json"
    assert main(["generate", str(dirs[0]), "--tokenizer", str(dirs[1]), "--prompt", "Hello world", "--max-tokens",
                 "2", "--dtype", "float32", "--output-json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["prompt_token_ids"] == tok.encode("Hello world") and result["outputs"][0]["text"] is not None


# ---------------------------------------------------------------------------------------------- echo, prompt logprobs
@pytest.fixture(scope="module")
def hf_logprobs(dirs: tuple[Path, Path]) -> Any:
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> Any:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


SCORED = "The quick brown fox jumps over the lazy dog."


def test_echo_scores_the_prompt_as_lm_eval_asks(server: ServerProcess, tok: Any, hf_logprobs: Any) -> None:
    """lm-evaluation-harness' log-likelihood request: echo, logprobs=1, max_tokens=0."""
    got = post(server, "/v1/completions", {"prompt": SCORED, "echo": True, "logprobs": 1, "max_tokens": 0,
                                           "temperature": 0}).json()
    (choice,) = got["choices"]
    ids = tok.encode(SCORED)
    want = hf_logprobs(ids)
    assert choice["text"] == SCORED and got["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids] and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][1:] == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                     abs=1e-4)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]


def test_echo_with_generation_and_prompt_logprobs(server: ServerProcess, tok: Any, hf_logprobs: Any) -> None:
    got = post(server, "/v1/completions", {"prompt": SCORED, "echo": True, "logprobs": 1, "max_tokens": 3,
                                           "temperature": 0, "prompt_logprobs": 2}).json()
    (choice,) = got["choices"]
    plain = post(server, "/v1/completions", {"prompt": SCORED, "max_tokens": 3, "temperature": 0}).json()
    generated = plain["choices"][0]["text"]
    ids = tok.encode(SCORED)
    want = hf_logprobs(ids)
    assert choice["text"] == SCORED + generated and len(choice["logprobs"]["tokens"]) == len(ids) + 3
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        assert entry["rank"] == int((want[i - 1] >= want[i - 1, ids[i]]).sum())
        assert {int(t) for t, e in plp[i].items() if e["rank"] <= 2} == set(want[i - 1].topk(2).indices.tolist())
    no_echo = post(server, "/v1/completions", {"prompt": SCORED, "max_tokens": 3, "temperature": 0,
                                               "prompt_logprobs": 0}).json()["choices"][0]
    assert no_echo["text"] == generated and list(no_echo["prompt_logprobs"][1]) == [str(ids[1])]
    assert "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize("body, message", [
    ({"echo": True, "stream": True}, "echo and prompt_logprobs are answered without stream"),
    ({"prompt_logprobs": 4}, "prompt_logprobs must be an integer in [0, 3], got 4"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
])
def test_bad_echo_requests_are_400(server: ServerProcess, body: dict[str, Any], message: str) -> None:
    err = post(server, "/v1/completions", {"prompt": SCORED, **body})
    assert err.status_code == 400 and message in err.json()["error"]["message"], err.text
