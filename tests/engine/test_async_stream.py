"""AsyncLLM's per-request stream: outputs queued while the consumer was busy come out as one
(DELTA outputs joined, cumulative ones the newest), an error queued behind them is raised after
them, and a stream closed early aborts its request. No engine: the stream reads its queue only."""
from __future__ import annotations

import asyncio

import pytest

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput, join_outputs


def _out(index: int, text: str, ids: list[int], finish: str | None = None, lps: bool = False) -> CompletionOutput:
    logprobs = [{i: Logprob(-0.5)} for i in ids] if lps else None
    return CompletionOutput(index, text, ids, -1.0 * len(ids), logprobs, finish, None)


def _ro(*outputs: CompletionOutput, finished: bool = False, cached: int = 0) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], None, list(outputs), finished, num_cached_tokens=cached)


class _Frontend:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _collect(items: list, delta: bool, later: list | None = None) -> tuple[list, BaseException | None, list]:
    """Every output the stream yields for a queue holding ``items`` (then ``later``, put after the
    first read), and the error it raised, if any."""
    frontend = _Frontend()
    pending = list(later or [])

    async def run():
        q: asyncio.Queue = asyncio.Queue()
        for item in items:
            q.put_nowait(item)
        got, error = [], None
        try:
            async for out in AsyncLLM._stream(frontend, "r", q, delta):
                got.append(out)
                while pending:
                    q.put_nowait(pending.pop(0))
        except ValueError as e:
            error = e
        return got, error

    got, error = asyncio.run(run())
    return got, error, frontend.aborted


def test_join_appends_each_completion_and_takes_the_later_state():
    first = _ro(_out(0, "Hel", [5, 6], lps=True), cached=16)
    then = _ro(_out(1, "A", [9]), _out(0, "lo", [7], "stop", lps=True), finished=True, cached=32)
    joined = join_outputs(first, then)
    by_index = {o.index: o for o in joined.outputs}
    assert by_index[0].text == "Hello" and by_index[0].token_ids == [5, 6, 7]
    assert [list(lp) for lp in by_index[0].logprobs] == [[5], [6], [7]]
    assert by_index[0].finish_reason == "stop" and by_index[0].cumulative_logprob == -1.0
    assert by_index[1].text == "A" and by_index[1].token_ids == [9]  # a completion seen first here
    assert joined.finished and joined.num_cached_tokens == 32 and joined.prompt_token_ids == [1, 2]


def test_deltas_queued_behind_a_busy_consumer_come_out_as_one():
    items = [_ro(_out(0, "a", [1])), _ro(_out(0, "b", [2])), _ro(_out(0, "c", [3]))]
    got, error, aborted = _collect(items, delta=True, later=[_ro(_out(0, "d", [4], "length"), finished=True)])
    assert error is None and aborted == []
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in got] == [("abc", [1, 2, 3]), ("d", [4])]
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "length"


def test_cumulative_outputs_queued_give_the_newest_and_the_final_is_never_skipped():
    items = [_ro(_out(0, "a", [1])), _ro(_out(0, "ab", [1, 2])), _ro(_out(0, "abc", [1, 2, 3]), finished=True),
             _ro(_out(0, "late", [0]))]  # nothing after a finished output is read
    got, error, _ = _collect(items, delta=False)
    assert error is None and [o.outputs[0].text for o in got] == ["abc"] and got[0].finished


def test_an_error_queued_behind_outputs_is_raised_after_them():
    items = [_ro(_out(0, "a", [1])), _ro(_out(0, "b", [2])), ValueError("grammar failed"), _ro(_out(0, "c", [3]))]
    got, error, aborted = _collect(items, delta=True)
    assert [o.outputs[0].text for o in got] == ["ab"]
    assert isinstance(error, ValueError) and str(error) == "grammar failed"
    assert aborted == []  # an error ends the request in the engine already


@pytest.mark.parametrize("delta", [True, False])
def test_a_stream_closed_early_aborts_its_request(delta):
    frontend = _Frontend()

    async def run():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(_ro(_out(0, "a", [1])))
        stream = AsyncLLM._stream(frontend, "r", q, delta)
        assert (await stream.__anext__()).outputs[0].text == "a"
        await stream.aclose()

    asyncio.run(run())
    assert frontend.aborted == ["r"]
