"""The docs' command blocks run as written, in the environment ``bash scripts/setup.sh`` makes.

Every command line of a bash block in README.md, docs/ and examples/ is accounted for
(:data:`WHO_RUNS`): run here, run by a named test with the same arguments, or not run here,
with the reason. A new command in the docs fails :func:`test_every_doc_command_is_accounted_for`
until someone says which.

Run here, verbatim:

- docs/deploy.md's Ray Serve section: its three ``# terminal N`` blocks, as a user would in
  three terminals: terminal 1 (a head node, ``ray start --head --block``) and terminal 2
  (``serve run deploy/serve.yaml``) in the background, terminal 3 (the curl client) once
  terminal 2 printed the ready line the docs name; then Ctrl-C (SIGINT to the process group,
  as a terminal sends it) stops terminal 2, then terminal 1;
- its Ray Jobs section: terminal 1 (the head) in the background, terminal 2 (``ray job
  submit``, then ``twinkle-ray topology --address 127.0.0.1:6379``) to its end;
- README.md's API snippet, in a fresh process on this 2-core machine;
- the pure blocks (a groups file and its plan, ``--help`` of the CLI and the examples);
- docs/routing.md's Python blocks: the rule's examples are true of the code.

The head and Serve run in a private network namespace (``unshare -rn``: only a loopback
interface, brought up first), so the docs' default ports (6379, 8000, 8265, ...) cannot clash
with anything else on the machine and a service that listened on all interfaces would still
be seen (the test reads the namespace's listening sockets). ``RAY_TMPDIR`` points at a private
directory, so the head's address file never reaches another Ray user of the machine. The
environment is otherwise the caller's, minus every ``RAY_`` setting, so the docs' own
``export`` lines are what counts. Nothing runs ``ray stop``; after Ctrl-C, whatever is left of
the process group the test started is killed by its id and reported as a failure. A checkout
without ``.venv`` (a git worktree) gets a ``.venv`` link to the venv running the tests for the
duration.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "deploy.md"
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def venv():
    """``ROOT/.venv``, as ``bash scripts/setup.sh`` makes it: a link to this venv if missing."""
    link = ROOT / ".venv"
    made = not link.exists()
    if made:
        link.symlink_to(Path(sys.prefix))
    yield link
    if made:
        link.unlink()


def serve_terminals() -> dict[int, str]:
    """{terminal number: its bash block} from docs/deploy.md's Serve section."""
    return section_terminals("## 3. Ray Serve")


def section_terminals(heading: str) -> dict[int, str]:
    """{terminal number: its bash block} from a section of docs/deploy.md."""
    text = DOCS.read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
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
    assert ready_line(t).startswith("Application 'sampler' is ready at http://127.0.0.1:8000/sample")


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


def ready_line(terminals: dict[int, str]) -> str:
    """The line terminal 3 says to wait for (``# terminal 3: ..., once terminal 2 says "..."``)."""
    m = re.search(r'says "(.+)"', terminals[3].splitlines()[0])
    assert m, terminals[3].splitlines()[0]
    return m.group(1)


def _prelude(terminals: dict[int, str], work: Path) -> str:
    """The driver script's start: the blocks written out as terminalN.sh, wait_for and stop."""
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
        """)


def _driver(terminals: dict[int, str], work: Path) -> str:
    """The bash script run inside the namespace: the docs' blocks, verbatim, as terminals."""
    return _prelude(terminals, work) + textwrap.dedent(f"""\
        bash $W/terminal1.sh > $W/t1.log 2>&1 &
        T1=$!
        wait_for 180 grep -q "Ray runtime started" $W/t1.log || echo "NO HEAD"
        bash $W/terminal2.sh > $W/t2.log 2>&1 &
        T2=$!
        wait_for 240 grep -qF {shlex.quote(ready_line(terminals))} $W/t2.log \\
            && echo "READY LINE" || echo "NO READY LINE"
        wait_for 60 curl -sf -m 10 -X POST http://127.0.0.1:8000/sample -d '{{"prompt": "up?"}}' \\
            && echo "APP UP" || echo "APP NOT UP"
        cat /proc/net/tcp /proc/net/tcp6 > $W/listening.txt
        bash $W/terminal3.sh > $W/t3.log 2>&1; echo "TERMINAL3 RC $?"
        stop $T2 terminal2
        stop $T1 terminal1
        """)


def _run_in_namespace(work: Path, env: dict) -> tuple[str, list]:
    """Run ``work/driver.sh`` in a private network namespace; (its output, processes it left,
    killed here)."""
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
    return out, left


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)  # its own bound, with the output, comes first
def test_serve_steps_of_the_docs_run_as_written(venv):
    if not _userns_available():
        pytest.skip("no unprivileged user + network namespaces here (unshare -rn); the docs' "
                    "default ports cannot be used without one on a shared machine")
    terminals = serve_terminals()
    work = Path(tempfile.mkdtemp(prefix="trd", dir="/tmp"))  # short: Ray's unix socket paths
    (work / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = str(work / "tmp")  # the head's address file stays ours
    (work / "driver.sh").write_text(_driver(terminals, work))
    out, left = _run_in_namespace(work, env)

    def log(name: str) -> str:
        p = work / name
        return p.read_text(errors="replace")[-4000:] if p.exists() else "(none)"

    where = (f"driver:\n{out}\nterminal 1:\n{log('t1.log')}\nterminal 2:\n{log('t2.log')}\n"
             f"terminal 3:\n{log('t3.log')}")
    try:
        assert "READY LINE" in out, where  # the line the docs tell the reader to wait for
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


# ---------------------------------------------------------------------------------- Ray Jobs
def test_docs_jobs_section_has_the_head_and_the_submit_in_its_blocks():
    t = section_terminals("## 2. Ray Jobs")
    assert sorted(t) == [1, 2], t
    assert "export RAY_AUTH_MODE=token" in t[1] and "export RAY_AUTH_MODE=token" in t[2]
    assert "ray start --head --block --node-ip-address=127.0.0.1 --num-cpus=" in t[1]
    assert "ray job submit --working-dir . -- $PWD/.venv/bin/python examples/" in t[2]
    assert "ray stop" not in "".join(t.values())


def _jobs_driver(terminals: dict[int, str], work: Path) -> str:
    return _prelude(terminals, work) + textwrap.dedent("""\
        bash $W/terminal1.sh > $W/t1.log 2>&1 &
        T1=$!
        wait_for 180 grep -q "Ray runtime started" $W/t1.log || echo "NO HEAD"
        timeout 420 bash $W/terminal2.sh > $W/t2.log 2>&1; echo "TERMINAL2 RC $?"
        stop $T1 terminal1
        """)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_jobs_steps_of_the_docs_run_as_written(venv):
    if not _userns_available():
        pytest.skip("no unprivileged user + network namespaces here (unshare -rn); the docs' "
                    "default ports cannot be used without one on a shared machine")
    terminals = section_terminals("## 2. Ray Jobs")
    work = Path(tempfile.mkdtemp(prefix="trj", dir="/tmp"))  # short: Ray's unix socket paths
    (work / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = str(work / "tmp")
    (work / "driver.sh").write_text(_jobs_driver(terminals, work))
    out, left = _run_in_namespace(work, env)
    t2 = (work / "t2.log").read_text(errors="replace") if (work / "t2.log").exists() else "(none)"
    t1 = (work / "t1.log").read_text(errors="replace")[-3000:] if (work / "t1.log").exists() else ""
    where = f"driver:\n{out}\nterminal 1:\n{t1}\nterminal 2:\n{t2[-6000:]}"
    try:
        assert "TERMINAL2 RC 0" in out, where
        assert re.search(r"Job '[^']+' succeeded", t2), where  # what the docs say it ends with
        assert "twinkle_ray gangs on 127.0.0.1:6379" in t2, where  # the CLI on loopback, no env var
        assert "STOPPED terminal1" in out and not left, where
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -------------------------------------------------------------------------- README's API snippet
def readme_api_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The API in brief", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_readme_api_snippet_fits_on_two_cores():
    """Its groups ask for no more CPUs than a 2-core laptop has (and the GPUs it declares)."""
    code = readme_api_snippet()
    assert "num_gpus=8" in code and "cpus_per_worker=0.5" in code and "ranks=4" in code


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_api_snippet_runs_as_written(tmp_path):
    """The snippet in a fresh process (an embedded Ray of its own on this machine's cores)."""
    script = tmp_path / "snippet.py"
    script.write_text(readme_api_snippet())
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=360)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "trainer" in out.stdout, out.stdout[-3000:]  # get_device_placement() printed the group


# ------------------------------------------------------------------------- every command, accounted
DOC_FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*.md")),
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "deploy").rglob("*.md"))]
HERE = "run here"
NOT_HERE = "not run by the tests: "
# Each command line of a bash block (its comment dropped): who runs it. A test file named here
# runs that command with the same arguments (an example's main(), or the CLI).
WHO_RUNS = {
    # the README's setup and the developer loop: CI (.ci/run) runs exactly these
    "bash scripts/setup.sh && .venv/bin/python examples/quickstart.py": ".ci/run (setup); tests/test_cli.py (the demo)",
    "bash scripts/setup.sh test && .venv/bin/python -m pytest -q": ".ci/run",
    "bash scripts/setup.sh": ".ci/run (setup.sh test installs a superset)",
    "bash scripts/setup.sh rlhf": ".ci/run",
    ".venv/bin/python -m pytest -q -m \"not slow\"": ".ci/run runs the whole suite, this tier included",
    ".venv/bin/mkdocs serve -a 127.0.0.1:8000": NOT_HERE + "a live server; CI builds the same site (mkdocs build --strict)",
    # examples
    ".venv/bin/python examples/quickstart.py --steps 3": "tests/test_cli.py (demo --steps 1); tests/test_jobs.py",
    ".venv/bin/python examples/rlhf_grpo.py": NOT_HERE + "100 steps (minutes); its --quick run is tested",
    ".venv/bin/python examples/rlhf_grpo.py --quick": "tests/test_rlhf.py",
    ".venv/bin/python examples/rlhf_grpo.py --ray-data": NOT_HERE + "100 steps; its Ray Data loader is tested in tests/test_data.py",
    ".venv/bin/python examples/rlhf_grpo.py --quick --async 1": "tests/test_rlhf.py",
    ".venv/bin/python examples/rlhf_grpo.py --quick --long-tail --balance 1": "tests/test_examples_balance.py",
    ".venv/bin/python examples/rlhf_fsdp_hf.py": NOT_HERE + "120 steps (minutes); its --quick run is tested",
    ".venv/bin/python examples/rlhf_fsdp_hf.py --quick": "tests/test_rlhf_fsdp_hf.py",
    ".venv/bin/python examples/rlhf_fsdp_hf.py --help": HERE,
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick [--pp 2]": "tests/test_vllm_megatron.py",
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick": "tests/test_vllm_megatron.py",
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --pp 2": "tests/test_vllm_megatron.py",
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --balance 2 --long-tail": "tests/test_examples_balance.py",
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cuda": NOT_HERE + "needs 4 GPUs",
    "ray job submit --working-dir . -- .venv/bin/python examples/rlhf_grpo.py": NOT_HERE + "a cluster's head (the Jobs section's block is run instead)",
    "ray job submit --working-dir . -- $PWD/.venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick": NOT_HERE + "a cluster's head and the rlhf stack (the Jobs section's block is run instead)",
    # the CLI
    ".venv/bin/twinkle-ray demo --help": HERE,
    ".venv/bin/twinkle-ray bench --help": HERE,
    "cat > groups.yaml <<'EOF'": HERE,
    "- {name: sampler, ranks: 4, device_type: cuda, gpus_per_worker: 2}": HERE,
    "- {name: trainer, ranks: [4, 5, 6, 7]}": HERE,
    "EOF": HERE,
    ".venv/bin/twinkle-ray topology groups.yaml": HERE,
    ".venv/bin/twinkle-ray topology groups.yaml --ray": "tests/test_cli.py",
    # the bench
    ".venv/bin/python -m bench --json > run.json": NOT_HERE + "a full bench run (minutes of both cores)",
    ".venv/bin/python -m bench --report --from run.json --out BENCHMARKS.md": "tests/test_bench_report.py",
    ".venv/bin/python -m bench": NOT_HERE + "a full bench run; its --quick mode is tested",
    ".venv/bin/python -m bench --quick": "tests/test_bench.py",
    ".venv/bin/python -m bench --json": "tests/test_bench.py (--quick --json)",
    ".venv/bin/python -m bench --only B1,B4": NOT_HERE + "full sizes; the same rows run in tests/test_bench.py's --quick",
    ".venv/bin/twinkle-ray bench --quick": "tests/test_cli.py (bench passes its arguments on); tests/test_bench.py (--quick)",
}
SECTIONS_RUN_HERE = {"docs/deploy.md": ("## 2. Ray Jobs", "## 3. Ray Serve")}


def doc_commands() -> list[tuple[str, str]]:
    """(file, command line) for every line of every bash block outside the sections run whole."""
    found = []
    for rel in DOC_FILES:
        text = (ROOT / rel).read_text()
        for heading in SECTIONS_RUN_HERE.get(rel, ()):
            head, rest = text.split(heading, 1)
            text = head + "\n## " + rest.split("\n## ", 1)[1] if "\n## " in rest else head
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                line = re.sub(r"\s+#\s.*$", "", line).strip()
                if line and not line.startswith("#"):
                    found.append((rel, line))
    return found


def test_every_doc_command_is_accounted_for():
    unknown = [(f, c) for f, c in doc_commands() if c not in WHO_RUNS]
    assert not unknown, ("doc commands no test accounts for; add each to WHO_RUNS (run here, the "
                         f"test that runs it, or why not): {unknown}")
    for who in set(WHO_RUNS.values()):
        for path in re.findall(r"(?:tests/\w+\.py|\.ci/run)", who):
            assert (ROOT / path).is_file(), path


@pytest.mark.slow  # about 20 s: the CLI and the examples import torch
def test_pure_doc_commands_run_as_written(tmp_path, venv):
    """The blocks that need no cluster: a groups file and its plan, --help of the CLI and an
    example, run with bash from the repository root (the groups file written to a temp dir)."""
    here = [c for _, c in doc_commands() if WHO_RUNS.get(c) == HERE]
    assert ".venv/bin/twinkle-ray topology groups.yaml" in here
    script = "set -e\n" + "\n".join(
        c.replace("groups.yaml", str(tmp_path / "groups.yaml")) for c in dict.fromkeys(here))
    if not (ROOT / ".venv" / "bin" / "twinkle-ray").exists():
        pytest.skip("the venv has no twinkle-ray script (not installed with pip install -e .)")
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "usage: twinkle-ray demo" in out.stdout and "usage: python -m bench" in out.stdout
    assert "group 'sampler': 2 worker(s)" in out.stdout, out.stdout[-2000:]


# ==========================================================================================
# docs/routing.md's Python blocks run as written: the rule's examples are true of the code.
PAGE = Path(__file__).resolve().parents[1] / "docs" / "routing.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
RUNNABLE = [b for b in BLOCKS if "trainer." not in b]  # the one sketch needs gangs


def test_the_page_has_runnable_examples():
    assert len(RUNNABLE) >= 3


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_each_example_runs(block):
    exec(compile(block, str(PAGE), "exec"), {})
