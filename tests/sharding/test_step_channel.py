"""The step channel's two ends in one process over loopback (no jax.distributed): order, layouts sent once, a
late follower missing nothing, the stop and its answer, a follower that is gone, a stray connection refused."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from sharding import step_channel

zmq = pytest.importorskip("zmq")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Inputs:  # a step's inputs dataclass, as the executor's StepInputs: its structure must travel
    tokens: np.ndarray
    flags: np.ndarray
    extra: np.ndarray | None = None


def _message(step: int):
    n = 1 + step % 3  # shapes change (layout sent again) and come back
    return {"call": np.array([step, 1, 0], np.int32),
            "inputs": _Inputs(np.arange(n, dtype=np.int32) + step, np.array(step % 2 == 1),
                              None if step % 2 else np.full((n, 2), 0.5 * step, np.float64))}


def _pair(num_processes: int = 2, stopped=None):
    sender = step_channel.Sender(num_processes, flatten=jax.tree.flatten)
    receivers = [step_channel.Receiver(i, num_processes, "127.0.0.1", sender.published, unflatten=jax.tree.unflatten,
                                       on_stop=stopped) for i in range(1, num_processes)]
    assert sender.wait_joined(10.0) == []
    return sender, receivers


def _same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), (x, y)


def test_every_follower_gets_every_message_in_order_then_the_stop():
    stops = []
    sender, receivers = _pair(3, stopped=lambda: stops.append(1))
    for step in range(20):
        sender.send(_message(step))
    got = [[], []]
    threads = [threading.Thread(target=lambda r=r, out=out: out.extend(iter(r.receive, None)))
               for r, out in zip(receivers, got)]
    for t in threads:
        t.start()
    assert sender.stop(timeout=10.0) == []  # both answered: they hold every message
    for t in threads:
        t.join(10)
    for out in got:
        assert len(out) == 20
        for step, message in enumerate(out):
            _same(message, _message(step))
    assert stops == [1, 1]
    assert sender.stats().messages == 20 and sender.stats().send_s > 0
    stats = receivers[0].stats()
    assert stats.messages == 20 and 0 <= stats.late_s <= stats.wait_s
    with pytest.raises(ValueError, match="stopped"):
        sender.send(_message(0))
    assert receivers[0].receive() is None  # stays stopped


def test_the_layout_travels_only_when_it_changes_and_the_arrays_in_one_frame():
    sender, (receiver,) = _pair()
    frames = []
    real = sender._sock.send_multipart  # noqa: SLF001 (the test counts the frames on the wire)

    def counting(parts, *args, **kwargs):
        frames.append(len(parts))
        return real(parts, *args, **kwargs)

    sender._sock.send_multipart = counting  # noqa: SLF001
    same = _message(0)  # four arrays, a 0-d bool among them (the bytes of each padded to 8)
    for _ in range(3):
        sender.send(same)
    # routing id + header + (layout) + the arrays' bytes
    assert frames == [4, 3, 3]
    for _ in range(3):
        _same(receiver.receive(), same)
    sender.stop(timeout=0.1)


def test_a_follower_that_connects_late_misses_nothing():
    """PUB/SUB's slow joiner: process 0 waits for every follower's hello, so its first message reaches one
    that connected after process 0 was ready."""
    sender = step_channel.Sender(2, flatten=jax.tree.flatten)
    assert sender.wait_joined(0.2) == [1]  # nobody yet
    late = {}

    def join():
        time.sleep(0.5)
        late["receiver"] = step_channel.Receiver(1, 2, "127.0.0.1", sender.published, unflatten=jax.tree.unflatten)

    t = threading.Thread(target=join)
    t.start()
    assert sender.wait_joined(10.0) == []
    t.join()
    sender.send(_message(0))
    _same(late["receiver"].receive(), _message(0))
    sender.stop(timeout=0.1)


def test_a_stray_connection_or_a_wrong_token_is_not_a_follower():
    sender = step_channel.Sender(2, flatten=jax.tree.flatten)
    port, _ = sender.published.split()
    step_channel.Receiver(1, 2, "127.0.0.1", f"{port} {'0' * 32}", unflatten=jax.tree.unflatten)
    assert sender.wait_joined(0.5) == [1]
    sender.stop(timeout=0.1)


def test_a_follower_that_is_gone_fails_the_send_naming_it():
    sender, (receiver,) = _pair()
    sender.send(_message(0))
    receiver._sock.close(linger=0)  # noqa: SLF001 (as the kernel closes a dead process's sockets)
    deadline = time.monotonic() + 10
    with pytest.raises(step_channel.PeerGone, match="process\\(es\\) 1 of 2 left"):
        while time.monotonic() < deadline:  # the disconnect reaches process 0's socket within milliseconds
            sender.send(_message(1))
            time.sleep(0.01)
    assert sender.stop(timeout=0.1) == []  # nobody left to answer


def test_object_arrays_are_refused():
    sender, (receiver,) = _pair()
    with pytest.raises(ValueError, match="cannot travel as bytes"):
        sender.send({"x": np.array([object()])})
    sender.stop(timeout=0.1)
