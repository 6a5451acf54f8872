"""A tiny Qwen3-MoE checkpoint written by transformers, with a real tokenizer and chat template: what a user's
checkpoint directory holds, small enough for CPU tests.

- ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: a byte-level BPE trained with the
  ``tokenizers`` library on a few sentences (ASCII and multi-byte UTF-8), wrapped in transformers'
  ``PreTrainedTokenizerFast`` with special tokens (``<|endoftext|>`` pad, ``<|im_start|>``, ``<|im_end|>``
  EOS, ``<s>`` BOS added to every encoded text by ``add_bos_token``) and a ChatML chat template, saved by
  ``save_pretrained``.
- ``config.json`` / ``model.safetensors``: a seeded random ``Qwen3MoeForCausalLM`` whose vocabulary is the
  tokenizer's; its ``eos_token_id`` is ``<|im_end|>``.
- ``generation_config.json``: ``eos_token_id`` lists ``<|im_end|>`` and a second id, chosen as a token that
  transformers' greedy generation emits a few tokens into :data:`PROMPT` (so a run that ignores the file goes
  past it, and one that reads it stops there), plus sampling defaults (:data:`SAMPLING_DEFAULTS`).

Use the ``tiny_chat_checkpoint`` fixture (session-scoped: built once): ``from tiny_checkpoint import
tiny_chat_checkpoint`` in a test module, then take it as an argument; it is a :class:`TinyCheckpoint`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Dual batch overlap hides the expert all-to-all behind the other micro-batch's compute.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve \u00fcber, \u6771\u4eac and \u65e5\u672c\u8a9e text.",
    "One, two, three: stop here. END of the line.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
PROMPT = "The quick brown fox"
SAMPLING_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
SEED = 0


@dataclass
class TinyCheckpoint:
    path: Path
    eos_token_id: int  # config.json's (<|im_end|>)
    second_eos_token_id: int  # generation_config.json's other EOS id
    greedy_no_eos: list[int]  # transformers' greedy continuation of PROMPT, 16 tokens, no EOS at all

    @property
    def generation_config_eos(self) -> list[int]:
        return [self.eos_token_id, self.second_eos_token_id]


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", add_bos_token=True, chat_template=CHAT_TEMPLATE)


def build_model(vocab_size: int, eos: int, bos: int, pad: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(SEED)
    # transformers types the config's __init__ without head_dim and the rope_theta / attn_implementation keywords
    # it still takes (and stores)
    cfg = transformers.Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, initializer_range=0.1, rope_theta=10000.0, max_position_embeddings=512,
        eos_token_id=eos, bos_token_id=bos, pad_token_id=pad, tie_word_embeddings=False, attn_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def write_checkpoint(path: Path) -> TinyCheckpoint:
    import torch

    tokenizer = build_tokenizer()
    eos, bos, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<s>", "<|endoftext|>"))
    model = build_model(len(tokenizer), eos, bos, pad)
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=pad)[0, len(ids):].tolist()
    # the second EOS: the first token from the fourth on that greedy decoding has not emitted before
    second = next(t for i, t in enumerate(out) if i >= 3 and t not in out[:i] and t != eos)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos, second], "bos_token_id": bos, "pad_token_id": pad, "do_sample": True,
         **SAMPLING_DEFAULTS}, indent=1))
    return TinyCheckpoint(path, eos, second, out)


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    pytest.importorskip("transformers")
    return write_checkpoint(tmp_path_factory.mktemp("tiny-chat-qwen3-moe"))
