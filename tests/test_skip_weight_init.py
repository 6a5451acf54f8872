"""``skip_weight_init`` is shared by rank threads that load at once: it must skip init only inside a block,
only for the thread in it, and leave ``torch.nn.init`` as it found it however the blocks interleave."""
from __future__ import annotations

import threading

import torch
from torch import nn

from runner.models.loader import skip_weight_init


def test_skips_inside_block_and_restores() -> None:
    original = nn.init.normal_
    t = torch.full((4,), 7.0)
    with skip_weight_init():
        nn.init.normal_(t)
        assert torch.equal(t, torch.full((4,), 7.0))
    assert nn.init.normal_ is original
    nn.init.zeros_(t)
    assert torch.equal(t, torch.zeros(4))


def test_overlapping_blocks_in_threads_restore_and_do_not_leak() -> None:
    originals = {n: getattr(nn.init, n) for n in ("normal_", "zeros_", "kaiming_uniform_")}
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, torch.Tensor] = {}

    def first() -> None:  # enters first, leaves while the second is still inside
        with skip_weight_init():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with skip_weight_init():
            second_in.set()
            first_out.wait(10)
            t = torch.ones(3)
            nn.init.zeros_(t)  # still inside its own block after the first thread left
            seen["inside"] = t

    def outsider() -> None:  # never in a block: its init must run while the others skip
        first_in.wait(10)
        t = torch.ones(3)
        nn.init.zeros_(t)
        seen["outside"] = t

    threads = [threading.Thread(target=f) for f in (first, second, outsider)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert torch.equal(seen["inside"], torch.ones(3))
    assert torch.equal(seen["outside"], torch.zeros(3))
    assert {n: getattr(nn.init, n) for n in originals} == originals
