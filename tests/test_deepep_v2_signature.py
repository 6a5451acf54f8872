"""Every call the DeepEP V2 adapter makes fits the real ``ElasticBuffer`` API, read from DeepEP's own source.

The source is the installed ``deep_ep``'s ``buffers/elastic.py`` when there is one (read as text: importing it
needs CUDA), else the copy shipped in ``tests/data/deep_ep_elastic.py.txt`` (its header names the wheel, the
DeepEP commit and the dates). The adapter's source is parsed too, so the check covers the calls as written:
the method exists (static where called on the class), positional arguments fit, every keyword is a
parameter, every required parameter is given, and a call unpacked into a tuple unpacks as many values as
the method's ``Tuple[...]`` return annotation has. The stand-in's signatures must equal the real ones.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

from standins import deep_ep_v2 as standin
from ubatch.modular_moe.prepare_finalize import deepep_v2

SHIPPED = Path(__file__).parent / "data" / "deep_ep_elastic.py.txt"


def elastic_source() -> tuple[str, str]:
    """``(text, where)`` of ``deep_ep/buffers/elastic.py``: the installed package's, else the shipped copy."""
    spec = importlib.util.find_spec("deep_ep")
    if spec is not None and spec.submodule_search_locations:
        installed = Path(list(spec.submodule_search_locations)[0]) / "buffers" / "elastic.py"
        if installed.exists():
            return installed.read_text(), str(installed)
    return SHIPPED.read_text(), str(SHIPPED)


@dataclass
class Method:
    params: list[str]  # without self
    required: set[str]
    num_positional: int
    is_static: bool
    returns: int | None  # arity of a Tuple[...] return annotation


def real_methods() -> dict[str, Method]:
    text, _ = elastic_source()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "ElasticBuffer")
    out = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
        args = fn.args.args if is_static else fn.args.args[1:]
        names = [a.arg for a in args] + [a.arg for a in fn.args.kwonlyargs]
        required = {a.arg for a in args[:len(args) - len(fn.args.defaults)]}
        returns = None
        ann = fn.returns
        if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id in ("Tuple", "tuple"):
            returns = len(ann.slice.elts) if isinstance(ann.slice, ast.Tuple) else 1
        out[fn.name] = Method(names, required, len(args), is_static, returns)
    return out


@dataclass
class Call:
    method: str
    on_class: bool
    num_positional: int
    keywords: list[str]
    unpacked: int | None
    line: int


def adapter_calls() -> list[Call]:
    """Calls on ``self.buffer`` / ``deep_ep.ElasticBuffer`` in the adapter, with how their result is unpacked."""
    source = inspect.getsourcefile(deepep_v2)
    assert source is not None
    tree = ast.parse(Path(source).read_text())
    unpacked: dict[int, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.targets[0], ast.Tuple):
            unpacked[id(node.value)] = len(node.targets[0].elts)
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = ast.unparse(node.func.value)
        if receiver == "self.buffer":
            method, on_class = node.func.attr, False
        elif receiver == "deep_ep" and node.func.attr == "ElasticBuffer":
            method, on_class = "__init__", True
        else:
            continue
        calls.append(Call(method, on_class, len(node.args), [k.arg for k in node.keywords if k.arg],
                          unpacked.get(id(node)), node.lineno))
    return calls


def test_the_source_read_is_deepep_v2() -> None:
    text, where = elastic_source()
    assert "class ElasticBuffer" in text and "class EPHandle" in text, where
    if where == str(SHIPPED):
        assert "sgl-deep-ep 0.1.2" in text and "dd758caf451848bd150e1046af3d0a73e5fff38d" in text


def test_every_adapter_call_fits_the_real_signature() -> None:
    methods, calls = real_methods(), adapter_calls()
    used = {c.method for c in calls}
    assert {"__init__", "dispatch", "combine", "capture", "get_theoretical_num_sms"} <= used, used
    for c in calls:
        where = f"deepep_v2.py line {c.line}: {c.method}"
        assert c.method in methods, f"{where}: ElasticBuffer has no such method"
        m = methods[c.method]
        assert c.num_positional <= m.num_positional, f"{where}: {c.num_positional} positional > {m.num_positional}"
        given = set(m.params[:c.num_positional]) | set(c.keywords)
        assert set(c.keywords) <= set(m.params), f"{where}: unknown keywords {set(c.keywords) - set(m.params)}"
        assert not set(m.params[:c.num_positional]) & set(c.keywords), f"{where}: an argument given twice"
        assert m.required <= given, f"{where}: missing {m.required - given}"
        if c.unpacked is not None:
            assert m.returns == c.unpacked, f"{where}: unpacks {c.unpacked} values, returns {m.returns}"


def test_the_adapter_unpacks_dispatch_and_combine_as_v2_returns_them() -> None:
    methods = real_methods()
    assert (methods["dispatch"].returns, methods["combine"].returns) == (5, 3)
    unpacks = {(c.method, c.unpacked) for c in adapter_calls() if c.method in ("dispatch", "combine")}
    assert unpacks == {("dispatch", 5), ("combine", 3)}


@pytest.mark.parametrize("method", ["__init__", "dispatch", "combine", "get_buffer_size_hint", "capture",
                                    "get_theoretical_num_sms", "get_theoretical_num_qps"])
def test_the_stand_in_has_the_real_signature(method: str) -> None:
    real = real_methods()[method]
    fn = getattr(standin.ElasticBuffer, method)
    fn = getattr(fn, "__wrapped__", fn)
    params = list(inspect.signature(fn).parameters.values())
    if not real.is_static:
        params = params[1:]
    assert [p.name for p in params] == real.params
    assert {p.name for p in params if p.default is inspect.Parameter.empty} == real.required
