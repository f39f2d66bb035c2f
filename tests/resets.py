"""Connection resets as a load balancer or a NAT that drops a flow sends them: ``ss -K`` destroys
the TCP sockets a filter names, and each end's next read or write fails (the peer gets a reset).

Every filter here names one address and port (a run's channel), and optionally one peer port, so
that nothing but the run's own connections is touched. ``ss -K`` needs root and a kernel built
with ``CONFIG_INET_DIAG_DESTROY``; :func:`why_not` says when this machine cannot.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess

import psutil


def why_not() -> str | None:
    """Why ``ss -K`` cannot reset connections here, or None: it is tried on a connection of this process's own."""
    if os.geteuid() != 0:
        return "resetting connections with ss -K needs root"
    if shutil.which("ss") is None:
        return "resetting connections needs the ss command (iproute2)"
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        server, _ = listener.accept()
        try:
            killed = reset(("127.0.0.1", port))
            client.settimeout(5)
            try:
                broken = client.recv(1) == b""
            except OSError:
                broken = True
        finally:
            client.close()
            server.close()
    if not killed or not broken:
        return "ss -K destroyed no socket here (the kernel lacks CONFIG_INET_DIAG_DESTROY)"
    return None


def reset(address: tuple[str, int], peer_port: int | None = None, netns: str | None = None,
          peer_host: str | None = None) -> list[str]:
    """Destroy the TCP connections to and from ``address`` (both ends, where both are in this network
    namespace, or ``netns``'s); with ``peer_port``, only the one whose other end has that port; with
    ``peer_host``, only those whose other end is that address. Returns the sockets ``ss`` destroyed,
    one line each."""
    host, port = address
    if peer_host is not None:
        expr = f"( src {host}:{port} and dst {peer_host} ) or ( dst {host}:{port} and src {peer_host} )"
    elif peer_port is None:
        expr = f"( src {host}:{port} or dst {host}:{port} )"
    else:
        expr = (f"( src {host}:{port} and dport = :{peer_port} ) or "
                f"( dst {host}:{port} and sport = :{peer_port} )")
    cmd = ["ss", "-K", "-H", "-tn", expr]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30)
    return [line for line in out.stdout.splitlines() if line.strip()]


def connection_port(pid: int, address: tuple[str, int]) -> int | None:
    """The local port of process ``pid``'s connection to ``address``, or None if it has none."""
    for c in psutil.Process(pid).net_connections("tcp"):
        if c.raddr and (c.raddr.ip, c.raddr.port) == address and c.status == psutil.CONN_ESTABLISHED:
            return c.laddr.port
    return None


def listening_ports() -> set[int]:
    """The TCP ports this process listens on."""
    return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def listening_address(port: int) -> tuple[str, int]:
    """The address this process listens on at ``port``."""
    for c in psutil.Process().net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            return c.laddr.ip, port
    raise LookupError(f"this process listens on no port {port}")
