"""Unit tests of worker.daemon.tasks: background coroutines kept referenced, forgotten when done, cancelled together."""

from __future__ import annotations

import asyncio

from rankctl.worker.daemon.tasks import Background


def test_a_spawned_coroutine_runs_and_is_forgotten_once_done() -> None:
    async def main() -> tuple[list[str], int, int]:
        bg, ran = Background(), []

        async def work() -> None:
            ran.append("done")

        bg.spawn(work())
        held = len(bg._tasks)
        for _ in range(3):
            await asyncio.sleep(0)
        return ran, held, len(bg._tasks)

    assert asyncio.run(main()) == (["done"], 1, 0)


def test_cancel_ends_every_running_coroutine_and_waits_for_their_cleanup() -> None:
    async def main() -> tuple[list[str], int]:
        bg, cleaned = Background(), []
        never = asyncio.Event()

        async def blocked(name: str) -> None:
            try:
                await never.wait()
            finally:
                cleaned.append(name)

        bg.spawn(blocked("a"))
        bg.spawn(blocked("b"))
        await asyncio.sleep(0)
        await bg.cancel()
        return sorted(cleaned), len(bg._tasks)

    assert asyncio.run(main()) == (["a", "b"], 0)


def test_cancel_swallows_what_a_cancelled_coroutine_raises() -> None:
    async def main() -> bool:
        bg = Background()
        never = asyncio.Event()

        async def noisy() -> None:
            try:
                await never.wait()
            except asyncio.CancelledError:
                raise ValueError("cleanup failed") from None

        bg.spawn(noisy())
        await asyncio.sleep(0)
        await bg.cancel()
        return True

    assert asyncio.run(main()) is True


def test_cancel_with_nothing_running_returns_at_once() -> None:
    async def main() -> int:
        bg = Background()
        await bg.cancel()
        return len(bg._tasks)

    assert asyncio.run(main()) == 0


def test_spawn_accepts_a_future_as_well_as_a_coroutine() -> None:
    async def main() -> tuple[int, int]:
        bg = Background()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        bg.spawn(fut)
        before = len(bg._tasks)
        fut.set_result(7)
        await asyncio.sleep(0)
        return before, len(bg._tasks)

    assert asyncio.run(main()) == (1, 0)
