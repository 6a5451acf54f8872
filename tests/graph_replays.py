"""Install captured decode graphs (the eager stand-in) in a model runner and record which ones its steps replay.

A runner's steps replay a forward graph per decode step and, when the rows' settings let one of its heads sample
them, that head graph after it (the LM head with the greedy pick, or with the draw); the tests read which graph
served each step, not only that the tokens matched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cudagraph import GraphKey
from cudagraph.backends import EagerReplayBackend
from cudagraph.manager import GraphRunner
from runner.worker.cuda_graphs import make_graph_runner
from runner.worker.model_runner import ModelRunner


@dataclass
class Replays:
    """The keys of the forward graphs replayed, in order, and of the heads replayed after them, by head name."""

    forward: list[GraphKey] = field(default_factory=list)
    heads: dict[str, list[GraphKey]] = field(default_factory=dict)


def record_replays(graph_runner: GraphRunner) -> Replays:
    """Wrap ``graph_runner``'s (captured) backend so every replay is recorded by its graph's key."""
    replays = Replays()
    forward = {id(entry.graph): key for key, entry in graph_runner.graphs.items()}
    heads = {id(head.graph): (name, key) for key, entry in graph_runner.graphs.items()
             for name, head in entry.heads.items()}
    inner = graph_runner.backend

    class Recording(EagerReplayBackend):
        def replay(self, graph: Any) -> None:
            if id(graph) in heads:
                name, key = heads[id(graph)]
                replays.heads.setdefault(name, []).append(key)
            else:
                replays.forward.append(forward[id(graph)])
            inner.replay(graph)

    graph_runner.backend = Recording()
    return replays


def install_graphs(runner: ModelRunner) -> Replays:
    """Capture ``runner``'s graph plan on the eager stand-in, install it as the runner's, record its replays."""
    graph_runner = make_graph_runner(runner, backend=EagerReplayBackend(), num_warmups=0, progress=False)
    graph_runner.capture()
    runner.graph_runner = graph_runner
    if runner.cost_model is not None:
        runner.cost_model.graph_runner = graph_runner
    return record_replays(graph_runner)
