"""find_free_port / find_node_ip: Twinkle's network helpers, answered the way the runtime does.

``find_node_ip`` is the address Ray knows this node by (the one gangs use for
MASTER_ADDR across nodes); ``find_free_port`` asks the OS for a port nobody is
bound to, as the runtime does for MASTER_PORT.

Example::

    >>> port = find_free_port()
    >>> 0 < port < 65536
    True
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["find_free_port", "find_node_ip", "is_loopback", "loopback_listener"]


def find_free_port(start_port: int | None = None, retry: int = 100, host: str = "") -> int:
    """A TCP port free on this machine.

    Without ``start_port`` the OS picks one; with it, the first free port of
    ``start_port .. start_port + retry - 1``. ``host`` is the address tried (all
    interfaces by default, as a rendezvous port must be reachable from other nodes).

    Raises ``OSError`` naming the range when none of its ports is free.
    """
    if start_port is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    if retry < 1:
        raise ValueError(f"find_free_port: retry must be >= 1, got {retry!r}")
    for port in range(start_port, start_port + retry):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"find_free_port: no free port in {start_port}..{start_port + retry - 1}")


def find_node_ip() -> str:
    """The IP address of this node as Ray knows it (works before ``ray.init`` too)."""
    import ray  # here, so that ``import twinkle_ray`` does not load Ray

    return ray.util.get_node_ip_address()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``'localhost'``) is this machine's loopback.

    Example::

        >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("10.0.0.1")
        (True, True, False)
    """
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_listener(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on the loopback address ``host`` (``port`` 0: the OS picks one).

    torch's TCPStore server binds every interface for the address it is given; a
    store that must stay on loopback binds here and takes the socket
    (``TCPStore(..., master_listen_fd=sock.fileno())``, then ``sock.detach()``).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(max(64, backlog))
    return sock
