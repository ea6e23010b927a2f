"""docs/deploy.md's Ray Serve steps, run exactly as written.

The three ``# terminal N`` bash blocks of the "## 3. Ray Serve" section are
read from the docs and run unchanged, as a user would in three terminals:
terminal 1 (a head node, ``ray start --head --block``) and terminal 2
(``serve run deploy/serve.yaml``) in the background, terminal 3 (the curl
client) once the application answers; then Ctrl-C (SIGINT to the process
group, as a terminal sends it) stops terminal 2, then terminal 1.

Everything runs in a private network namespace (``unshare -rn``: only a
loopback interface, brought up first), so the docs' default ports (6379,
8000, 8265, ...) cannot clash with anything else on the machine and a
service that listened on all interfaces would still be seen (the test reads
the namespace's listening sockets). ``RAY_TMPDIR`` points at a private
directory, so the head's address file never reaches another Ray user of the
machine. The environment is otherwise the caller's, minus every ``RAY_``
setting, so the docs' own ``export`` lines are what counts. Nothing runs
``ray stop``; after Ctrl-C, whatever is left of the session the test started
is killed by session id and reported as a failure.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "deploy.md"
RUN_TIMEOUT_S = 600


def serve_terminals() -> dict[int, str]:
    """{terminal number: its bash block} from docs/deploy.md's Serve section."""
    text = DOCS.read_text()
    section = text.split("## 3. Ray Serve", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    terminals = {}
    for block in blocks:
        m = re.match(r"# terminal (\d+):", block)
        if m:
            terminals[int(m.group(1))] = block
    return terminals


def test_docs_serve_section_has_the_three_terminals():
    t = serve_terminals()
    assert sorted(t) == [1, 2, 3], t
    for n in (1, 2):  # every terminal that talks to Ray sets both, before its first ray command
        assert "export RAY_AUTH_MODE=token" in t[n] and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in t[n]
    assert "ray start --head --block --node-ip-address=127.0.0.1" in t[1]
    assert "serve run deploy/serve.yaml" in t[2]
    assert "curl" in t[3] and "127.0.0.1:8000" in t[3]
    assert "ray stop" not in "".join(t.values())


def _userns_available() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    try:
        return subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"],
                              capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _session_processes(sid: int, marker: str) -> list[tuple[int, str]]:
    """Live (pid, cmdline) of session ``sid`` or naming ``marker`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if stat[0] != "Z" and (int(stat[3]) == sid or marker in cmd):
            found.append((int(entry.name), cmd))
    return found


def _driver(terminals: dict[int, str], work: Path) -> str:
    """The bash script run inside the namespace: the docs' blocks, verbatim, as terminals."""
    for n, block in terminals.items():
        (work / f"terminal{n}.sh").write_text(block)
    return textwrap.dedent(f"""\
        set -m                      # job control: each terminal is a process group of its own
        ip link set lo up
        cd {shlex.quote(str(ROOT))}
        W={shlex.quote(str(work))}
        wait_for() {{  # wait_for SECONDS COMMAND...: poll until COMMAND succeeds
            local until=$((SECONDS + $1)); shift
            until "$@" >/dev/null 2>&1; do
                [ $SECONDS -ge $until ] && return 1; sleep 1
            done
        }}
        stop() {{  # Ctrl-C a terminal; report whether it ended within 120 s (a loaded CI machine)
            kill -INT -- -$1 2>/dev/null
            for i in $(seq 120); do kill -0 $1 2>/dev/null || {{ echo "STOPPED $2"; return; }}; sleep 1; done
            echo "STUCK $2"; ps -o pid,stat,wchan:20,args -g $1 | cut -c1-200  # what did not stop
        }}
        bash $W/terminal1.sh > $W/t1.log 2>&1 &
        T1=$!
        wait_for 180 grep -q "Ray runtime started" $W/t1.log || echo "NO HEAD"
        bash $W/terminal2.sh > $W/t2.log 2>&1 &
        T2=$!
        wait_for 240 curl -sf -m 10 -X POST http://127.0.0.1:8000/sample -d '{{"prompt": "up?"}}' \\
            && echo "APP UP" || echo "APP NOT UP"
        cat /proc/net/tcp /proc/net/tcp6 > $W/listening.txt
        bash $W/terminal3.sh > $W/t3.log 2>&1; echo "TERMINAL3 RC $?"
        stop $T2 terminal2
        stop $T1 terminal1
        """)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)  # its own bound, with the output, comes first
def test_serve_steps_of_the_docs_run_as_written():
    if not _userns_available():
        pytest.skip("no unprivileged user + network namespaces here (unshare -rn); the docs' "
                    "default ports cannot be used without one on a shared machine")
    terminals = serve_terminals()
    work = Path(tempfile.mkdtemp(prefix="trd", dir="/tmp"))  # short: Ray's unix socket paths
    (work / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = str(work / "tmp")  # the head's address file stays ours
    (work / "driver.sh").write_text(_driver(terminals, work))
    proc = subprocess.Popen(["unshare", "-rn", "bash", str(work / "driver.sh")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = "(driver timed out)"
    finally:
        deadline = time.monotonic() + 30  # Ray's processes end shortly after `ray start --block`
        while (left := _session_processes(proc.pid, str(work))) and time.monotonic() < deadline:
            time.sleep(1)
        for pid, _ in left:  # only what this test started: its session, or its temp dir
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)

    def log(name: str) -> str:
        p = work / name
        return p.read_text(errors="replace")[-4000:] if p.exists() else "(none)"

    where = (f"driver:\n{out}\nterminal 1:\n{log('t1.log')}\nterminal 2:\n{log('t2.log')}\n"
             f"terminal 3:\n{log('t3.log')}")
    try:
        assert "APP UP" in out and "TERMINAL3 RC 0" in out, where
        # terminal 3's answers: a sample, then the JSON error for a GET
        answers = [json.loads(line) for line in log("t3.log").splitlines() if line.startswith("{")]
        assert len(answers) == 2, where
        assert isinstance(answers[0]["text"], str) and answers[0]["rank"] in (0, 1), answers
        assert "not allowed" in answers[1]["error"], answers
        # every listening socket in the namespace is on 127.0.0.1 (none on 0.0.0.0 / ::)
        wildcard = []
        for line in log("listening.txt").splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                addr, port = fields[1].split(":")
                if addr in ("00000000", "0" * 32):
                    wildcard.append(int(port, 16))
        assert not wildcard, f"ports listening on all interfaces: {sorted(wildcard)}"
        # Ctrl-C stops both terminals; the harmless Serve shutdown line is explained in the docs
        assert "STOPPED terminal2" in out and "STOPPED terminal1" in out, where
        if "graceful_shutdown failed" in log("t2.log"):
            assert "ServeController.graceful_shutdown failed" in DOCS.read_text()
        assert not left, f"processes survived Ctrl-C: {[c[:120] for _, c in left]}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
