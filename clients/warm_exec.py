"""A SuperExec whose ClientApp processes start warm: forked from one that has imported Flower and torch.

Flower's SuperExec starts a new ``flwr-clientapp`` process for every message a SuperNode gets: a
Python interpreter, then Flower's, torch's and the app's imports, before the first byte of the
message is read. On a small device (or many SuperNodes on few cores) that start costs seconds of
CPU per node and round, the same for a dense and a compressed round, so it caps what a smaller
message can save in wall-clock time. This SuperExec runs Flower's own loop
(:func:`flwr.supercore.superexec.run_superexec.run_superexec`) with one change, its executor:
a zygote process imports the modules named by ``--preload`` once, and every ClientApp is a
``fork`` of it that calls Flower's ``run_clientapp`` with the token, as ``flwr-clientapp`` would.
Each ClientApp is still its own process (the app's state, its sys.path and a crash stay in it);
what it skips is the interpreter's start and the preloaded imports.

Run it beside ``flower-supernode --isolation process``, with ``flower-superexec``'s arguments::

    flower-supernode --insecure --superlink HOST:9092 --isolation process --port 9094 ...
    python -m fedcomp.clients.warm_exec --insecure --runtime-api-address 127.0.0.1:9094

One more change, in the ClientApp: Flower's SuperNode hands a task to the SuperExec *before* it
has pulled the message's arrays from the SuperLink, and the ClientApp waits for them with an
exponential backoff (1, 2, 4, 8, then 10 s between tries), so a broadcast that arrives after 5.5 s
is read after 7 or 15 s. A warm ClientApp asks every ``--pull-interval`` seconds (default
:data:`DEFAULT_PULL_S`; ``0``: Flower's backoff); its time limit stays Flower's.

The zygote forks before any gRPC channel exists and runs no torch operation (no thread pool yet),
so each child starts from a single-threaded process. Where ``fork`` is unavailable (not Linux or
macOS) use ``flower-superexec``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence

__all__ = ["DEFAULT_PRELOAD", "DEFAULT_PULL_S", "ForkExecutor", "Zygote", "main", "steady_pulls"]

DEFAULT_PULL_S = 0.1  # seconds between a ClientApp's tries for a message's arrays the SuperNode is still pulling
PULL_ENV = "FEDCOMP_CLIENTAPP_PULL_S"

DEFAULT_PRELOAD = ("flwr.supernode.runtime.run_clientapp", "numpy", "torch", "torch._dynamo", "httpx", "httpcore", "fedcomp.clients.mod")
POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # Flower's SuperExec reads it (default 1 s)
DEFAULT_POLL_S = 0.2  # a ClientApp's task waits for the next poll: up to 1 s a round with Flower's default
CLIENTAPP_COMM = "flwr-clientapp"  # the name the ClientApp's process shows, as Flower's own


class Zygote:
    """A process that imported ``preload`` and forks one child per request it reads; the child runs
    ``target(request)`` (default: Flower's ClientApp with the request as ``run_clientapp``'s keyword
    arguments) and exits with what it returns."""

    def __init__(self, preload: Sequence[str], target: Callable[[dict], int] | None = None) -> None:
        if not hasattr(os, "fork"):
            raise RuntimeError("fedcomp.clients.warm_exec needs os.fork (Linux or macOS); use flower-superexec")
        self.preload = tuple(preload)
        read, self._write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the zygote
            os.close(self._write)
            code = 0
            try:
                _zygote(read, self.preload, target or _clientapp)
            except BaseException:  # noqa: BLE001 - the zygote reports and ends, never returns to the caller
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(read)

    def launch(self, request: dict) -> None:
        """Ask the zygote for one ClientApp (``request``: ``run_clientapp``'s keyword arguments)."""
        os.write(self._write, (json.dumps(request) + "\n").encode())

    def close(self) -> None:
        """End the zygote (ClientApps it started finish on their own)."""
        if self._write >= 0:
            os.close(self._write)  # the zygote reads EOF and exits
            self._write = -1
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass


def _zygote(read: int, preload: Sequence[str], target: Callable[[dict], int]) -> None:
    for name in preload:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished ClientApps
    with os.fdopen(read, "rb") as requests:
        for line in requests:
            request = json.loads(line)
            if os.fork() == 0:
                requests.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                code = 1
                try:
                    code = target(request)
                finally:
                    os._exit(code)


def _clientapp(request: dict) -> int:
    try:
        with open("/proc/self/comm", "w") as comm:  # Linux: show as Flower's ClientApp process
            comm.write(CLIENTAPP_COMM)
    except OSError:
        pass
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    steady_pulls(float(os.environ.get(PULL_ENV, DEFAULT_PULL_S)))
    certificates = None
    if request.get("root_certificates_path"):
        with open(request.pop("root_certificates_path"), "rb") as f:
            certificates = f.read()
    request.pop("root_certificates_path", None)
    try:
        run_clientapp(certificates=certificates, **request)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a ClientApp's failure is its own process's exit code
        import traceback

        traceback.print_exc()
        return 1
    return 0


def steady_pulls(interval: float) -> None:
    """Make this process's ClientApp try for a message's arrays every ``interval`` seconds instead of
    Flower's exponential backoff (``0``: leave Flower's); the overall time limit stays Flower's."""
    if interval < 0:
        raise ValueError(f"pull interval {interval!r} s is invalid: >= 0 (0 keeps Flower's backoff)")
    if interval == 0:
        return
    import functools

    from flwr.supercore.constant import PULL_MAX_TIME
    from flwr.supernode.runtime import run_clientapp as module

    pull = getattr(module.pull_and_inflate_object_from_tree, "__wrapped__", module.pull_and_inflate_object_from_tree)
    steady = functools.partial(pull, initial_backoff=interval, backoff_cap=interval,
                               max_tries_per_object=int(PULL_MAX_TIME / interval) + 1)
    steady.__wrapped__ = pull
    module.pull_and_inflate_object_from_tree = steady


class ForkExecutor:
    """Flower's SuperExec executor protocol: ClientApps from the zygote, anything else as
    Flower's :class:`~flwr.supercore.superexec.executor.subprocess_executor.SubprocessExecutor`."""

    def __init__(self, zygote: Zygote) -> None:
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.zygote = zygote
        self.fallback = SubprocessExecutor()

    def get_eligible_capacity(self, supported_task_types, **kwargs):
        return self.fallback.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, task_type=None, **kwargs) -> None:
        self.fallback.wait_for_capacity(task_type, **kwargs)

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self.fallback.launch(spec)
        self.zygote.launch({
            "runtime_api_address": spec.runtime_api_address, "token": spec.token, "insecure": spec.insecure,
            "root_certificates_path": spec.root_certificates_path, "parent_pid": spec.parent_pid,
            "runtime_dependency_install": spec.runtime_dependency_install,
        })
        return LaunchResult.accepted()

    def close(self) -> None:
        self.zygote.close()

    def reconcile(self) -> None:
        self.fallback.reconcile()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedcomp.clients.warm_exec", description=__doc__.split("\n")[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API (its --port)")
    tls = parser.add_mutually_exclusive_group(required=True)
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API")
    tls.add_argument("--root-certificates", help="PEM root certificates for TLS to the Runtime API")
    parser.add_argument("--parent-pid", type=int, help="exit when this process (the SuperNode) exits")
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD),
                        help="modules the zygote imports once, comma-separated (default: %(default)s)")
    parser.add_argument("--poll-interval", type=float, default=None,
                        help="seconds between the SuperExec's task polls of the SuperNode (a local call; "
                             f"default: ${POLL_ENV}, else {DEFAULT_POLL_S})")
    parser.add_argument("--pull-interval", type=float, default=None,
                        help="seconds between a ClientApp's tries for a message's arrays that the SuperNode "
                             f"is still pulling (0: Flower's 1-10 s backoff; default: ${PULL_ENV}, else {DEFAULT_PULL_S})")
    parser.add_argument("--allow-runtime-dependency-installation", action="store_true",
                        help="as flower-superexec's (off: the app's dependencies must be installed)")
    args = parser.parse_args(argv)
    if args.poll_interval is not None:
        os.environ[POLL_ENV] = str(args.poll_interval)  # Flower's loop checks its range
    else:
        os.environ.setdefault(POLL_ENV, str(DEFAULT_POLL_S))
    if args.pull_interval is not None:
        if args.pull_interval < 0:
            parser.error(f"--pull-interval {args.pull_interval!r} is invalid: >= 0 (0 keeps Flower's backoff)")
        os.environ[PULL_ENV] = str(args.pull_interval)  # read in each ClientApp
    preload = [name.strip() for name in args.preload.split(",") if name.strip()]
    for name in preload:  # fail here, by name, not in every ClientApp
        if importlib.util.find_spec(name.split(".")[0]) is None:
            parser.error(f"--preload module {name!r} is not installed; give modules this Python can import")
    zygote = Zygote(preload)  # before Flower's gRPC: the zygote forks a process without channels
    from flwr.supercore.superexec import run_superexec as superexec

    executor = ForkExecutor(zygote)
    superexec.get_executor = lambda *args, **kwargs: executor  # Flower's loop, this executor
    try:
        superexec.run_superexec(
            runtime_api_address=args.runtime_api_address, insecure=args.insecure,
            root_certificates_path=args.root_certificates, parent_pid=args.parent_pid,
            runtime_dependency_install=args.allow_runtime_dependency_installation,
        )
    finally:
        zygote.close()


if __name__ == "__main__":
    main(sys.argv[1:])
