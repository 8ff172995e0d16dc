"""A running daemon unmounts what dead workers left on its host again and again, not only at its start."""

from __future__ import annotations

import asyncio

import pytest

from rankctl.worker.daemon import serve


def test_the_daemon_reaps_dead_owners_mounts_on_every_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    turns: list[list[str]] = []

    def reap(unmount, keep):   # noqa: ANN001 - the mountreg.reap signature
        turns.append(list(keep))
        return ["/dev/shm/left-by-a-dead-launcher"] if len(turns) == 2 else []

    monkeypatch.setattr(serve.mountreg, "reap", reap)

    async def three_turns() -> None:
        task = asyncio.create_task(serve._reap_dead_owners("n0", ["/mine"], every=0.0))
        while len(turns) < 3:
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(three_turns())
    assert turns[:3] == [["/mine"]] * 3   # its own snapshot memory is always kept
