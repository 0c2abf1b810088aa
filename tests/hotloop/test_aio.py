"""`hotloop.aio`: a cancellation that Python 3.11's `wait_for` swallows still stops a loop that
checks for it; work that must not be cut finishes through every cancel of its caller."""

from __future__ import annotations

import asyncio

import pytest

from hotloop.aio import cancel_requested, finish, raise_if_cancelled


def test_a_cancel_swallowed_by_wait_for_is_still_seen_and_raised() -> None:
    async def main() -> tuple[str, bool, bool]:
        fut = asyncio.get_running_loop().create_future()

        async def worker() -> tuple[str, bool, bool]:
            before = cancel_requested()
            got = await asyncio.wait_for(fut, 5)  # returns the result, swallowing the cancel
            seen = cancel_requested()
            try:
                raise_if_cancelled()
            except asyncio.CancelledError:
                return got, before, seen
            return got, before, False

        task = asyncio.create_task(worker())
        await asyncio.sleep(0.01)
        fut.set_result("reply")  # the reply and the cancellation land on the same iteration
        task.cancel()
        return await task

    got, before, seen = asyncio.run(main())
    assert got == "reply" and not before and seen


def test_a_loop_that_checks_ends_after_a_swallowed_cancel_and_an_unasked_one_does_not() -> None:
    async def main() -> int:
        steps = 0

        async def step() -> None:
            nonlocal steps
            steps += 1
            if steps == 2:  # a library swallows the cancel that lands in this step
                asyncio.current_task().cancel()
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    pass

        async def loop() -> None:
            while True:
                raise_if_cancelled()
                await step()
                await asyncio.sleep(0)

        task = asyncio.create_task(loop())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
        return steps

    assert asyncio.run(main()) == 2  # the step in flight finished; no third started


def test_timeouts_that_asyncio_undoes_are_not_taken_for_a_stop() -> None:
    async def main() -> bool:
        try:
            async with asyncio.timeout(0.01):  # cancels, then uncancels on its way out
                await asyncio.sleep(1)
        except TimeoutError:
            pass
        raise_if_cancelled()
        return cancel_requested()

    assert asyncio.run(main()) is False


def _cancelled_twice(work) -> tuple[asyncio.Task, BaseException | object]:
    """Run `work()` (a coroutine that waits for the returned event) under `finish`, cancel
    the caller twice while it runs, then let it end: (the work's task, what the caller got)."""
    async def main():
        release = asyncio.Event()
        task = asyncio.ensure_future(work(release))

        async def caller():
            try:
                return await finish(task)
            finally:
                assert task.done()  # the caller ends only after the work

        outer = asyncio.create_task(caller())
        for _ in range(2):  # a stop at the signal, then again at the cleanup
            await asyncio.sleep(0.01)
            outer.cancel()
        await asyncio.sleep(0.01)
        assert not task.done() and not outer.done()  # both still waiting after both cancels
        release.set()
        try:
            got = await asyncio.wait_for(outer, 5)
        except asyncio.CancelledError as e:
            got = e
        return task, got

    return asyncio.run(main())


def test_finish_lets_the_work_end_through_every_cancel_then_raises_the_cancel() -> None:
    async def work(release):
        await release.wait()
        await asyncio.sleep(0)
        return "saved"

    task, got = _cancelled_twice(work)
    assert task.result() == "saved" and isinstance(got, asyncio.CancelledError)


def test_finish_chains_the_works_error_to_the_cancel() -> None:
    async def work(release):
        await release.wait()
        raise OSError("disk full")

    task, got = _cancelled_twice(work)
    assert isinstance(got, asyncio.CancelledError) and isinstance(got.__cause__, OSError)
    assert isinstance(task.exception(), OSError)


def test_finish_without_a_cancel_is_the_task_itself() -> None:
    async def main():
        async def work():
            await asyncio.sleep(0)
            return 7

        async def failing():
            raise ValueError("bad")

        with pytest.raises(ValueError):
            await finish(asyncio.ensure_future(failing()))
        task = asyncio.ensure_future(asyncio.sleep(10))
        asyncio.get_running_loop().call_later(0.01, task.cancel)  # cancelled by someone else
        with pytest.raises(asyncio.CancelledError):
            await finish(task)
        return await finish(asyncio.ensure_future(work()))

    assert asyncio.run(main()) == 7
