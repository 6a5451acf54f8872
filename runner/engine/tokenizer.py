"""The checkpoint's tokenizer and the three things the engine asks of it: encode a prompt, decode ids, render a chat.

transformers loads it whenever it can (``AutoTokenizer`` with ``tokenizer_config.json``, the generic
``PreTrainedTokenizerFast`` with only a ``tokenizer.json``); the ``tokenizers`` library reads the file itself
only where transformers is missing or fails (:class:`TokenizersAdapter`, logged once). Prompts and chats are
encoded as vLLM encodes them. Design: docs/design_notes.md, "Engine client".
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ubatch.log_once import log_once

logger = logging.getLogger("ubatch.engine")

# Any of these in a model directory means it ships a tokenizer (the built-in tiny models have none).
# A checkpoint's tokenizer: transformers' tokenizer, a ``tokenizers.Tokenizer`` (the fallback), or a test stand-in
# with their calls. Third-party and duck-typed (the calls used are ``encode``/``decode`` and the vocabulary's), so
# typed as Any once, here.
Tokenizer = Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class NoChatTemplateError(ValueError):
    """The model's tokenizer has no chat template, and none was given."""


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


class TokenizersAdapter:
    """A ``tokenizers.Tokenizer`` behind the calls the engine makes (``encode``, ``decode``, ``len``), used
    only where transformers cannot load the tokenizer: no chat template, no ``tokenizer_config.json``."""

    chat_template = None

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.backend = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def load_tokenizer(model: str, cache_dir: str | os.PathLike | None = None) -> Any | None:
    """The tokenizer of ``model`` (a local directory or a built-in name), or None when it ships none."""
    from runner.models.loader import resolve_model_path

    return load_tokenizer_from_dir(resolve_model_path(model, cache_dir))


def load_tokenizer_from_dir(path: str | os.PathLike) -> Any | None:
    """transformers' tokenizer for the files in ``path`` (module docstring), or None if there are none."""
    path = Path(path)
    if not has_tokenizer_files(path):
        return None
    try:
        import transformers
    except ImportError:
        return _tokenizers_fallback(path, "transformers is not installed")
    try:
        if (path / "tokenizer_config.json").is_file() or not (path / "tokenizer.json").is_file():
            return transformers.AutoTokenizer.from_pretrained(str(path))
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - any failure of transformers' loader: say which, use tokenizers
        return _tokenizers_fallback(path, f"transformers could not load it ({type(e).__name__}: {e})")


def _tokenizers_fallback(path: Path, why: str) -> TokenizersAdapter:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {why}, and there is no tokenizer.json for "
                         "the tokenizers library to read") from None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(f"{file}: {why}, and the tokenizers package is not installed either "
                          "(pip install transformers)") from None
    log_once(logger, logging.WARNING, f"{file}: {why}; read with the tokenizers library instead: no chat template "
                                      "and none of tokenizer_config.json's settings")
    return TokenizersAdapter(Tokenizer.from_file(str(file)))


@functools.cache
def _transformers_base() -> type | None:
    """transformers' tokenizer base class, looked up once (its lazy module makes each import a slow lookup, and
    every request's detokenizer asks), or None without transformers."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return None
    return PreTrainedTokenizerBase


def _is_transformers(tokenizer: Tokenizer) -> bool:
    base = _transformers_base()
    return base is not None and isinstance(tokenizer, base)


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text`` as token ids; with ``add_special_tokens`` the tokenizer's defaults apply (vLLM's encode)."""
    ids = tokenizer.encode(text) if add_special_tokens else tokenizer.encode(text, add_special_tokens=False)
    return list(ids.ids) if hasattr(ids, "ids") else [int(t) for t in ids]


def rust_backend(tokenizer: Tokenizer) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a fast transformers tokenizer or a :class:`TokenizersAdapter`; None
    for any other (slow) tokenizer."""
    if _is_transformers(tokenizer):
        return getattr(tokenizer, "backend_tokenizer", None)
    return tokenizer.backend if isinstance(tokenizer, TokenizersAdapter) else None


def make_decoder(tokenizer: Tokenizer, *, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """A function from ids to text, with no clean-up of spaces (vLLM's detokenizer does none either: it would
    make incremental text differ from the whole). A fast tokenizer's Rust backend is called directly: that is
    what its ``decode`` does without clean-up, at a fifth of the cost (the detokenizer decodes twice per
    token). ``spaces_between_special_tokens=False`` goes to transformers' ``decode``, where slow tokenizers use
    it; fast ones join added tokens without spaces anyway."""
    backend = rust_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    if _is_transformers(tokenizer):
        extra = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                            clean_up_tokenization_spaces=False, **extra)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def decode(tokenizer: Tokenizer, ids: Sequence[int], *, skip_special_tokens: bool,
           spaces_between_special_tokens: bool = True) -> str:
    """``ids`` as text (:func:`make_decoder`)."""
    return make_decoder(tokenizer, skip_special_tokens=skip_special_tokens,
                        spaces_between_special_tokens=spaces_between_special_tokens)(list(ids))


def chat_template_of(tokenizer: Tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template or None


def apply_chat_template(tokenizer: Tokenizer, conversation: list[dict[str, Any]], *, model: str,
                        chat_template: str | None = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """(the rendered prompt, its ids): the template renders the text, which is encoded without adding special
    tokens. Raises :class:`NoChatTemplateError` naming ``model`` when neither the tokenizer nor the caller
    has a template."""
    if tokenizer is None:
        raise NoChatTemplateError(f"model {model!r} has no tokenizer, so it has no chat template; pass "
                                  "token-id prompts to generate() instead")
    template = chat_template or chat_template_of(tokenizer)
    if template is None:
        raise NoChatTemplateError(
            f"model {model!r} has no chat template (no 'chat_template' in tokenizer_config.json and no "
            "chat_template.jinja); pass chat_template=... or use generate() with a text prompt")
    if not _is_transformers(tokenizer):
        raise NoChatTemplateError(f"model {model!r}: its tokenizer was read without transformers, which renders "
                                  "chat templates; install transformers")
    text = tokenizer.apply_chat_template(conversation, chat_template=template, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         **(chat_template_kwargs or {}))
    return text, encode(tokenizer, text, add_special_tokens=False)
