"""device_free_bytes: the allocator's count where it keeps one, the driver's (capped by JAX's memory fraction)
where it does not (XLA's VMM allocator), None on a CPU host."""

from __future__ import annotations

import dataclasses

import jax

from jaxllm import device_memory

GIB = 1 << 30


@dataclasses.dataclass
class FakeDevice:
    stats: dict | None
    platform: str = "gpu"
    local_hardware_id: int = 0

    def memory_stats(self):
        return self.stats


def test_a_cpu_host_counts_nothing():
    assert device_memory.device_free_bytes(jax.devices()[:1]) is None


def test_the_allocators_count_is_taken_on_the_fullest_device():
    devices = [FakeDevice({"bytes_limit": 10 * GIB, "bytes_in_use": 3 * GIB}),
               FakeDevice({"bytes_limit": 10 * GIB, "bytes_in_use": 4 * GIB})]
    assert device_memory.device_free_bytes(devices) == 6 * GIB


def test_without_the_allocators_count_the_driver_counts_within_the_memory_fraction(monkeypatch):
    counts = {0: (100 * GIB, 140 * GIB), 1: (120 * GIB, 140 * GIB)}
    monkeypatch.setattr(device_memory, "_driver_free_and_total", lambda ordinal: counts[ordinal])
    devices = [FakeDevice(None, local_hardware_id=0), FakeDevice(None, local_hardware_id=1)]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    # Device 0: 100 GiB free, but 0.9 x 140 = 126 GiB may be taken and 40 are used already: 86.
    assert device_memory.device_free_bytes(devices) == int(0.9 * 140 * GIB) - 40 * GIB
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.0")
    assert device_memory.device_free_bytes(devices) == 100 * GIB  # then what is free binds
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert device_memory.device_free_bytes(devices) == int(0.75 * 140 * GIB) - 40 * GIB  # JAX's default


def test_a_driver_that_cannot_be_asked_counts_nothing(monkeypatch):
    monkeypatch.setattr(device_memory, "_driver_free_and_total", lambda ordinal: None)
    assert device_memory.device_free_bytes([FakeDevice(None)]) is None
    # This machine has no CUDA driver: the real query says so rather than failing.
    monkeypatch.undo()
    assert device_memory._driver_free_and_total(0) is None
