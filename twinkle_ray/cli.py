"""The ``twinkle-ray`` command: topology pictures, the demo, the benchmarks.

Examples::

    twinkle-ray topology groups.yaml              # the plan for a groups file, no Ray needed
    twinkle-ray topology groups.yaml --ray        # reserve it on Ray: real nodes and devices
    twinkle-ray topology --address 127.0.0.1:6379 # gangs running on a cluster, by name
    twinkle-ray demo --steps 2                    # examples/quickstart.py
    twinkle-ray bench --quick                     # bench/ (in a source checkout)

A groups file is JSON or YAML: a list of DeviceGroup keyword dicts (or
``{"groups": [...]}``), e.g. ``[{"name": "trainer", "ranks": 4}]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .core import defaults
from .core.group import DeviceGroup

DESCRIPTION = "twinkle_ray: Ray-native gangs of workers for multi-group distributed ML (RLHF)."

EPILOG = """\
examples:
  twinkle-ray topology groups.yaml               plan of a groups file (no Ray)
  twinkle-ray topology groups.yaml --ray         reserve it on Ray: nodes and devices per rank
  twinkle-ray topology --address HOST:PORT       gangs running on a cluster (or RAY_ADDRESS)
  twinkle-ray demo                               run examples/quickstart.py (sampler -> trainer)
  twinkle-ray bench --quick                      run the benchmarks in bench/

other ways to run (docs/deploy.md):
  ray job submit --working-dir . -- python examples/quickstart.py
  serve run deploy/serve.yaml
"""


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


# -- helpers -----------------------------------------------------------------------------------
def checkout_root() -> Path | None:
    """The source checkout this package runs from (editable install), or None."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / "pyproject.toml").is_file() and (root / "twinkle_ray").is_dir():
            return root
    return None


def load_groups(path: str | Path) -> list[DeviceGroup]:
    """DeviceGroups from a JSON or YAML file (a list of keyword dicts, or {'groups': [...]}).

    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    >>> _ = f.write('[{"name": "g", "ranks": 2, "device_type": "cpu"}]'); f.close()
    >>> [g.name for g in load_groups(f.name)]
    ['g']
    >>> os.unlink(f.name)
    """
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"groups file {str(p)!r} not found")
    text = p.read_text()
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml  # installed with ray

            data = yaml.safe_load(text)
    except Exception as e:
        raise CLIError(f"{p}: cannot parse: {e}") from None
    if isinstance(data, dict) and "groups" in data:
        data = data["groups"]
    if not isinstance(data, list) or not all(isinstance(g, dict) for g in data):
        raise CLIError(f"{p}: expected a list of DeviceGroup keyword dicts, got {type(data).__name__}")
    groups = []
    for i, kw in enumerate(data):
        try:
            groups.append(DeviceGroup(**kw))
        except (TypeError, ValueError) as e:
            raise CLIError(f"{p}: group {i} ({kw.get('name', '?')}): {e}") from None
    from .core.group import check_groups

    try:
        check_groups(groups)
    except (TypeError, ValueError) as e:
        raise CLIError(f"{p}: {e}") from None
    return groups


def plan_picture(groups: list[DeviceGroup]) -> str:
    """The placement plan of ``groups`` without Ray: workers, bundles and devices per worker."""
    lines = ["twinkle_ray topology (plan; run with --ray to reserve it and see nodes)"]
    for g in groups:
        b = g.bundles()[0]
        bundle = "{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}"
        extra = f", colocated with '{g.colocate_with}'" if g.colocate_with else ""
        lines.append(f"group '{g.name}': {g.num_workers} worker(s), {g.kind}, bundle {bundle}, "
                     f"{g.strategy}{extra}")
        for i in range(g.num_workers):
            if g.is_cpu:
                where = "cpu"
            else:
                node = g.node_of_worker(i)
                where = f"{g.resource_name} {g.worker_local_devices(i)}" + (
                    f" on node {node}" if node is not None else "") + (
                    " (as named)" if g.pins_devices else " (logical: Ray picks the devices)")
            lines.append(f"  worker {i:<3} {where}")
    return "\n".join(lines)


def _needs(groups: list[DeviceGroup]) -> dict[str, float]:
    total: dict[str, float] = {}
    for g in groups:
        if g.colocate_with:
            continue
        for b in g.bundles():
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
    return total


def running_gangs(namespace: str | None = None) -> list[dict]:
    """Describe every gang (dispatcher actor) alive on the connected cluster.

    Dispatchers are named ``'group/Class'`` in their runtime's namespace;
    workers are ``'group/Class/rank'``.
    """
    import ray

    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = entry["name"], entry["namespace"]
        if name.count("/") != 1 or (namespace and ns != namespace):
            continue
        try:
            desc = ray.get(ray.get_actor(name, namespace=ns).describe.remote(), timeout=10)
        except Exception:  # not a dispatcher, or gone meanwhile
            continue
        found.append({"namespace": ns, **desc})
    return sorted(found, key=lambda d: (d["namespace"], d["label"]))


def gangs_picture(gangs: list[dict], address: str) -> str:
    lines = [f"twinkle_ray gangs on {address}: {len(gangs)}"]
    for d in gangs:
        state = f"DEAD: {d['dead']}" if d.get("dead") else "healthy"
        lines.append(
            f"gang '{d['label']}' (namespace {d['namespace']}): {len(d['ranks'])} worker(s), "
            f"backend {d.get('backend')}, generation {d.get('generation')}, {state}"
        )
        for r in d["ranks"]:
            lines.append(f"  rank {r['rank']:<3} node {r['node_ip']} ({r['node_id'][:8]})  "
                         f"devices {r['devices']}  bundle {r['bundle']}")
    return "\n".join(lines)


def _host(address: str) -> str:
    """The host part of a Ray address (``HOST:PORT``, ``ray://HOST:PORT``, ``http://HOST:PORT``).

    >>> _host("127.0.0.1:6379"), _host("ray://localhost:10001"), _host("http://[::1]:8265")
    ('127.0.0.1', 'localhost', '::1')
    """
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def _loopback_ray(address: str) -> None:
    """Attach to a cluster on loopback without an environment variable from the user.

    Ray on Linux takes the machine's external address as this driver's node address, so a
    driver attaching to a head started with ``--node-ip-address=127.0.0.1`` waits for a raylet
    on an address no raylet of that cluster has, and hangs. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    (read when ``ray`` is imported) makes Ray use 127.0.0.1, as ``initialize()`` does for its
    embedded Ray; set here before the import, when the address is a loopback one.
    """
    from .runtime.connect import LOOPBACK_ENV
    from .runtime.net import is_loopback

    host = _host(address)
    if not is_loopback(host) or LOOPBACK_ENV in os.environ:
        return
    if "ray" in sys.modules:  # too late: Ray fixed its node address at import
        logging.getLogger(__name__).warning(
            "twinkle-ray: ray was imported before attaching to %s; set %s=0 if this hangs",
            address, LOOPBACK_ENV)
        return
    os.environ[LOOPBACK_ENV] = "0"


# -- commands ----------------------------------------------------------------------------------
def cmd_topology(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("RAY_ADDRESS")
    if args.groups is None:
        if not address:
            raise CLIError("topology: give a groups file, or --address (or RAY_ADDRESS) to list "
                           "the gangs running on a cluster")
        _loopback_ray(address)
        import ray

        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        try:
            print(gangs_picture(running_gangs(args.namespace), address))
        finally:
            ray.shutdown()
        return 0
    groups = load_groups(args.groups)
    if not (args.ray or args.address):
        print(plan_picture(groups))
        return 0
    if address:
        _loopback_ray(address)
    import twinkle_ray

    need = _needs(groups)
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING,
                              "log_to_driver": False}
    if not address:  # an embedded Ray declaring (virtual) resources for the groups
        kwargs["num_gpus"] = args.num_gpus if args.num_gpus is not None else int(need.get("GPU", 0))
        kwargs["num_cpus"] = args.num_cpus if args.num_cpus is not None else int(need.get("CPU", 0)) + 1
    try:
        twinkle_ray.initialize("ray", groups, address=args.address, namespace=args.namespace,
                               placement_timeout_s=args.timeout, **kwargs)
        print(twinkle_ray.get_device_placement())
    except twinkle_ray.PlacementError as e:
        raise CLIError(f"topology: {e}") from None
    finally:
        twinkle_ray.shutdown()
    return 0


def _load_example(name: str) -> Any:
    root = checkout_root()
    path = root / "examples" / f"{name}.py" if root else None
    if path is None or not path.is_file():
        raise CLIError(
            f"examples/{name}.py not found: `twinkle-ray demo` runs the quick start of a source "
            f"checkout (git clone, then `pip install -e .`)"
        )
    # Not registered in sys.modules: Ray pickles its classes by value, so workers need no copy.
    spec = importlib.util.spec_from_file_location(f"twinkle_ray_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cmd_demo(args: argparse.Namespace) -> int:
    quickstart = _load_example("quickstart")
    argv0 = sys.argv[0] if sys.argv else None
    sys.argv[:1] = ["twinkle-ray demo"]  # its argparse names this command in usage and errors
    try:
        quickstart.main(args.rest)
    finally:
        if argv0 is not None:
            sys.argv[0] = argv0
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    root = checkout_root()
    bench = root / "bench" if root else None
    if bench is not None and (bench / "__main__.py").is_file():
        cmd = [sys.executable, "-m", "bench", *args.rest]
    elif bench is not None and (bench / "run.py").is_file():
        cmd = [sys.executable, str(bench / "run.py"), *args.rest]
    else:
        raise CLIError("bench/ not found: `twinkle-ray bench` runs the benchmarks of a source "
                       "checkout (git clone, then `pip install -e .`)")
    return subprocess.call(cmd, cwd=root)


# -- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="twinkle-ray", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"twinkle-ray {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    topo = sub.add_parser(
        "topology", help="print the placement picture of a groups file or a running cluster",
        description="Print where every rank runs.\n\n"
                    "  topology FILE            the plan of the groups in FILE (no Ray)\n"
                    "  topology FILE --ray      reserve them on an embedded Ray (virtual devices)\n"
                    "                           or on --address: nodes and devices per rank;\n"
                    "                           then release them\n"
                    "  topology --address ADDR  the gangs running on a cluster, by name",
        epilog="groups file (JSON or YAML): a list of DeviceGroup keyword dicts, e.g.\n"
               '  [{"name": "sampler", "ranks": 4}, {"name": "trainer", "ranks": [4, 5, 6, 7]}]',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    topo.add_argument("groups", nargs="?", help="JSON/YAML file listing DeviceGroups")
    topo.add_argument("--ray", action="store_true", help="reserve the groups on Ray and show the real placement")
    topo.add_argument("--address", help="Ray cluster to attach to (default: RAY_ADDRESS)")
    topo.add_argument("--namespace", help="only gangs in this Ray namespace (listing), or the "
                                          "namespace to reserve in")
    topo.add_argument("--num-gpus", type=int, help="virtual GPUs of an embedded Ray (default: what the groups need)")
    topo.add_argument("--num-cpus", type=int, help="virtual CPUs of an embedded Ray (default: what the groups need + 1)")
    topo.add_argument("--timeout", type=float, default=defaults.PLACEMENT_TIMEOUT_S,
                      help=f"placement timeout in seconds (default {defaults.PLACEMENT_TIMEOUT_S:g})")
    topo.set_defaults(func=cmd_topology)

    # demo and bench pass every argument through (--help included: the script's own help)
    demo = sub.add_parser(
        "demo", add_help=False,
        help="run the quick start: loader -> sampler group -> trainer group "
             "(examples/quickstart.py; e.g. demo --steps 5; demo --help)",
    )
    demo.set_defaults(func=cmd_demo, passthrough=True)
    bench = sub.add_parser(
        "bench", add_help=False,
        help="run the benchmarks in bench/, twinkle_ray vs raw Ray "
             "(python -m bench; e.g. bench --quick; bench --help)",
    )
    bench.set_defaults(func=cmd_bench, passthrough=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``twinkle-ray`` console script; returns the exit status."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except CLIError as e:
        print(f"twinkle-ray: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
