"""tests/builders.free_port: the port a test server binds a moment later is never one the kernel hands out
to outgoing connections or bind(0) meanwhile (the ephemeral range), and never handed out twice."""

from __future__ import annotations

import socket

from tests.builders import ephemeral_ports, free_port


def test_free_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    ephemeral = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if p in ephemeral]
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))

