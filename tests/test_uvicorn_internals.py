"""The server's contract with uvicorn's private internals: every method and attribute the header-timeout protocol
relies on exists on the installed uvicorn; a missing one stops the server before it starts, with uvicorn's version
and the name in the error; the server runs that protocol; and no module but ``uvicorn_internals`` imports uvicorn's
private modules."""
from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from runner.entrypoints.openai import api_server, uvicorn_internals
from runner.entrypoints.openai.uvicorn_internals import (
    CONTRACT,
    HeaderTimeoutProtocol,
    UvicornMismatch,
    check_uvicorn,
    header_timeout_protocol,
)

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "runner" / "entrypoints" / "openai" / "uvicorn_internals.py"
PUBLIC = {"uvicorn"}  # the package itself: Config, Server, run (uvicorn.__all__)


@pytest.mark.parametrize(("cls", "name", "setter"), CONTRACT, ids=[f"{c.__name__}.{n}" for c, n, _ in CONTRACT])
def test_each_method_and_attribute_relied_on_exists_on_the_installed_uvicorn(cls: type, name: str,
                                                                             setter: str | None) -> None:
    if setter is None:
        method = cls.__dict__[name]
        assert inspect.isfunction(method)
        assert list(inspect.signature(method).parameters)[0] == "self"
        assert getattr(HeaderTimeoutProtocol, name) is not method  # the protocol overrides it
        assert len(inspect.signature(getattr(HeaderTimeoutProtocol, name)).parameters) \
            == len(inspect.signature(method).parameters)
    else:
        assert name in cls.__dict__[setter].__code__.co_names


def test_the_checked_attributes_are_the_ones_a_live_cycle_and_protocol_have() -> None:
    """Instances made as uvicorn makes them carry the attributes with the values the protocol expects."""
    config = uvicorn.Config(lambda scope, receive, send: None, http="httptools", lifespan="off")
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = HttpToolsProtocol(config, ServerState(), {}, loop)
    finally:
        loop.close()
    assert protocol.cycle is None and protocol.loop is loop
    cycle = RequestResponseCycle(scope={"type": "http"}, transport=None, flow=None,
                                 logger=protocol.logger, access_logger=protocol.access_logger, access_log=False,
                                 default_headers=[], message_event=None,
                                 expect_100_continue=False, keep_alive=True, on_response=lambda: None)
    assert (cycle.more_body, cycle.disconnected, cycle.response_complete) == (True, False, False)


def test_a_missing_method_stops_the_server_before_it_starts_naming_uvicorns_version_and_the_method(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(HttpToolsProtocol, "on_response_complete")
    with pytest.raises(UvicornMismatch) as raised:
        header_timeout_protocol(10.0)
    assert str(raised.value).startswith(f"uvicorn {uvicorn.__version__} lacks HttpToolsProtocol.on_response_complete, ")


def test_a_missing_attribute_is_named_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uvicorn_internals, "CONTRACT", (*CONTRACT, (RequestResponseCycle, "gone", "__init__")))
    with pytest.raises(UvicornMismatch, match=r"lacks RequestResponseCycle\.gone, which the server's header timeout"):
        check_uvicorn()


def test_the_server_runs_the_adapters_protocol_with_its_limits() -> None:
    protocol = header_timeout_protocol(3.0, 2.0)
    assert issubclass(protocol, HeaderTimeoutProtocol) and issubclass(protocol, HttpToolsProtocol)
    assert (protocol.HEADER_TIMEOUT_S, protocol.BODY_TIMEOUT_S) == (3.0, 2.0)
    assert "header_timeout_protocol(limits.header_timeout_s, limits.body_timeout_s)" \
        in inspect.getsource(api_server.serve_app)


def _uvicorn_modules_imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "uvicorn")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "uvicorn":
            names.add(node.module)
            if node.module == "uvicorn":
                names.update(f"uvicorn.{a.name}" for a in node.names if a.name not in uvicorn.__all__)
    return names


def test_only_the_adapter_imports_uvicorns_private_modules() -> None:
    offenders = {str(path.relative_to(ROOT)): sorted(names - PUBLIC)
                 for path in sorted((ROOT / "runner").rglob("*.py")) if path != ADAPTER
                 if (names := _uvicorn_modules_imported(path)) - PUBLIC}
    assert offenders == {}
    assert "uvicorn.protocols.http.httptools_impl" in _uvicorn_modules_imported(ADAPTER)
