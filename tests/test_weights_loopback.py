"""Defect 1: importing ray (or twinkle_ray.weights) before initialize() must not put the embedded Ray
on a non-loopback address. Each case runs in a fresh interpreter (the import order is the point)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import ipaddress, sys
    {first}
    import psutil
    import twinkle_ray
    twinkle_ray.initialize("ray", num_cpus=1)
    try:
        found, wide = 0, []
        for p in psutil.Process().children(recursive=True):
            try:
                name = p.name()
                conns = p.net_connections(kind="tcp")
            except psutil.Error:
                continue
            if not any(k in name for k in ("gcs_server", "raylet")):
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN:
                    found += 1
                    ip = ipaddress.ip_address(c.laddr.ip)
                    ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is loopback
                    if not ip.is_loopback:
                        wide.append((name, c.laddr.ip, c.laddr.port))
        print("LISTENING", found, "WIDE", wide)
        sys.exit(0 if found and not wide else 1)
    finally:
        twinkle_ray.shutdown()
""")


@pytest.mark.slow
@pytest.mark.parametrize("first", ["import ray", "from twinkle_ray.weights import sync_weights"],
                         ids=["ray-first", "weights-first"])
def test_embedded_ray_listens_on_loopback_whatever_was_imported_first(first):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
           and k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(first=first)], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
