"""OpenAI-shaped errors (``{"error": {"message", "type", "param", "code"}}``, vLLM's ``ErrorResponse``) and the
mapping of bad request bodies to them: malformed JSON, JSON nested deeper than the parser's recursion allows,
strings holding a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no Unicode text for a tokenizer),
pydantic validation errors and fields this server does not implement all become a 400 whose ``param`` names the
field, so a client can tell which of its settings was wrong.
"""
from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from runner.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# The error ``type`` per status, as vLLM names them (``create_error_response``) and the openai client's classes.
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.FORBIDDEN: "PermissionDeniedError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_TIMEOUT: "RequestTimeoutError",
    HTTPStatus.CONFLICT: "ConflictError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: "UnsupportedMediaTypeError",
    HTTPStatus.UNPROCESSABLE_ENTITY: "UnprocessableEntityError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error answered to the client: its HTTP status, message and the request field it names (if any)."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, *,
                 retry_after_s: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = HTTPStatus(status)
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        if retry_after_s is not None:  # a 503 that will pass
            self.headers["Retry-After"] = str(retry_after_s)

    def body(self) -> ErrorResponse:
        kind = ERROR_TYPES.get(self.status, "ServerError" if self.status >= 500 else "BadRequestError")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param,
                                             code=int(self.status)))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=int(self.status), headers=self.headers or None)


# Where a failure happened inside the server (``[/pytorch/third_party/gloo/.../pair.cc:534]``, a file path): for
# the server's log, not for clients.
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp|py):\d+\]\s*")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+[\w.+-]*")


def redact(message: str) -> str:
    """``message`` without source locations and absolute file paths, for an error body a client reads."""
    return _ABSOLUTE_PATH.sub("<path>", _SOURCE_LOCATION.sub("", message))


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param)


# Pydantic puts the member type of a union in the error location (``('prompt', 'list[int]', 1)``); these
# are not request fields. Field names are identifiers; type tags are not, or are one of these names.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "nullable"}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def param_path(loc: tuple[Any, ...]) -> str:
    """``('messages', 0, 'content')`` -> ``messages[0].content``; union type tags and dict keys dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _IDENT.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """The first error of a pydantic validation, as a 400 naming its field and the value given."""
    err = exc.errors(include_url=False)[0]
    param = param_path(tuple(err["loc"])) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] != "missing" and not isinstance(err.get("input"), (dict, list)) and "got " not in msg:
        msg += f" (got {err['input']!r})"
    return bad_request(f"{param}: {msg}" if param and not msg.startswith(param.split("[")[0]) else msg, param)


def check_text(data: Any, raw: bytes, path: str = "") -> None:
    """Raise a 400 naming the first string of ``data`` (a parsed body) that is not Unicode text (a lone
    surrogate). Only JSON escapes can produce one, so a body without ``\\ud``/``\\uD`` is not walked."""
    if b"\\ud" not in raw and b"\\uD" not in raw:
        return
    _walk(data, path)


def _walk(data: Any, path: str) -> None:
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise bad_request(f"{path or 'the request'} is not valid Unicode text: it holds a lone surrogate "
                              f"{data[exc.start]!r} at character {exc.start}", path or None) from None
    elif isinstance(data, dict):
        for key, value in data.items():
            _walk(key, path)
            _walk(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            if isinstance(value, (str, dict, list)):
                _walk(value, f"{path}[{i}]")


_M = TypeVar("_M", bound=BaseModel)


def load_json(raw: bytes) -> Any:
    """A request body's JSON. Every way it can fail is a 400: malformed JSON, bytes that are not UTF-8, nesting
    deeper than the parser's recursion allows, an integer longer than Python converts (4300 digits)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad_request("The request body nests JSON arrays or objects too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and the int-conversion limit are ValueErrors
        raise bad_request(f"The request body is not valid JSON: {exc}") from None


def parse_request(raw: bytes, model: type[_M], context: dict[str, Any] | None = None) -> _M:
    """A request body as ``model``: malformed JSON, a body that is not a JSON object, invalid values and
    unimplemented fields are 400s naming the field. Fields no API defines are ignored with a warning.
    ``context``: the server's limits that validators read (``max_logprobs``)."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}")
    check_text(data, raw)
    unsupported: dict[str, tuple[Any, ...]] = getattr(model, "UNSUPPORTED", {})
    for name, neutral in unsupported.items():
        if name in data and data[name] not in neutral:
            raise bad_request(f"{name}={data[name]!r} is not supported by this server", name)
    try:
        parsed = model.model_validate(data, context=context)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise bad_request("The request body nests JSON arrays or objects too deeply") from None
    unknown = sorted(set(parsed.model_extra or ()) - set(unsupported))
    if unknown:
        logger.warning("Ignoring request fields this server does not know: %s", ", ".join(unknown))
    return parsed
