"""Spike: Ray Direct Transport (gloo) vs point-to-point pairs over our own gloo groups, one tensor
moved actor to actor, on this machine. Figures for docs/decisions/weight-transport.md.

Measured for each: time to move ``--mb`` MB (median of 3, after a warm-up), bytes each process wrote
(``/proc/self/io`` wchar delta: the wire bytes and anything else), and failure behaviour: the sender
killed while the receiver waits inside a transfer -> seconds until the receiver's call ends.

    python -m bench.spike_transport [--mb 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import ray  # noqa: E402
import torch  # noqa: E402


def wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("wchar:"))


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class RdtEnd:
    def __init__(self, mb: int):
        self.t = torch.randn(mb * 2**18)

    def pid(self) -> int:
        return os.getpid()

    def io(self) -> int:
        return wchar()

    def slow(self, s: float) -> int:
        time.sleep(s)
        return 0

    @ray.method(tensor_transport="gloo")
    def tensor(self, delay: float = 0.0):
        time.sleep(delay)
        return self.t

    def take(self, t) -> float:
        return float(t[0])


@ray.remote(num_cpus=0)
class PairEnd:
    def __init__(self, mb: int):
        self.t = torch.randn(mb * 2**18)
        self.buf = torch.empty_like(self.t)

    def pid(self) -> int:
        return os.getpid()

    def io(self) -> int:
        return wchar()

    def host(self):
        from twinkle_ray.weights.transport import Endpoint

        self.ep = Endpoint.host(60)
        return self.ep.address

    def open(self, addr, port, rank):
        from twinkle_ray.weights.transport import Endpoint, open_pair

        ep = self.ep if rank == 0 else Endpoint.connect(addr, port, 60)
        self.pair = open_pair(ep, "spike", rank, "gloo", 60)
        return True

    def send(self, delay: float = 0.0) -> int:
        time.sleep(delay)
        self.pair.send(self.t).wait()
        return 0

    def recv(self) -> float:
        self.pair.recv(self.buf).wait()
        return float(self.buf[0])


def _time(fn, n=3):
    fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def rdt(mb: int) -> dict:
    from ray.experimental.collective import create_collective_group

    a, b = RdtEnd.remote(mb), RdtEnd.remote(mb)
    create_collective_group([a, b], backend="torch_gloo")
    io0 = ray.get([a.io.remote(), b.io.remote()])
    s = _time(lambda: ray.get(b.take.remote(a.tensor.remote())))
    io1 = ray.get([a.io.remote(), b.io.remote()])
    pid = ray.get(a.pid.remote())
    ref = b.take.remote(a.tensor.remote(2.0))  # the sender dies while the receiver waits
    time.sleep(1.0)
    os.kill(pid, 9)
    t0 = time.perf_counter()
    try:
        ray.get(ref, timeout=120)
        err = "none"
    except Exception as e:
        err = type(e).__name__
    fail_s = time.perf_counter() - t0
    ray.kill(b)
    return {"seconds": s, "sender_written_mb": (io1[0] - io0[0]) / 4 / 2**20,
            "receiver_written_mb": (io1[1] - io0[1]) / 4 / 2**20, "sender_killed_error_s": fail_s,
            "sender_killed_error": err}


def pairs(mb: int) -> dict:
    a, b = PairEnd.remote(mb), PairEnd.remote(mb)
    addr, port = ray.get(a.host.remote())
    ray.get([a.open.remote(addr, port, 0), b.open.remote(addr, port, 1)])
    io0 = ray.get([a.io.remote(), b.io.remote()])
    s = _time(lambda: ray.get([a.send.remote(), b.recv.remote()]))
    io1 = ray.get([a.io.remote(), b.io.remote()])
    pid = ray.get(a.pid.remote())
    a.send.remote(2.0)
    ref = b.recv.remote()
    time.sleep(1.0)
    os.kill(pid, 9)
    t0 = time.perf_counter()
    try:
        ray.get(ref, timeout=120)
        err = "none"
    except Exception as e:
        err = type(e).__name__ + ": " + str(e).splitlines()[-1][:80]
    fail_s = time.perf_counter() - t0
    ray.kill(b)
    return {"seconds": s, "sender_written_mb": (io1[0] - io0[0]) / 4 / 2**20,
            "receiver_written_mb": (io1[1] - io0[1]) / 4 / 2**20, "sender_killed_error_s": fail_s,
            "sender_killed_error": err}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(address="local", num_cpus=4, runtime_env={"env_vars": {"PYTHONPATH": root}})
    out = {"mb": args.mb, "rdt_gloo": rdt(args.mb), "pairs_gloo": pairs(args.mb)}
    ray.shutdown()
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
