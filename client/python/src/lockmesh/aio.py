"""The asyncio API: the blocking client's calls run on the default executor, so
the renewals, the fence and the resolution of unknown outcomes are the same code.

A caller that stops waiting (its task cancelled, a timeout) does not leak a
hold: the acquire still completes, and a grant is released at once.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable, Generator, List, Optional, Sequence, TypeVar

from .client import Client, Config, Hold, OnFence, OnJeopardy
from .election import Leadership, Observation, Observer

T = TypeVar("T")


async def _run(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(fn, *args, **kw))


def _release_quietly(fut: "asyncio.Future[Any]") -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    res = fut.result()
    for h in res if isinstance(res, list) else [res]:
        try:
            h.release()
        except Exception:  # noqa: BLE001 - nobody is left to tell
            pass


async def _acquire(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, functools.partial(fn, *args, **kw))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        # The caller stopped waiting: the grant, if one comes, is released.
        fut.add_done_callback(lambda f: loop.run_in_executor(None, _release_quietly, f))
        raise


class AsyncHold:
    """An awaitable hold: `release()` is a coroutine; `async with` releases at the end."""

    def __init__(self, hold: Hold) -> None:
        self.sync = hold

    @property
    def key(self) -> str:
        return self.sync.key

    @property
    def token(self) -> int:
        return self.sync.token

    @property
    def proof(self) -> Optional[str]:
        return self.sync.proof

    @property
    def session(self) -> str:
        return self.sync.session

    def state(self) -> str:
        return self.sync.state()

    def can_start(self) -> bool:
        return self.sync.can_start()

    def remaining_ttl(self) -> float:
        return self.sync.remaining_ttl()

    def lost(self) -> Optional[str]:
        return self.sync.lost()

    async def release(self) -> None:
        await _run(self.sync.release)

    async def __aenter__(self) -> "AsyncHold":
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            await self.release()
        except Exception:
            if exc_type is None:
                raise


class _LockCall:
    """`await client.lock(k)` or `async with client.lock(k) as hold:`."""

    def __init__(self, coro_fn: Callable[[], "asyncio.Future[AsyncHold]"]) -> None:
        self._coro_fn = coro_fn
        self._hold: Optional[AsyncHold] = None

    def __await__(self) -> Generator[Any, None, AsyncHold]:
        return self._coro_fn().__await__()  # type: ignore[attr-defined, no-any-return]

    async def __aenter__(self) -> AsyncHold:
        self._hold = await self._coro_fn()
        return self._hold

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._hold is not None:
            await self._hold.__aexit__(exc_type, exc, tb)


class AsyncClient:
    """The asyncio face of `Client` (same arguments, same behaviour)."""

    def __init__(self, config: Config, on_fence: OnFence, on_jeopardy: Optional[OnJeopardy] = None) -> None:
        self.sync = Client(config, on_fence, on_jeopardy)

    def lock(self, key: str, wait: float = 0.0, **kw: Any) -> _LockCall:
        async def go() -> AsyncHold:
            return AsyncHold(await _acquire(self.sync.lock, key, wait, **kw))

        return _LockCall(go)  # type: ignore[arg-type]

    async def lock_all(self, keys: Sequence[str], wait: float = 0.0, **kw: Any) -> List[AsyncHold]:
        return [AsyncHold(h) for h in await _acquire(self.sync.lock_all, keys, wait, **kw)]

    async def campaign(self, key: str, **kw: Any) -> Leadership:
        return await _acquire(self.sync.campaign, key, **kw)

    async def observe_now(self, key: str) -> Observation:
        return await _run(Observer(self.sync, key, None, 30.0).next)

    def held(self) -> List[Any]:
        return self.sync.held()

    async def shutdown(self) -> None:
        await _run(self.sync.shutdown)
