"""The names the model is served under (``--served-model-name``; vLLM's ``OpenAIServingModels``): ``GET /v1/models``
lists them, and a request naming any other model is a 404 naming it. A request that names no model gets the
first name, as in vLLM. Error bodies name the model by its served name, never by the path the server loaded it
from (``described``): without ``--served-model-name`` the only name is that path, and errors say "this model"."""
from __future__ import annotations

from http import HTTPStatus

from runner.entrypoints.openai.errors import OpenAIError
from runner.entrypoints.openai.protocol import ModelCard, ModelList


class ServingModels:
    def __init__(self, served_model_names: list[str], max_model_len: int, root: str | None = None) -> None:
        if not served_model_names or not all(isinstance(n, str) and n for n in served_model_names):
            raise ValueError(f"served_model_names must be a non-empty list of non-empty names, "
                             f"got {served_model_names!r}")
        self.names = list(served_model_names)
        self.max_model_len = max_model_len
        self.root = root if root is not None else served_model_names[0]
        self.path = root  # where the model was loaded from, which no error body names

    def resolve(self, requested: str | None) -> str:
        """The name to answer under; 404 for a model this server does not serve."""
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            public = [n for n in self.names if n != self.path]
            serves = (f"This server serves: {', '.join(public)}" if public
                      else "The served models are listed at `/v1/models`")
            raise OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{requested}` does not exist. {serves}", "model")
        return requested

    def described(self, name: str) -> str:
        """How an error body names served model ``name``: "The model `name`", or "This model" for the path the
        model was loaded from."""
        return "This model" if name == self.path else f"The model `{name}`"

    def list(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=self.root, max_model_len=self.max_model_len)
                               for name in self.names])
