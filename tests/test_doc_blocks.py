"""The docs' command blocks run as written, in the environment ``bash scripts/setup.sh`` makes.

Every command line of a bash block in README.md, docs/ and examples/ is accounted for
(:data:`WHO_RUNS`): run here, run by a named test with the same arguments, or not run here,
with the reason. A new command in the docs fails :func:`test_every_doc_command_is_accounted_for`
until someone says which.

Run here, verbatim:

- docs/deploy.md's Ray Serve section: its three ``# terminal N`` blocks, as a user would in
  three terminals: terminal 1 (a head node, ``ray start --head --block``: the Jobs section's
  head, the same block, run once for both) and terminal 2
  (``serve run deploy/serve.yaml``) in the background, terminal 3 (``serve status``, then the
  curl client) once terminal 2 printed the line the docs name and the app answers; then
  Ctrl-C (SIGINT to the process group, as a terminal sends it) stops terminal 2, then
  terminal 1;
- its Ray Jobs section: terminal 1 (the head) in the background, terminal 2 (``ray job
  submit``, then ``twinkle-ray topology --address 127.0.0.1:6379``) to its end, then
  docs/performance.md's metrics block on that head;
- every page's whole Python blocks (README.md's API snippet and docs/index.md's first
  script, the same text, run once in a fresh process on this 2-core machine; the pure ones,
  docs/routing.md's rule examples among them, together in one process); the sketches are
  compiled, their imports imported, and each names what runs its code whole;
- the pure command blocks (a groups file and its plan, ``--help`` of the CLI and the examples).

The Jobs and Serve sections share their terminal 1 (one head, the same block), so they run
in one go: the Jobs steps, then the Serve steps on that head. Every step's T+seconds is
printed (``pytest -s``) to show where the minutes go.

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

import ast
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
    # one head for both sections: the test runs them on it, a reader may keep it running
    assert t[1] == section_terminals("## 2. Ray Jobs")[1]
    for n in (1, 2):  # every terminal that talks to Ray sets both, before its first ray command
        assert "export RAY_AUTH_MODE=token" in t[n] and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in t[n]
    assert "ray start --head --block --node-ip-address=127.0.0.1" in t[1]
    # a fresh machine has no token and `ray start` with token auth does not make one
    assert t[1].index("ray get-auth-token --generate") < t[1].index("ray start")
    assert "serve run deploy/serve.yaml" in t[2]
    assert "curl" in t[3] and "127.0.0.1:8000" in t[3]
    assert "ray stop" not in "".join(t.values())
    # `serve run CONFIG` prints no line when the app is up (Ray 2.60): it says when the config
    # is in, and terminal 3 asks `serve status` whether the app runs
    assert ready_line(t) == "Submitted deploy config successfully."
    assert t[3].index("serve status") < t[3].index("curl")


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


def _prelude(work: Path, **sections: dict[int, str]) -> str:
    """The driver script's start: each section's blocks written out as ``<section>N.sh``,
    then wait_for and stop."""
    for name, terminals in sections.items():
        for n, block in terminals.items():
            (work / f"{name}{n}.sh").write_text(block)
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


def _driver(jobs: dict[int, str], serve: dict[int, str], work: Path) -> str:
    """The bash script run inside the namespace: the docs' blocks, verbatim, as terminals.

    Terminal 1 (the head, the same block in both sections) in the background; the Jobs
    section's terminal 2 to its end; docs/performance.md's metrics block on that head, as
    from another terminal (terminal 1's ``source`` and ``export`` lines); then the Serve
    section's terminal 2 in the background and its terminal 3 once terminal 2 printed the
    line the docs name and the app answers; Ctrl-C stops terminal 2, then terminal 1."""
    setup = [ln for ln in jobs[1].splitlines() if ln.startswith(("source ", "export "))]
    (work / "metrics.py").write_text("\n".join(b for _, b in blocks_marked(ON_HEAD)))
    return _prelude(work, jobs=jobs, serve=serve) + textwrap.dedent(f"""\
        bash $W/jobs1.sh > $W/t1.log 2>&1 &
        T1=$!
        wait_for 180 grep -q "Ray runtime started" $W/t1.log \\
            || {{ echo "NO HEAD"; stop $T1 terminal1; exit 0; }}
        echo "T+$SECONDS head up"
        timeout 420 bash $W/jobs2.sh > $W/jobs2.log 2>&1; echo "JOBS TERMINAL2 RC $?"
        echo "T+$SECONDS job done"
        (SETUP
         timeout 120 python $W/metrics.py) > $W/metrics.log 2>&1; echo "METRICS RC $?"
        echo "T+$SECONDS metrics read"
        bash $W/serve2.sh > $W/serve2.log 2>&1 &
        T2=$!
        wait_for 240 grep -qF {shlex.quote(ready_line(serve))} $W/serve2.log \\
            && echo "READY LINE" || echo "NO READY LINE"
        echo "T+$SECONDS config in"
        wait_for 240 curl -sf -m 10 -X POST http://127.0.0.1:8000/sample -d '{{"prompt": "up?"}}' \\
            && echo "APP UP" || echo "APP NOT UP"
        echo "T+$SECONDS app up"
        cat /proc/net/tcp /proc/net/tcp6 > $W/listening.txt
        ss -ltnp > $W/listening_by_process.txt 2>&1  # who listens, for a failure's message
        bash $W/serve3.sh > $W/serve3.log 2>&1; echo "TERMINAL3 RC $?"
        stop $T2 terminal2
        echo "T+$SECONDS terminal 2 stopped"
        stop $T1 terminal1
        echo "T+$SECONDS terminal 1 stopped"
        """).replace("SETUP", "\n ".join(setup))


def _terminal_env(work: Path) -> dict[str, str]:
    """The terminals' environment: the caller's minus every ``RAY_`` setting (the docs' own
    ``export`` lines are what counts), ``RAY_TMPDIR`` private (the head's address file stays
    ours) and ``HOME`` fresh: no ``~/.ray/auth_token`` from an earlier run, as on a new machine,
    so the docs' blocks must make the cluster's token themselves."""
    (work / "tmp").mkdir()
    (work / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = str(work / "tmp")
    env["HOME"] = str(work / "home")
    return env


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


# ---------------------------------------------------------------------------------- Ray Jobs
def test_docs_jobs_section_has_the_head_and_the_submit_in_its_blocks():
    t = section_terminals("## 2. Ray Jobs")
    assert sorted(t) == [1, 2], t
    assert "export RAY_AUTH_MODE=token" in t[1] and "export RAY_AUTH_MODE=token" in t[2]
    assert "ray start --head --block --node-ip-address=127.0.0.1 --num-cpus=" in t[1]
    assert t[1].index("ray get-auth-token --generate") < t[1].index("ray start")
    assert "ray job submit --working-dir . -- $PWD/.venv/bin/python examples/" in t[2]
    assert "ray stop" not in "".join(t.values())


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)  # its own bound, with the output, comes first
def test_deploy_steps_of_the_docs_run_as_written(venv):
    """docs/deploy.md's Jobs and Serve sections as written, on one head (their terminal 1 is
    the same block): the quick start submitted as a Ray Job, the CLI listing the cluster's
    gangs, docs/performance.md's metrics block, then the Serve app and its client.
    (tests/test_jobs.py submits the other examples; this is the quick start's run.)"""
    if not _userns_available():
        pytest.skip("no unprivileged user + network namespaces here (unshare -rn); the docs' "
                    "default ports cannot be used without one on a shared machine")
    jobs, serve = section_terminals("## 2. Ray Jobs"), serve_terminals()
    work = Path(tempfile.mkdtemp(prefix="trd", dir="/tmp"))  # short: Ray's unix socket paths
    env = _terminal_env(work)
    (work / "driver.sh").write_text(_driver(jobs, serve, work))
    out, left = _run_in_namespace(work, env)
    print(out)  # the steps' T+seconds: where the time goes (pytest -s shows it)

    def log(name: str, tail: int = 4000) -> str:
        p = work / name
        return p.read_text(errors="replace")[-tail:] if p.exists() else "(none)"

    jobs2 = log("jobs2.log", 100_000)
    where = (f"driver:\n{out}\nterminal 1:\n{log('t1.log', 3000)}\n"
             f"jobs, terminal 2:\n{jobs2[-6000:]}\nmetrics:\n{log('metrics.log', 3000)}\n"
             f"serve, terminal 2:\n{log('serve2.log')}\nserve, terminal 3:\n{log('serve3.log')}")
    try:
        # -- Ray Jobs
        assert "JOBS TERMINAL2 RC 0" in out, where
        assert re.search(r"Job '[^']+' succeeded", jobs2), where  # what the docs say it ends with
        # the job's own output, which `ray job submit` prints: its steps ran on the cluster
        assert "done: 2 steps" in jobs2 and "trainer rank" in jobs2 and "loss (all-reduced" in jobs2, where
        # the job attached to the cluster (8 virtual GPUs it declared), it did not start its own Ray
        assert "Connecting to existing Ray cluster" in jobs2 or "Started a local Ray" not in jobs2, where
        assert "twinkle_ray gangs on 127.0.0.1:6379" in jobs2, where  # the CLI on loopback, no env var
        assert "METRICS RC 0" in out, where  # the metrics block read the head's endpoint
        # -- Ray Serve
        assert "READY LINE" in out, where  # the line the docs tell the reader to wait for
        assert "APP UP" in out and "TERMINAL3 RC 0" in out, where
        # terminal 3's `serve status`, run once the app answers: what the reader waits for
        assert re.search(r"sampler:\s*\n\s*status: RUNNING", log("serve3.log")), where
        # terminal 3's answers: a sample, then the JSON error for a GET
        answers = [json.loads(line) for line in log("serve3.log").splitlines() if line.startswith("{")]
        assert len(answers) == 2, where
        assert isinstance(answers[0]["text"], str) and answers[0]["rank"] in (0, 1), answers
        assert "not allowed" in answers[1]["error"], answers
        # every listening socket in the namespace is on 127.0.0.1 (none on 0.0.0.0 / ::), but
        # the one the docs name: a Serve replica's inter-deployment gRPC server, which Ray 2.60
        # binds to [::]:0 itself (replica.py: add_port_to_grpc_server(server, "[::]:0"))
        by_process = log("listening_by_process.txt", 1_000_000)
        wildcard = []
        for line in log("listening.txt", 1_000_000).splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                addr, port = fields[1].split(":")
                if addr in ("00000000", "0" * 32):
                    wildcard.append(int(port, 16))
        owners = {port: [ln for ln in by_process.splitlines() if f":{port} " in ln] for port in wildcard}
        unexplained = [port for port, lines in owners.items()
                       if not (lines and all("ray::ServeRepli" in ln for ln in lines))]
        assert not unexplained, (f"ports listening on all interfaces: {sorted(unexplained)}\n"
                                 f"{by_process}")
        if wildcard:  # what the docs say about it is there
            assert "inter-deployment gRPC" in DOCS.read_text()
        # Ctrl-C stops both terminals; the harmless Serve shutdown line is explained in the docs
        assert "STOPPED terminal2" in out and "STOPPED terminal1" in out, where
        if "graceful_shutdown failed" in log("serve2.log", 1_000_000):
            assert "ServeController.graceful_shutdown failed" in DOCS.read_text()
        assert not left, f"processes survived Ctrl-C: {[c[:120] for _, c in left]}"
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
    ".venv/bin/python examples/quickstart.py --steps 3": "tests/test_cli.py (demo --steps 1); tests/test_doc_blocks.py (the Jobs steps: --steps 2)",
    ".venv/bin/python examples/rlhf_grpo.py": NOT_HERE + "100 steps (minutes); its --quick run is tested",
    ".venv/bin/python examples/rlhf_grpo.py --quick": "tests/test_rlhf.py",
    ".venv/bin/python examples/rlhf_grpo.py --ray-data": NOT_HERE + "100 steps; its Ray Data loader is tested in tests/test_data.py",
    ".venv/bin/python examples/rlhf_grpo.py --quick --async 1": "tests/test_rlhf.py",
    ".venv/bin/python examples/rlhf_grpo.py --quick --stream": "tests/test_rlhf.py",
    ".venv/bin/python examples/rlhf_grpo.py --quick --long-tail --balance 1": "tests/test_examples_balance.py",
    ".venv/bin/python examples/rlhf_fsdp_hf.py": NOT_HERE + "120 steps (minutes); its --quick run is tested",
    ".venv/bin/python examples/rlhf_fsdp_hf.py --quick": "tests/test_rlhf_fsdp_hf.py",
    ".venv/bin/python examples/rlhf_fsdp_hf.py --help": HERE,
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick [--pp 2]": "tests/test_vllm_megatron.py",
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick": "tests/test_vllm_megatron.py",
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --pp 2": "tests/test_vllm_megatron.py",
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --balance 2 --long-tail": "tests/test_examples_balance.py",
    ".venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --stream": "tests/test_vllm_megatron.py",
    ".venv/bin/python -m bench.rl_modes": NOT_HERE + "three vLLM + Megatron runs (minutes each); each mode's run is tested in tests/test_vllm_megatron.py",
    ".venv/bin/python -m bench.rl_modes --toy": NOT_HERE + "three toy runs; each mode's run is tested in tests/test_rlhf.py",
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
# Every page's Python blocks: run as written, or a sketch that names what runs its code.
#
# A block is keyed by its page and its first line. A *whole* block (it defines or imports every
# name it uses) runs as written: a script that starts Ray in a fresh process of its own, the
# pure ones together in one process (a page's blocks in one namespace, in order, as a reader
# pastes them), one on the Jobs section's head. A *sketch* uses names the page's prose defines
# (``trainer``, ``batch``): it must compile, its imports must import, and the entry names the
# test or example that runs the same code whole. The split is checked, not trusted: a block
# said to be whole has no free names, a sketch has some (else it is whole: run it).
SCRIPT = "run here: a whole script, in a fresh process (an embedded Ray on this machine's cores)"
PURE = "run here: pure, with the other pure blocks in one process"
ON_HEAD = "run here: on the Jobs section's head, after its job (tests this file's Jobs steps)"
SKETCH = "a sketch (names from the page's prose); its code runs whole in "
PY_WHO_RUNS = {
    "README.md: import twinkle_ray as twinkle": SCRIPT,
    "docs/index.md: import twinkle_ray as twinkle": SCRIPT,
    "docs/twinkle.md: import twinkle_ray as twinkle": PURE,
    "docs/twinkle.md: import sys": PURE,
    "docs/routing.md: from twinkle_ray.core.dispatch import collect": PURE,  # two blocks
    "docs/routing.md: from twinkle_ray.core.dispatch import collect, dispatch": PURE,
    "docs/routing.md: # inside a dict: cut like the plain list beside it": SKETCH + "tests/test_routing_gangs.py",
    "docs/performance.md: import urllib.request": ON_HEAD,
    "docs/concepts.md: with twinkle.start_together():": SKETCH + "tests/test_start_together.py",
    "docs/concepts.md: @remote_function(dispatch=\"balance\", collect=\"flatten\", chunk_size=1)":
        SKETCH + "tests/test_balance.py",
    "docs/concepts.md: @remote_function(dispatch=\"balance\", collect=\"flatten\", chunk_size=1, in_flight=8)":
        SKETCH + "tests/test_inflight.py",
    "docs/concepts.md: class Sampler(WeightSyncMixin):": SKETCH + "tests/test_inflight.py",
    "docs/deploy.md: from ray import serve": SKETCH + "examples/serve_sampler.py (this file's Serve steps)",
    "docs/failures.md: try:": SKETCH + "tests/test_failures.py",
    "docs/failures.md: @remote_class(max_restarts=3)": SKETCH + "tests/test_restarts.py",
    "docs/rlhf.md: twinkle.initialize(\"ray\", groups=[": SKETCH + "examples/rlhf_grpo.py (tests/test_rlhf.py)",
    "docs/rlhf.md: @remote_class()": SKETCH + "tests/test_weights.py",
    "docs/rlhf.md: ahead = [sampler.generate(next(batches))]": SKETCH + "examples/rlhf_grpo.py --async 1 (tests/test_rlhf.py)",
}


def python_blocks() -> list[tuple[str, str]]:
    """(key, text) of every ```python block of the docs, in page order."""
    found = []
    for rel in DOC_FILES:
        for block in re.findall(r"```python\n(.*?)```", (ROOT / rel).read_text(), flags=re.S):
            first = next(line for line in block.splitlines() if line.strip())
            first = re.sub(r"\s+#\s.*$", "", first).strip()
            found.append((f"{rel}: {first}", block))
    return found


def free_names(code: str) -> set[str]:
    """Names a block reads that it neither defines nor imports (nor are builtins)."""
    import builtins

    tree = compile(code, "<block>", "exec", flags=ast.PyCF_ONLY_AST)
    defined, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    return read - defined


def blocks_marked(who: str) -> list[tuple[str, str]]:
    return [(k, b) for k, b in python_blocks() if PY_WHO_RUNS.get(k) == who]


def _run_python(code: str, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_every_python_block_is_accounted_for():
    keys = [k for k, _ in python_blocks()]
    unknown = [k for k in keys if k not in PY_WHO_RUNS]
    assert not unknown, ("python blocks no test accounts for; add each to PY_WHO_RUNS (run "
                         f"here, or a sketch and what runs its code whole): {unknown}")
    assert not set(PY_WHO_RUNS) - set(keys), f"entries for blocks gone: {set(PY_WHO_RUNS) - set(keys)}"
    for who in PY_WHO_RUNS.values():
        for path in re.findall(r"(?:tests|examples)/[\w/]+\.py", who):
            assert (ROOT / path).is_file(), path


def test_whole_blocks_are_whole_and_sketches_are_sketches():
    for key, block in python_blocks():
        free = free_names(block)  # compiles, or raises SyntaxError naming the block
        if PY_WHO_RUNS[key].startswith(SKETCH):
            assert free, f"{key}: a sketch that uses no outside name is whole: run it"
        else:
            assert not free, f"{key}: said to run as written but uses undefined {sorted(free)}"


def test_sketches_imports_import():
    """The import lines of every sketch, in one process (``from ray import serve`` included)."""
    lines = []
    for key, block in python_blocks():
        if PY_WHO_RUNS[key].startswith(SKETCH):
            tree = ast.parse(block)
            lines += [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    out = _run_python("\n".join(dict.fromkeys(lines)) + "\nprint('imported')", timeout=120)
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr[-3000:]


def test_pure_blocks_run_as_written():
    """Each page's pure blocks, in order, in one namespace per page; all pages in one process."""
    pages: dict[str, list[str]] = {}
    for key, block in blocks_marked(PURE):
        pages.setdefault(key.split(": ", 1)[0], []).append(block)
    assert "docs/routing.md" in pages and len(pages["docs/routing.md"]) >= 3
    assert "docs/twinkle.md" in pages
    code = textwrap.dedent("""\
        import json, sys, traceback
        for page, blocks in json.loads(sys.argv[1]).items():
            scope = {"__name__": "__main__"}
            for i, block in enumerate(blocks):
                try:
                    exec(compile(block, f"{page} (python block {i})", "exec"), scope)
                except BaseException:
                    traceback.print_exc()
                    sys.exit(f"FAILED: {page}, python block {i}")
        """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code, json.dumps(pages)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


def test_home_page_first_script_fits_on_two_cores():
    """docs/index.md's first script and README's snippet ask for no more CPUs than a 2-core
    laptop has (4 workers at the default 1 CPU each raise PlacementError there)."""
    for key, block in blocks_marked(SCRIPT):
        assert "cpus_per_worker=0.5" in block and "ranks=4" in block, key
    assert {k.split(":")[0] for k, _ in blocks_marked(SCRIPT)} == {"README.md", "docs/index.md"}


def _scripts() -> dict[str, str]:
    """{the blocks' text: the keys having it}: a script that two pages share runs once."""
    texts: dict[str, list[str]] = {}
    for key, block in blocks_marked(SCRIPT):
        texts.setdefault(block, []).append(key.split(":")[0])
    return {block: "+".join(pages) for block, pages in texts.items()}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("block", list(_scripts()), ids=list(_scripts().values()))
def test_whole_scripts_run_as_written(block, tmp_path):
    """A whole script in a fresh process on this 2-core machine (README.md's API snippet and
    docs/index.md's first script: the same text, run once)."""
    script = tmp_path / "snippet.py"
    script.write_text(block)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=360)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "trainer" in out.stdout, out.stdout[-3000:]  # get_device_placement() printed the group
