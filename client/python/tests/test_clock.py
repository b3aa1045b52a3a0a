"""The two-stage loss clock (lockmesh.clock), with times passed in."""

import unittest

from lockmesh.clock import DEADLINE, JEOPARDY, LOST, SAFE, SESSION_EXPIRED, KeepaliveClock


class ClockTest(unittest.TestCase):
    def test_the_deadline_counts_from_the_send_of_the_last_acknowledged_keepalive(self) -> None:
        c = KeepaliveClock(opened_sent_at=100.0, ttl=15.0, margin=1.0)
        self.assertEqual(c.deadline(), 114.0)
        # Sent at 105, answered at 107: the deadline is 105 + 14, not 107 + 14.
        c.on_ack(105.0)
        self.assertEqual(c.deadline(), 119.0)
        # An older send acknowledged late never moves the deadline back.
        c.on_ack(103.0)
        self.assertEqual(c.deadline(), 119.0)

    def test_can_start_turns_false_at_the_first_failure_and_only_a_later_send_recovers(self) -> None:
        c = KeepaliveClock(0.0, 3.0, 1.0)
        self.assertTrue(c.can_start(0.5))
        self.assertTrue(c.on_fail(1.0))
        self.assertFalse(c.on_fail(1.3), "jeopardy is entered once")
        self.assertEqual(c.state(1.4), JEOPARDY)
        self.assertFalse(c.can_start(1.4))
        # An ack of a keepalive sent before the latest failure ends nothing.
        self.assertFalse(c.on_ack(0.9))
        self.assertEqual(c.state(1.5), JEOPARDY)
        self.assertTrue(c.on_ack(1.3))
        self.assertEqual(c.state(1.6), SAFE)
        self.assertEqual(c.next_interval(), 1.0)

    def test_the_retry_interval_in_jeopardy_is_a_tenth_of_the_ttl_within_bounds(self) -> None:
        for ttl, want in ((3.0, 0.3), (60.0, 1.0), (0.5, 0.1)):
            c = KeepaliveClock(0.0, ttl, 0.0)
            c.on_fail(0.0)
            self.assertAlmostEqual(c.next_interval(), want)

    def test_the_loss_is_told_once_and_is_final(self) -> None:
        c = KeepaliveClock(0.0, 3.0, 1.0)
        c.on_fail(1.0)
        self.assertFalse(c.check(1.99))
        self.assertTrue(c.check(2.0))
        self.assertFalse(c.check(2.5))
        self.assertFalse(c.on_lost(SESSION_EXPIRED))
        self.assertEqual(c.lost, DEADLINE)
        self.assertFalse(c.on_ack(1.9), "no recovery from a loss")
        self.assertEqual(c.state(1.0), LOST)
        self.assertEqual(c.remaining(1.0), 0.0)


if __name__ == "__main__":
    unittest.main()
