"""Which DP rank an engine client sends a request to, and when ``--max-queued-requests`` refuses one, with several
API servers (``--api-server-count``): a rank's reported load beyond a client's own requests is the other
clients', and counts as much as its own; with one client the reports change nothing; and how the requests of one
event-loop turn reach a rank. No rank process runs: the ranks' sockets record what is sent, and their reports are
fed to the client's output path."""
from __future__ import annotations

import asyncio

import pytest

from discard_sink import DiscardSink
from runner.config import RunnerConfig
from runner.core.messages import INPUT_DECODER, AddRequest, AddRequests, CoreInfo, CoreStats, Outputs
from runner.core.requests import EngineCoreOutput
from runner.engine.async_llm import MPEngineClient
from runner.engine.mp_client import EngineSockets, _Rank
from runner.engine.protocol import EngineOverloadedError
from runner.sampling_params import SamplingParams


class RecordingSocket:
    """A rank's input socket: the engine request ids it was sent, and the kinds of the messages in order."""

    def __init__(self) -> None:
        self.request_ids: list[int] = []
        self.messages: list[str] = []

    def send(self, data: bytes) -> asyncio.Future[None]:
        msg = INPUT_DECODER.decode(data)
        self.messages.append(type(msg).__name__)
        if isinstance(msg, AddRequest):
            self.request_ids.append(msg.request.request_id)
        elif isinstance(msg, AddRequests):
            self.request_ids += [r.request_id for r in msg.requests]
        sent = asyncio.get_running_loop().create_future()  # as zmq.asyncio's send: done once sent
        sent.set_result(None)
        return sent


def attached(num_clients: int, max_queued_requests: int | None = None) -> tuple[MPEngineClient, list[RecordingSocket]]:
    """Client 0 of ``num_clients`` over 2 ranks of 2 sequences each, started as far as choosing ranks needs."""
    sockets = EngineSockets("unused", ["in-0", "in-1"], [f"out-{c}" for c in range(num_clients)])
    client = MPEngineClient(RunnerConfig(data_parallel_size=2, max_num_seqs=2), sockets=sockets,
                            max_queued_requests=max_queued_requests)
    recorders = [RecordingSocket(), RecordingSocket()]
    for r, rec in enumerate(recorders):
        client._ranks.append(_Rank(rec, CoreInfo(rank=r, max_model_len=64, vocab_size=100, num_kv_blocks=64,
                                                 block_size=16, eos_token_ids=[], dtype="float32",
                                                 experts_backend="torch")))
    client._accepting = True
    return client, recorders


def report(client: MPEngineClient, rank: int, running: int, waiting: int, finished: tuple[int, ...] = ()) -> None:
    outputs = [EngineCoreOutput(i, [5], finish_reason="length") for i in finished]
    client._on_outputs(Outputs(rank, outputs, CoreStats(num_running=running, num_waiting=waiting)))


async def submit(client: MPEngineClient, count: int, first: int = 0) -> None:
    """``count`` requests taken in one event-loop turn, then that turn's end, where the client sends them."""
    for i in range(first, first + count):
        client.stream(f"r{i}", None, [1, 2, 3], SamplingParams(max_tokens=4), DiscardSink())
    await asyncio.sleep(0)


def test_other_clients_load_steers_the_choice_of_rank() -> None:
    async def main() -> None:
        client, ranks = attached(num_clients=2)
        report(client, 0, running=2, waiting=3)  # five requests of the other API server on rank 0
        report(client, 1, running=0, waiting=0)
        await submit(client, 6)
        # rank 1 takes the first five (loads 5 vs 0..4), then the sixth ties at 5 and goes to rank 0
        assert [len(r.request_ids) for r in ranks] == [1, 5]
        # rank 1 finished two of ours and reports the three left: nobody else's there
        report(client, 1, running=3, waiting=0, finished=tuple(ranks[1].request_ids[:2]))
        assert (client._ranks[1].outstanding, client._ranks[1].others) == (3, 0)
        # rank 0 reports ours plus the other client's five, of which two finished meanwhile
        report(client, 0, running=4, waiting=0)
        assert (client._ranks[0].outstanding, client._ranks[0].others) == (1, 3)
        await submit(client, 1, first=6)
        assert [len(r.request_ids) for r in ranks] == [1, 6]  # loads 4 vs 3

    asyncio.run(main())


def test_max_queued_requests_counts_other_clients_waiting_requests() -> None:
    async def main() -> None:
        client, ranks = attached(num_clients=2, max_queued_requests=2)
        report(client, 0, running=2, waiting=3)  # capacity 2 x 2 = 4: the other client fills it and waits 1
        await submit(client, 1)  # 5 + 1 - 4 = 2 waiting: allowed
        with pytest.raises(EngineOverloadedError, match=r"the waiting queue is full \(2 requests waiting"):
            await submit(client, 1, first=1)
        assert sum(len(r.request_ids) for r in ranks) == 1

    asyncio.run(main())


def test_with_one_client_the_reports_are_its_own_requests() -> None:
    async def main() -> None:
        client, ranks = attached(num_clients=1, max_queued_requests=0)
        await submit(client, 3)
        assert [len(r.request_ids) for r in ranks] == [2, 1]
        report(client, 0, running=2, waiting=7)  # a report out of step with what the client knows: ignored
        assert client._ranks[0].others == 0
        await submit(client, 1, first=3)
        assert [len(r.request_ids) for r in ranks] == [2, 2]
        with pytest.raises(EngineOverloadedError):  # 4 running fill the capacity; max 0 waiting
            await submit(client, 1, first=4)

    asyncio.run(main())


def test_the_requests_of_one_turn_go_to_a_rank_in_one_message_and_what_follows_after_them() -> None:
    """A burst of requests reaches each rank as one ``AddRequests`` at the end of the event-loop turn that took
    them; a message sent to a rank in that turn (an abort, a profile start: ``MPEngineClient._send``) goes after
    the requests queued for it, so an abort never overtakes the request it aborts."""
    async def main() -> None:
        client, ranks = attached(num_clients=1)
        await submit(client, 4)
        assert [r.messages for r in ranks] == [["AddRequests"], ["AddRequests"]]
        assert [len(r.request_ids) for r in ranks] == [2, 2]
        client.stream("one", None, [1, 2, 3], SamplingParams(max_tokens=4), DiscardSink())  # to rank 0 (a tie)
        await client.start_profile()
        assert ranks[0].messages == ["AddRequests", "AddRequest", "StartProfile"]
        assert ranks[1].messages == ["AddRequests", "StartProfile"]
        await asyncio.sleep(0)  # the turn's end finds nothing left to send
        assert [len(r.messages) for r in ranks] == [3, 2] and [len(r.request_ids) for r in ranks] == [3, 2]

    asyncio.run(main())
