"""The run's watch (sharding.liveness) over loopback inside this process: who is reported dead, when, and
what a goodbye or a forwarded signal changes. No jax: each case takes milliseconds."""

import os
import queue
import signal
import socket
import threading
import time

import pytest

from sharding import liveness

BOUND_S = 5.0  # every report below must come within this (they take milliseconds)


class Ends:
    """Records on_end(message, status) calls instead of leaving the process."""

    def __init__(self):
        self.calls = queue.Queue()

    def __call__(self, message, status):
        self.calls.put((message, status))

    def next(self, timeout=BOUND_S):
        return self.calls.get(timeout=timeout)

    def none(self, wait=0.3):
        time.sleep(wait)
        return self.calls.empty()


def _run(num_processes=2):
    """A leader and its followers, all joined; their Ends."""
    leader_ends = Ends()
    leader = liveness.LeaderWatch(num_processes, on_end=leader_ends, on_signal=lambda i, s: leader_ends((i, s), -1))
    followers, ends = [], []
    for i in range(1, num_processes):
        ends.append(Ends())
        followers.append(liveness.FollowerWatch(i, num_processes, "127.0.0.1", leader.published, timeout=5,
                                                on_end=ends[-1]))
    assert leader.wait_joined(BOUND_S) == []
    return leader, leader_ends, followers, ends


def _crash(follower):
    """What the kernel does to a process's socket when it dies: closed, no goodbye."""
    follower._sock.close()  # noqa: SLF001 (a test reaching in to play a crash)


def test_a_follower_that_dies_is_reported_at_once_by_number():
    leader, leader_ends, followers, _ = _run(3)
    start = time.monotonic()
    _crash(followers[1])
    message, status = leader_ends.next()
    assert time.monotonic() - start < 1.0
    assert status == 1 and message.startswith("process 2 of 3 died"), message
    leader.close()


def test_a_follower_that_received_the_stop_is_no_failure():
    leader, leader_ends, followers, ends = _run()
    leader.stopping()
    followers[0].close()
    assert leader_ends.none() and ends[0].none()
    leader.close()


def test_process_0_ending_without_a_stop_ends_the_followers():
    leader, _, followers, ends = _run(3)
    leader.close()  # what its exit does to the connections: closed without a goodbye
    for i, e in enumerate(ends, start=1):
        message, status = e.next()
        assert status == 1 and message.startswith("process 0 of 3 ended without stopping the run"), message
        assert f"process {i} exits" in message


def test_process_0_stopping_before_the_follower_got_its_stop(monkeypatch):
    """Process 0 said goodbye, then ended (e.g. SIGTERM while loading): the follower leaves with status 0
    once STOP_GRACE_S passes without its own stop."""
    monkeypatch.setattr(liveness, "STOP_GRACE_S", 0.2)
    leader, _, followers, ends = _run()
    leader.stopping()
    leader.close()
    message, status = ends[0].next()
    assert status == 0 and "process 0 stopped the run" in message, message


def test_a_stray_connection_is_not_a_follower():
    leader, leader_ends, followers, _ = _run()
    with socket.create_connection(("127.0.0.1", leader.port)) as s:
        s.sendall(b"wrong-token 1\n")
    assert leader_ends.none()
    _crash(followers[0])  # the real follower is still watched
    assert leader_ends.next()[0].startswith("process 1 of 2 died")
    leader.close()


def test_wait_joined_names_the_missing():
    leader = liveness.LeaderWatch(3, on_end=Ends())
    liveness.FollowerWatch(2, 3, "127.0.0.1", leader.published, timeout=5, on_end=Ends())
    start = time.monotonic()
    assert leader.wait_joined(0.3) == [1]
    assert time.monotonic() - start < 2.0
    leader.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_followers_sigterm_goes_to_process_0_and_a_second_one_leaves():
    leader, leader_ends, followers, ends = _run()
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        followers[0].forward_signals()
        os.kill(os.getpid(), signal.SIGTERM)
        assert leader_ends.next() == ((1, signal.SIGTERM), -1)
        assert ends[0].none()
        os.kill(os.getpid(), signal.SIGTERM)
        message, status = ends[0].next()
        assert status == 128 + signal.SIGTERM and "a second SIGTERM" in message, message
    finally:
        signal.set_wakeup_fd(-1)
        for s, handler in old.items():
            signal.signal(s, handler)
        leader.close()
