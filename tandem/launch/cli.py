"""The ``tandem`` command: ``tandem run [options] script.py [script args]``.

``tandem run`` takes torchrun's options, in both spellings (``--nproc-per-node``
and ``--nproc_per_node``), and runs the job on torch's elastic agent. What it adds
is described in docs/how-to/launch-one-node.md and docs/reference/run-options.md. This module is the
command line only: flags to a :class:`~tandem.launch.config.LaunchConfig`
(:func:`config_from_args`, pure), what each worker runs (:func:`worker_command`:
``python -u script.py args``, ``python -u -m module args``, or a program of its
own with ``--no-python``, as torchrun builds it; :func:`check_target` looks at the
file system, so that a misspelt script or module fails in the launcher with one
clear line, before any worker starts), then the agent (:func:`run_job`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tandem.launch.agent import LaunchError, SignalException, quiet_torch_launch_logs, run_workers
from tandem.launch.config import (
    DEFAULT_RDZV_TIMEOUT_S,
    LaunchConfig,
    parse_nnodes,
    parse_rank_list,
    parse_rdzv_conf,
    resolve_nproc,
    resolve_rendezvous,
    split_endpoint,
    threads_per_worker,
)
from tandem.launch.logs import WorkerLogs
from tandem.launch.machine import (
    loopback_interface_env,
    node_address,
    socket_interface_env,
    usable_cpus,
    visible_gpus,
)
from tandem.launch.output import RankOutput, is_terminal
from tandem.launch.summary import failure_summary
from tandem.launch.watchdog import HANG_EXITCODE
from tandem.store.job_secret import secret_for_workers

__all__ = ["TargetKind", "WorkerCommand", "build_parser", "check_target", "command", "config_from_args", "main",
           "run_job", "worker_command"]

_PROG = "tandem run"
EXIT_FAILED = 1
"""A worker failed (after any restarts), or the job could not start."""
EXIT_USAGE = 2
"""The command line was wrong (argparse's convention)."""


class TargetKind(enum.Enum):
    SCRIPT = "script"   # a Python file: python -u script.py
    MODULE = "module"   # python -u -m package.module
    PROGRAM = "program"  # --no-python: any executable


@dataclass(frozen=True, kw_only=True)
class WorkerCommand:
    """The command line every worker of this node runs."""

    program: str
    """The executable: the Python interpreter, or the target itself with ``--no-python``."""
    args: tuple[str, ...]
    """Its arguments, the target's own arguments last."""
    target: str
    """The script, module or program as the user named it (for messages)."""
    kind: TargetKind
    """Which of the three forms this is."""


def worker_command(target: str, target_args: Sequence[str], *, module: bool = False,
                   no_python: bool = False, python: str) -> WorkerCommand:
    """Build the workers' command line.

    Args:
        target: the script, module (with ``module``) or program (with ``no_python``).
        target_args: the target's own arguments.
        module: run ``target`` as ``python -m target``.
        no_python: run ``target`` itself, not through Python.
        python: the interpreter (the launcher's own, or ``PYTHON_EXEC`` as torchrun).

    Raises:
        ValueError: both ``module`` and ``no_python``, or no target.
    """
    if not target:
        raise ValueError("no script given; pass the training script (or -m module) and its "
                         "arguments after the launcher's options")
    if module and no_python:
        raise ValueError("-m/--module and --no-python cannot be used together: a module is "
                         "run by Python")
    rest = tuple(str(a) for a in target_args)
    if no_python:
        return WorkerCommand(program=target, args=rest, target=target, kind=TargetKind.PROGRAM)
    # -u: unbuffered, so every line reaches the log (and the console) when printed.
    head = ("-u", "-m", target) if module else ("-u", target)
    return WorkerCommand(program=python, args=head + rest, target=target,
                         kind=TargetKind.MODULE if module else TargetKind.SCRIPT)


def check_target(command: WorkerCommand, *, cwd: str) -> None:
    """Fail early, in the launcher, if the workers could not start the target.

    Modules are looked up the way ``python -m`` in ``cwd`` would, without
    importing anything.

    Raises:
        ValueError: the script, module or program does not exist.
    """
    if command.kind is TargetKind.SCRIPT:
        path = os.path.join(cwd, command.target)
        if not os.path.isfile(path):
            raise ValueError(f"script {command.target!r} not found (looked in {cwd}); check the "
                             "path, or pass -m for a module")
    elif command.kind is TargetKind.MODULE:
        if not _module_exists(command.target, cwd):
            raise ValueError(f"module {command.target!r} not found (from {cwd} and the "
                             "interpreter's path); check the name and that its package is "
                             "installed")
    else:
        found = (shutil.which(command.target) if os.sep not in command.target
                 else command.target if os.access(os.path.join(cwd, command.target), os.X_OK)
                 else None)
        if not found:
            raise ValueError(f"program {command.target!r} not found or not executable "
                             "(--no-python runs it directly)")


def _module_exists(name: str, cwd: str) -> bool:
    # Nothing is imported: the top-level package is found as ``python -m`` in ``cwd``
    # would (cwd first, then the interpreter's finders, editable installs included),
    # its submodules by path, so no package __init__ runs in the launcher.
    top, *rest = name.split(".")
    if not top or not all(rest):
        return False
    spec = importlib.machinery.PathFinder.find_spec(top, [cwd])
    if spec is None:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return False
    for part in rest:
        search = spec.submodule_search_locations if spec is not None else None
        if search is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(search))
    return spec is not None


class _Parser(argparse.ArgumentParser):
    """argparse, plus "did you mean" for a misspelt option."""

    options: list[str]
    """The long options, for the hints (filled by :func:`build_parser`)."""
    run: argparse.ArgumentParser | None = None
    """On the top parser: the ``run`` sub-command's parser."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = []

    def error(self, message: str):  # type: ignore[override]
        words = [w for w in message.replace(",", " ").split() if w.startswith("--")]
        hints = [m[0] for w in words
                 for m in [difflib.get_close_matches(w.split("=")[0], self.options, n=1,
                                                     cutoff=0.75)] if m]
        hint = f" (did you mean {' / '.join(hints)}?)" if hints else ""
        super().error(f"{message}{hint}")


def build_parser() -> _Parser:
    """The ``tandem`` parser with its ``run`` sub-command (``.run``)."""
    top = _Parser(prog="tandem", description="tandem: data-parallel training for PyTorch.")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # No abbreviations: a script's own flag that begins like one of ours (``--h``)
    # must reach the script, not match ``--hang-timeout``.
    p: _Parser = sub.add_parser(
        "run", allow_abbrev=False, help="start a job on this node (torchrun's options)",
        description="Start the workers of a distributed job on this node, on torch's elastic "
                    "agent. Takes torchrun's options; each worker's output lines carry its rank.")
    top.run = p
    sub.add_parser("plan", help="before launching: buckets, memory per rank for DDP, ZeRO-1/2 and "
                                "fully_shard, what fits (tandem plan --help)", add_help=False)
    sub.add_parser("check", help="does N ranks train the same model as one process? "
                                 "(tandem check --help)", add_help=False)
    sub.add_parser("report", help="after a run: one HTML page of its losses, stragglers, step phases, "
                                  "collectives and world changes (tandem report --help)", add_help=False)

    def opt(group: argparse._ArgumentGroup, *names: str, **kw) -> None:
        # torchrun accepts --foo-bar and --foo_bar; so does tandem run.
        spelled = list(names)
        for n in names:
            if n.startswith("--") and "-" in n[2:]:
                spelled.append("--" + n[2:].replace("-", "_"))
        p.options += [n for n in spelled if n.startswith("--")]
        group.add_argument(*spelled, **kw)

    g = p.add_argument_group("workers and nodes")
    opt(g, "--nproc-per-node", default="1", metavar="N|auto|cpu|gpu",
        help="workers on this node (default 1). auto: one per GPU, or without GPUs one per "
             "CPU core up to 8; cpu: one per core; gpu: one per GPU")
    opt(g, "--nnodes", default="1", metavar="N|MIN:MAX", help="number of nodes (default 1)")
    opt(g, "--node-rank", type=int, default=None, metavar="R",
        help="this node's rank, 0..nnodes-1, with --master-addr/--master-port")
    opt(g, "--master-addr", default=None, metavar="HOST",
        help="node 0's address for the static rendezvous (default 127.0.0.1)")
    opt(g, "--master-port", type=int, default=None, metavar="PORT",
        help="node 0's port for the static rendezvous; without it a one-node job picks a "
             "free port")
    g = p.add_argument_group("rendezvous")
    opt(g, "--standalone", action="store_true",
        help="a one-node job with its rendezvous on a free local port")
    opt(g, "--rdzv-backend", default=None, metavar="NAME",
        help="c10d (the default with --rdzv-endpoint), static, or etcd (every store on an etcd cluster "
             "that the nodes named in --rdzv-endpoint A:P,B:P,C:P run: no node's loss ends the job)")
    opt(g, "--rdzv-endpoint", default=None, metavar="HOST:PORT",
        help="where the nodes meet; the same on every node, node ranks are assigned on arrival")
    opt(g, "--rdzv-id", default=None, metavar="ID", help="job id, the same on every node")
    opt(g, "--rdzv-conf", default="", metavar="K=V,...",
        help="more rendezvous settings, e.g. join_timeout=900")
    opt(g, "--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT_S, metavar="SECONDS",
        help=f"fail if the nodes have not met within this (default {DEFAULT_RDZV_TIMEOUT_S:g})")
    opt(g, "--local-addr", default=None, metavar="HOST",
        help="this node's address as the others should see it")
    opt(g, "--open-stores", action="store_true",
        help="with several nodes, leave the job's stores open to the network as torchrun's are, "
             "instead of behind TLS keyed by the job secret (which needs stunnel on every node)")
    g = p.add_argument_group("failures")
    opt(g, "--max-restarts", type=int, default=0, metavar="K",
        help="restart the whole group up to K times after a worker fails (default 0); with "
             "--elastic, start up to K replacement workers instead")
    opt(g, "--elastic", action="store_true",
        help="keep going when a worker dies: a script training with tandem.Trainer or its own "
             "loop over tandem.prepare(...) drops the step in flight and goes on with the "
             "survivors, and replacements (--max-restarts) "
             "join at a step boundary with the state of a live worker (TANDEM_ELASTIC=1)")
    opt(g, "--no-spare", action="store_true",
        help="with --elastic, start each replacement when a worker dies, not ahead as a spare "
             "that has imported torch and waits")
    opt(g, "--monitor-interval", type=float, default=0.1, metavar="SECONDS",
        help="how often the agent checks the workers (default 0.1)")
    opt(g, "--hang-timeout", type=float, default=None, metavar="SECONDS",
        help="when no worker completes a collective or starts a step for this long, report "
             "where each rank is, stop the workers and count a failure (restarted with "
             "--max-restarts); default: no watchdog")
    opt(g, "--debug-collectives", action="store_true",
        help="the workers compare every collective (op, shape, dtype) before issuing it, and "
             "raise on every rank at a mismatch (TANDEM_DEBUG=collectives); slow")
    g = p.add_argument_group("output")
    opt(g, "--ranks", default=None, metavar="LIST",
        help="show only these global ranks' output, e.g. 0 or 0,2-3 (the logs keep all)")
    opt(g, "--local-ranks-filter", default=None, metavar="LIST",
        help="show only these local ranks' output (torchrun's spelling)")
    opt(g, "--log-dir", default=None, metavar="DIR",
        help="keep the workers' logs here (default: a temporary directory, removed when the "
             "job succeeds)")
    opt(g, "-v", "--verbose", action="store_true", help="also show the elastic agent's own log")
    g = p.add_argument_group("what to run")
    opt(g, "-m", "--module", action="store_true", help="run the target as python -m module")
    opt(g, "--no-python", action="store_true",
        help="run the target directly, not through python")
    opt(g, "--role", default="default", help="the workers' role name (ROLE_NAME)")
    opt(g, "--start-method", default="spawn", choices=["spawn", "fork", "forkserver"],
        help="accepted for torchrun compatibility; scripts always start as new processes")
    p.add_argument("script", help="the training script (or module with -m, program with "
                                  "--no-python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return top


def config_from_args(args: argparse.Namespace, *, cpus: int, gpus: int,
                     environ: Mapping[str, str]) -> LaunchConfig:
    """The job described by ``tandem run``'s flags, on a machine with ``cpus`` cores
    and ``gpus`` GPUs, launched from ``environ``. Pure.

    Raises:
        ValueError: a flag is invalid or contradicts another; the message names it.
    """
    choice = resolve_nproc(args.nproc_per_node, cpus=cpus, gpus=gpus)
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    rdzv = resolve_rendezvous(
        standalone=args.standalone, max_nodes=max_nodes, rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, master_addr=args.master_addr,
        master_port=args.master_port)
    if args.node_rank is not None and rdzv.backend != "static" and args.node_rank != 0:
        raise ValueError(f"--node-rank {args.node_rank} is only used with --master-addr/"
                         f"--master-port (the static rendezvous); with the {rdzv.reason} node "
                         "ranks are assigned as nodes arrive, so leave --node-rank out")
    return LaunchConfig(
        nproc_per_node=choice.nproc, min_nodes=min_nodes, max_nodes=max_nodes,
        node_rank=args.node_rank or 0, rdzv_backend=rdzv.backend, rdzv_endpoint=rdzv.endpoint,
        rdzv_id=rdzv.run_id, rdzv_timeout_s=args.rdzv_timeout,
        rdzv_options=parse_rdzv_conf(args.rdzv_conf), max_restarts=args.max_restarts,
        monitor_interval_s=args.monitor_interval, hang_timeout_s=args.hang_timeout,
        elastic=args.elastic, spare=not args.no_spare, open_stores=args.open_stores,
        debug_collectives=args.debug_collectives,
        omp_num_threads=threads_per_worker(choice.nproc, cpus=cpus, environ=environ),
        output_ranks=None if args.ranks is None else parse_rank_list(args.ranks, flag="--ranks"),
        output_local_ranks=(None if args.local_ranks_filter is None else
                            parse_rank_list(args.local_ranks_filter, flag="--local-ranks-filter")),
        log_dir=args.log_dir, local_addr=args.local_addr, role=args.role,
        start_method=args.start_method, nproc_reason=choice.reason, rdzv_reason=rdzv.reason)


def run_job(config: LaunchConfig, command: WorkerCommand, *, stdout: TextIO | None = None,
            stderr: TextIO | None = None) -> int:
    """Run the job and return the launcher's exit status: 0 when every worker
    succeeded, :data:`EXIT_FAILED` after a failure (with a summary on
    ``stderr``), 128+N after signal N. Output goes to ``stdout``/``stderr``
    (default: the process's own)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    owned_logs = config.log_dir is None
    log_root = config.log_dir or tempfile.mkdtemp(prefix="tandem-run-")
    output = RankOutput(stdout, stderr, ranks=config.output_ranks,
                        local_ranks=config.output_local_ranks)
    worker_env = dict(config.worker_env)
    # Note [signed store] in tandem/store/job_secret.py: in the environment, never on a command line
    worker_env.update(secret_for_workers(config.max_nodes))
    if config.max_nodes > 1:  # Note [the address a node gives] in machine.py
        rendezvous = split_endpoint(config.first_endpoint, "--rdzv-endpoint")
        worker_env.update(socket_interface_env(config.local_addr, rendezvous))
    else:  # Note [a store on the job's address] in tandem/store/listening_store.py
        worker_env.update(loopback_interface_env())
    if is_terminal(stdout):  # Note [carriage returns] in output.py
        worker_env["TANDEM_STDOUT_ISATTY"] = "1"
    logs = WorkerLogs(log_root, worker_env=worker_env, on_attempt=output.follow,
                      progress=config.hang_timeout_s is not None or config.elastic,  # Note [a crash after finishing]
                      on_replacement=output.follow_replacement)
    hangs: dict[int, str] = {}

    def on_hang(report: str) -> None:
        number = logs.attempts[-1].number
        path = Path(log_root) / f"hang-report-attempt_{number}.txt"
        path.write_text(report + "\n")
        hangs[number] = f"{report}\n  (saved in {path})"
        if config.elastic:  # Note [a hung rank under --elastic] in elastic_agent.py
            _say(stderr, f"the job hung:\n{hangs[number]}")
        elif number < config.max_restarts:  # else the failure summary shows it, once
            _say(stderr, f"attempt {number} hung; stopping it and restarting the group:\n"
                         f"{hangs[number]}")

    start = time.monotonic()
    output.start()
    try:
        result = run_workers(config, command.program, command.args, logs, on_hang=on_hang,
                             on_event=lambda line: _say(stderr, line))
    except LaunchError as e:
        output.stop()
        _say(stderr, f"error: {e}")
        if owned_logs:
            shutil.rmtree(log_root, ignore_errors=True)
        return EXIT_FAILED
    except SignalException as e:
        output.stop()
        _say(stderr, f"got {e.sigval.name}: the workers were sent it and have exited "
                     f"(logs: {log_root})")
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        output.stop()
        _say(stderr, "interrupted before the workers started")
        return 130
    finally:
        output.stop()
    elapsed = time.monotonic() - start
    if result.is_failed():
        last = logs.attempts[-1].number if logs.attempts else -1
        hung = {int(getattr(f, "exitcode", 0)) for f in result.failures.values()} == {HANG_EXITCODE}
        if last in hangs and (hung or not config.elastic):
            gave_up = (f"\n  gave up after {len(logs.attempts)} attempt(s) (--max-restarts "
                       f"{config.max_restarts})" if config.max_restarts else "")
            _say(stderr, f"the job hung after {elapsed:.1f} s: {hangs[last]}{gave_up}\n"
                         f"  all logs: {log_root}")
            return EXIT_FAILED
        summary = failure_summary(result.failures, logs.attempts, host=socket.gethostname(),
                                  max_restarts=config.max_restarts, log_root=log_root)
        _say(stderr, f"the job failed after {elapsed:.1f} s: {summary}")
        return EXIT_FAILED
    attempts = len(logs.attempts)
    again = f" after {attempts - 1} restart(s)" if attempts > 1 else ""
    _say(stderr, _finished(config, result.return_values, f"in {elapsed:.1f} s{again}"))
    if owned_logs:
        shutil.rmtree(log_root, ignore_errors=True)
    return 0


def _finished(config: LaunchConfig, return_values: Mapping[int, object], when: str) -> str:
    """The launcher's last line: how many workers finished; under --elastic, the
    ones lost on the way and not replaced are not counted (the elastic agent
    returns only those that finished)."""
    if not config.elastic or len(return_values) >= config.nproc_per_node:
        return f"{config.nproc_per_node} worker(s) on this node finished {when}"
    lost = config.nproc_per_node - len(return_values)
    return (f"{len(return_values)} of {config.nproc_per_node} worker(s) on this node finished {when}; "
            f"{lost} lost on the way and not replaced")


# The other sub-commands live with their tools; each module has main(argv) -> int.
TOOLS = {"plan": "tandem.tools.plan", "check": "tandem.tools.check", "report": "tandem.tools.report"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tandem`` console script and of ``python -m tandem``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        tool = importlib.import_module(TOOLS[argv[0]])
        return int(tool.main(argv[1:]))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command != "run":
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if unknown:
        # Report it as `tandem run`'s error, with its usage and a spelling hint.
        assert parser.run is not None
        parser.run.error(f"unrecognized arguments: {' '.join(unknown)}")
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    try:
        config = config_from_args(args, cpus=usable_cpus(), gpus=_visible_gpus(args),
                                  environ=os.environ)
        command = worker_command(args.script, args.script_args, module=args.module,
                                 no_python=args.no_python, python=python)
        # Another interpreter (PYTHON_EXEC) has its own path: let it find the module itself.
        if not (command.kind is TargetKind.MODULE and python != sys.executable):
            check_target(command, cwd=os.getcwd())
        if config.max_nodes > 1:  # several nodes must share one secret: refused before anything starts
            secret_for_workers(config.max_nodes)
            # Note [the address a node gives] in machine.py: known before the rendezvous, never a loopback name
            rendezvous = split_endpoint(config.first_endpoint, "--rdzv-endpoint")
            config = dataclasses.replace(config, local_addr=node_address(config.local_addr, rendezvous))
    except ValueError as e:
        _say(sys.stderr, f"error: {e}")
        return EXIT_USAGE
    _say(sys.stderr, config.describe())
    if args.verbose:
        return run_job(config, command)
    with quiet_torch_launch_logs():
        return run_job(config, command)


# Note [ending the launcher]
# When a job ends, threads that talk to a store may still be in a call: torch's
# rendezvous keep-alive (left running on purpose when this node leaves the
# rendezvous open, as a node cut off from its job does), and on a link that is cut,
# a call of tandem's own pollers that outlived their bounded join. If such a call
# returns, with an error, while the interpreter finalizes, CPython 3.11 ends the
# thread with pthread_exit inside torch's C++ frames, and the launcher dies with
# "terminate called without an active exception" (SIGABRT, exit -6: seen in 1
# run of about 30 of tests/launch/test_cluster_faults.py's lost store host, a failure
# reported as a crash). Nothing is left to do once `main` has returned (the
# workers are reaped, the summary written, the logs removed or kept), so the
# command flushes its streams and logs and ends the process at once, without
# finalizing; `main` itself returns, for callers in a Python process of their own.


def command() -> None:
    """The ``tandem`` console script and ``python -m tandem``: :func:`main`, then
    the process ends at once with its status (Note [ending the launcher])."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    logging.shutdown()
    os._exit(code)


def _say(stream: TextIO, text: str) -> None:
    stream.write(f"{_PROG}: {text}\n")
    stream.flush()


def _visible_gpus(args: argparse.Namespace) -> int:
    # Only "auto" and "gpu" look at GPUs: a plain number never touches CUDA.
    if str(args.nproc_per_node).strip() not in ("auto", "gpu"):
        return 0
    return visible_gpus()
