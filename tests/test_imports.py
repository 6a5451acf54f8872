"""The packages' imports form no cycles, and depend one way: ``ubatch`` <- ``cudagraph`` <- ``runner``, and inside
``runner`` along the path of a request: front ends (``entrypoints``) -> engine client (``engine``) -> engine
core (``core``) -> model runner (``worker``) -> models and attention -> process plumbing (``distributed``).

Read from the source with ``ast``, so every import counts: module-level, inside functions (a lazy import
that closes a loop is still a loop in the design), and under ``TYPE_CHECKING``. ``from pkg import sub``
where ``sub`` is a module is an edge to ``pkg.sub`` only: importing a submodule always runs its parent
package's ``__init__``, which is not a design dependency.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ubatch", "cudagraph", "runner")  # each may import only the ones before it
LAYER = {name: i for i, name in enumerate(PACKAGES)}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = []
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.append(sub if sub in mods else node.module)
            else:
                continue
            for target in targets:
                resolved = _resolve(target, mods)
                if resolved is not None and resolved != mod:
                    graph[mod].add(resolved)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_checker_sees_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the walk really found the packages
    assert find_cycles(graph) == []


def test_packages_depend_one_way() -> None:
    upward = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
                    if LAYER[t.split(".")[0]] > LAYER[m.split(".")[0]])
    assert upward == []


# Inside runner: each layer may import only the layers after it. Modules directly under ``runner`` (config,
# sampling_params, tracing, ...) are shared leaves that every layer may use; they import no layer above them
# except ``distributed`` (device choice) and ``models``/``attention`` helpers, checked by the cycle test.
RUNNER_LAYERS = ("entrypoints", "engine", "core", "worker", "models", "attention", "distributed")
# The step contract -- what the scheduler hands a model runner and what it hands back -- is the engine core's
# (vLLM's worker imports ``vllm.v1.core.sched.output`` the same way): the model runner implements it, so
# ``worker`` may import these modules of ``core`` and no other, and they import no layer above ``models``
# (test_the_step_contract_imports_no_layer_above_models), so no path through them leads back into core.
STEP_CONTRACT = frozenset({"runner.core.scheduler_output", "runner.core.runner_output", "runner.core.logprob_rows"})


def _runner_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "runner" or len(parts) < 2 or parts[1] not in RUNNER_LAYERS:
        return None
    return RUNNER_LAYERS.index(parts[1])


def _imports_upward(module: str, target: str) -> bool:
    """Both are in runner layers, and ``target``'s is above ``module``'s."""
    importer, imported = _runner_layer(module), _runner_layer(target)
    return importer is not None and imported is not None and imported < importer


def test_runner_layers_depend_one_way() -> None:
    graph = import_graph()
    assert {m.split(".")[1] for m in graph if _runner_layer(m) is not None} >= {"entrypoints", "core", "worker"}
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if _imports_upward(m, t) and not (m.startswith("runner.worker.") and t in STEP_CONTRACT))
    assert upward == []


def test_the_step_contract_imports_no_layer_above_models() -> None:
    graph = import_graph()
    assert graph.keys() >= STEP_CONTRACT
    models = RUNNER_LAYERS.index("models")
    above = sorted(f"{m} -> {t}" for m in STEP_CONTRACT for t in graph[m]  # the contract's modules aside
                   if t not in STEP_CONTRACT and (layer := _runner_layer(t)) is not None and layer < models)
    assert above == []


# Test tooling: ``ubatch.testing`` (the stream-order sanitizer, thread ranks) and the modules of ``tests/`` (its
# stand-ins for hardware-only libraries as the package ``standins``: their module names are the real libraries').
TESTING = "ubatch.testing"
TEST_MODULES = frozenset({"tests", "standins"} | {p.stem for p in (ROOT / "tests").glob("*.py")})


def _imported_names(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from a import b``: ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_product_module_imports_test_tooling() -> None:
    mods = _modules()
    assert {TESTING, f"{TESTING}.stream_sanitizer", f"{TESTING}.thread_ranks"} <= mods.keys()
    assert {"conftest", "fake_runner", "stream_sanitizer_plugin"} <= TEST_MODULES
    product = {m: path for m, path in mods.items() if not (m == TESTING or m.startswith(TESTING + "."))}
    found = sorted(f"{m} -> {name}" for m, path in product.items() for name in _imported_names(path)
                   if name == TESTING or name.startswith(TESTING + ".") or name.split(".")[0] in TEST_MODULES)
    assert found == []


# Run in a fresh interpreter: the hooks the test tooling installs, read before and after importing the product.
_HOOKS_PROBE = """
import json, sys, threading
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

def hooks():
    streams = sys.modules.get("ubatch.streams")
    return {"dispatch modes": len(_get_current_dispatch_mode_stack()),
            "function modes": len(_get_current_function_mode_stack()),
            "thread profile": repr(threading.getprofile()), "sys profile": repr(sys.getprofile()),
            "sys trace": repr(sys.gettrace()),
            "stream observer": repr(None if streams is None else streams._observer),
            "testing imported": sorted(m for m in sys.modules if m.startswith("ubatch.testing"))}

before = hooks()
import ubatch, cudagraph, runner  # noqa: E401
import runner.entrypoints.llm  # the offline API's module, as a user's script imports it
print(json.dumps({"before": before, "after": hooks()}))
"""


def test_importing_the_product_installs_no_hook_whatever_the_environment() -> None:
    """``import ubatch`` / ``runner`` with every debug switch set turns on no sanitizer, dispatch mode or
    profiler: the test tooling is switched on by the tests (``--stream-sanitizer``), not by the environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), UBATCH_STREAM_SANITIZER="1", UBATCH_DEBUG="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _HOOKS_PROBE], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["after"] == seen["before"]
    assert seen["after"]["stream observer"] == "None" and seen["after"]["dispatch modes"] == 0
