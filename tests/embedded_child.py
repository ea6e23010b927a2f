"""Child driver for test_embedded.py: an embedded twinkle_ray run that reports its listening sockets.

Run as ``python embedded_child.py``. Starts twinkle_ray's embedded Ray (no address, no RAY_ADDRESS),
builds a 2-worker gang with torch.distributed (gloo) and an all-reduce, then prints one line
``SOCKETS {json}``: every listening TCP socket of this process and of its descendants (the
embedded Ray's processes and our gang's workers), as [address, port, pid, command].
Linux only (reads /proc).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def descendants(root: int) -> dict[int, str]:
    """pid -> command of ``root`` and every process under it."""
    parent, cmd = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        parent[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        out[pid] = cmd.get(pid, "?")
        todo.extend(c for c, p in parent.items() if p == pid)
    return out


def _addr(hexaddr: str) -> str:
    host, _port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening(pids: dict[int, str]) -> list[list]:
    """[address, port, pid, command] of every listening TCP socket owned by ``pids``."""
    inode_pid = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inode_pid[link[8:-1]] = pid
        except OSError:
            continue
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            pid = inode_pid.get(fields[9])
            if pid is not None:
                rows.append([_addr(fields[1]), int(fields[1].split(":")[1], 16), pid, pids[pid]])
    return rows


def main() -> int:
    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup, remote_class, remote_function

    @remote_class()
    class Summer:
        @remote_function(dispatch="all", collect="flatten")
        def all_reduce(self) -> list:
            import torch
            import torch.distributed as dist

            t = torch.ones(1)
            dist.all_reduce(t)
            return [float(t.item())]

    twinkle.initialize("ray", groups=[DeviceGroup("lo", 2, "cpu")], num_cpus=4, namespace="twinkle-embedded")
    try:
        summer = Summer(remote_group="lo")
        assert summer.all_reduce()() == [2.0, 2.0]
        import ray

        node = ray.nodes()[0]["NodeManagerAddress"]
        time.sleep(2)  # the agents open their ports a moment after the node is up
        rows = listening(descendants(os.getpid()))
        print("SOCKETS " + json.dumps({"node": node, "sockets": rows}), flush=True)
    finally:
        twinkle.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
