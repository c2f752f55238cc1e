"""tests/builders.py's machine helpers: `free_port` (the port a test server binds a moment later is never one
the kernel hands out to outgoing connections or bind(0) meanwhile, nor handed out twice) and `load_factor`
(what wall-clock limits in tests are scaled by)."""

from __future__ import annotations

import socket

import pytest

from tests.builders import ephemeral_ports, free_port, load_factor


def test_free_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    ephemeral = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if p in ephemeral]
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.parametrize("load,cores,factor", [(0.3, 2, 1.0), (8.0, 2, 4.0), (40.0, 2, 5.0)])
def test_the_load_factor_is_runnable_processes_per_core_between_1_and_the_cap(monkeypatch, load, cores, factor):
    monkeypatch.setattr("os.getloadavg", lambda: (load, load, load))
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert load_factor() == factor
