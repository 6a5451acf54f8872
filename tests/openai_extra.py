"""The fields this server adds to OpenAI's responses (``stop_reason``, ``token_ids``, ``max_model_len``), as the
``openai`` client returns them: pydantic keeps fields outside OpenAI's schema in ``model_extra``."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def extra_fields(model: BaseModel) -> dict[str, Any]:
    """``model``'s fields beyond OpenAI's schema (the client's models accept extra fields, so never None)."""
    assert model.model_extra is not None
    return model.model_extra
