"""The client's bookkeeping against a fake API (no network): re-entrancy counted
locally, one acquire in flight per key, unknown outcomes resolved and released,
release retried until answered, loss forgetting holds."""

import os
import tempfile
import threading
import time
import unittest
from typing import Any, Dict, List, Optional, Tuple

import lockmesh
from lockmesh import _api
from lockmesh.client import Client, Config


class FakeApi:
    def __init__(self) -> None:
        self.calls: List[str] = []
        self.lock = threading.Lock()
        self.next_token = 100
        self.granted: Dict[str, int] = {}
        self.acquire_unknown = False
        self.release_failures = 0
        self.instance = "p1-test"

    def _log(self, what: str) -> None:
        with self.lock:
            self.calls.append(what)

    def close(self) -> None:
        pass

    def open_session(self, key: str, timeout: float) -> Tuple[str, int, str]:
        self._log("open")
        return "abc", 15, "default"

    def keepalive(self, session: str, timeout: float) -> None:
        self._log("keepalive")

    def acquire(self, key: str, session: str, wait: float, ask: Dict[str, str], campaign: bool,
                value: Optional[str], timeout: float) -> Tuple[_api.Grant, Optional[int]]:
        self._log("acquire")
        self.next_token += 1
        self.granted[key] = self.next_token
        if self.acquire_unknown:
            raise _api.Unknown("answer lost")
        return _api.Grant(key, self.next_token, session, 15, "default"), None

    def holds(self, session: str, timeout: float) -> List[Tuple[str, int]]:
        self._log("holds")
        return list(self.granted.items())

    def release(self, g: _api.Grant, resign: bool, timeout: float) -> None:
        self._log("release")
        if self.release_failures > 0:
            self.release_failures -= 1
            raise _api.Unknown("reset")
        self.granted.pop(g.key, None)

    def close_session(self, session: str, timeout: float) -> None:
        self._log("close")


def client(api: FakeApi, fences: List[Any], **cfg: Any) -> Client:
    d = tempfile.mkdtemp()
    for f in ("ca", "cert", "key"):
        open(os.path.join(d, f), "w").close()

    class Offline(Client):
        def _make_api(self) -> Any:
            return api

    return Offline(Config("https://tier:1", os.path.join(d, "ca"), os.path.join(d, "cert"), os.path.join(d, "key"),
                          **cfg), fences.append)


class ClientTest(unittest.TestCase):
    def test_nested_acquires_reach_the_service_once_and_the_last_release_releases(self) -> None:
        api, fences = FakeApi(), []
        c = client(api, fences)
        h1 = c.lock("k")
        h2 = c.lock("k")
        with c.lock("k") as h3:
            self.assertEqual({h1.token, h2.token, h3.token}, {h1.token})
            self.assertEqual(c.held(), [("k", 3)])
        h1.release()
        self.assertEqual(api.calls.count("acquire"), 1)
        self.assertEqual(api.calls.count("release"), 0)
        h1.release()  # a guard releases once
        self.assertEqual(c.held(), [("k", 1)])
        h2.release()
        self.assertEqual(api.calls.count("release"), 1)
        self.assertTrue(c.is_idle())
        c.shutdown()

    def test_a_release_is_retried_until_answered(self) -> None:
        api, fences = FakeApi(), []
        c = client(api, fences)
        h = c.lock("k")
        api.release_failures = 2
        h.release()
        self.assertEqual(api.calls.count("release"), 3)
        self.assertNotIn("k", api.granted)
        c.shutdown()

    def test_an_unknown_outcome_is_resolved_from_the_holds_and_released(self) -> None:
        api, fences = FakeApi(), []
        c = client(api, fences, acquire_slack=0.2)
        api.acquire_unknown = True
        with self.assertRaises(lockmesh.OutcomeUnknown):
            c.lock("k")
        # One acquire in flight: a second caller waits for the resolution, not a new grant.
        with self.assertRaises(lockmesh.Contended) as e:
            c.lock("k", wait=0.05)
        self.assertEqual(e.exception.reason, "acquiring_here")
        end = time.monotonic() + 5
        while "k" in api.granted and time.monotonic() < end:
            time.sleep(0.02)
        self.assertNotIn("k", api.granted, "the lost grant was not released")
        self.assertIn("holds", api.calls)
        api.acquire_unknown = False
        h = c.lock("k", wait=1.0)
        self.assertEqual(c.held(), [("k", 1)])
        h.release()
        c.shutdown()

    def test_permits_and_mode_together_are_refused(self) -> None:
        c = client(FakeApi(), [])
        with self.assertRaises(lockmesh.ConfigError):
            c.lock("k", permits=2, mode="shared")
        with self.assertRaises(lockmesh.ConfigError):
            c.lock_all(["a"])
        c.shutdown()

    def test_a_loss_fences_once_with_every_key_and_forgets_the_holds(self) -> None:
        api, fences = FakeApi(), []
        c = client(api, fences)
        h = c.lock("a")
        c.lock("b")
        s = h._held.session
        s.lose(lockmesh.SESSION_EXPIRED)
        s.lose(lockmesh.DEADLINE)
        self.assertEqual(len(fences), 1)
        self.assertEqual((fences[0].reason, fences[0].keys), (lockmesh.SESSION_EXPIRED, ["a", "b"]))
        self.assertEqual(c.held(), [])
        self.assertFalse(h.can_start())
        with self.assertRaises(lockmesh.SessionLost):
            h.release()
        c.shutdown()

    def test_unusable_pem_files_are_a_config_error(self) -> None:
        d = tempfile.mkdtemp()
        for f in ("ca", "cert", "key"):
            open(os.path.join(d, f), "w").close()
        with self.assertRaises(lockmesh.ConfigError):
            Client(Config("https://tier:1", os.path.join(d, "ca"), os.path.join(d, "cert"), os.path.join(d, "key")),
                   print)
        with self.assertRaises(lockmesh.ConfigError):
            Client(Config("http://tier:1", "ca", "cert", "key"), print)

    def test_a_hold_prints_no_key_nor_token(self) -> None:
        c = client(FakeApi(), [])
        h = c.lock("secret/key")
        self.assertNotIn("secret", repr(h))
        self.assertNotIn(str(h.token), repr(h))
        h.release()
        c.shutdown()


class AsyncTest(unittest.TestCase):
    def test_async_with_takes_and_releases(self) -> None:
        import asyncio

        api = FakeApi()

        async def go() -> None:
            ac = lockmesh.AsyncClient.__new__(lockmesh.AsyncClient)
            ac.sync = client(api, [])
            async with ac.lock("k") as h:
                self.assertTrue(h.can_start())
                self.assertEqual(ac.held(), [("k", 1)])
            self.assertEqual(ac.held(), [])
            await ac.shutdown()

        asyncio.run(go())
        self.assertEqual(api.calls.count("release"), 1)


if __name__ == "__main__":
    unittest.main()
