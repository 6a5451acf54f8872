"""vLLM's ``--tokenizer`` (every CLI) and ``--chat-template`` / ``--max-logprobs`` (``serve``): a model whose
tokenizer or chat template lives elsewhere, and how many log-probabilities a request may ask for.

``--chat-template`` is vLLM's: a file holding a Jinja template, or the template itself; it replaces the
tokenizer's own, so ``/v1/chat/completions`` and ``/tokenize`` render with it. Every bad value exits 2 naming
its flag, before any rank starts.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_MAX_LOGPROBS = 20  # vLLM's


def add_tokenizer_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="DIR", help="a directory with the tokenizer files to use instead of the "
                   "model's (default: the model's own)")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chat template and log-probabilities (vLLM's flags)")
    g.add_argument("--chat-template", metavar="FILE|TEMPLATE", help="the Jinja chat template to apply to chat "
                   "requests, as a file or the template text (default: the tokenizer's own)")
    g.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS, metavar="N",
                   help="the most log-probabilities a request may ask for (logprobs, top_logprobs); -1: the "
                        f"vocabulary size (default {DEFAULT_MAX_LOGPROBS})")


def tokenizer_dir_or_exit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """``--tokenizer``, checked: a directory holding tokenizer files; None when not given."""
    from runner.engine.tokenizer import TOKENIZER_FILES, has_tokenizer_files

    path = args.tokenizer
    if path is None:
        return None
    if not Path(path).is_dir() or not has_tokenizer_files(path):
        parser.error(f"argument --tokenizer: {path!r} is not a directory holding tokenizer files (any of "
                     f"{', '.join(TOKENIZER_FILES)})")
    return str(path)


def read_chat_template(value: str, parser: argparse.ArgumentParser) -> str:
    """vLLM's rule: an existing file is read; text with template syntax is the template; anything else is a
    file name that does not exist (exit 2). The template must parse as Jinja."""
    path = Path(value)
    if "{" not in value and "\n" not in value:
        try:
            value = path.read_text()
        except OSError as e:
            parser.error(f"argument --chat-template: cannot read {str(path)!r}: {e.strerror or e} (give a file "
                         "or the template text)")
    try:
        import jinja2

        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        parser.error(f"argument --chat-template: not a valid Jinja template (line {e.lineno}: {e.message})")
    return value


def apply_chat_template_arg(tokenizer: Any, template: str | None, model: str,
                            parser: argparse.ArgumentParser) -> None:
    """Make ``template`` the tokenizer's chat template (what chat requests render with)."""
    if template is None:
        return
    if tokenizer is None:
        parser.error(f"argument --chat-template: model {model!r} has no tokenizer to render chats with; give "
                     "--tokenizer too")
    tokenizer.chat_template = template


def max_logprobs_or_exit(value: int, vocab_size: int, parser: argparse.ArgumentParser) -> int:
    if value == -1:
        return vocab_size
    if not 0 <= value <= vocab_size:
        parser.error(f"argument --max-logprobs: must be -1 or lie in [0, {vocab_size}] (the vocabulary), got {value}")
    return value
