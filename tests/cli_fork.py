"""Many `python -m ladder.cli ARGV` processes (or `python -m MODULE ARGV` for another module with a
`main()`) from one interpreter that imports the module once.

    python tests/cli_fork.py REQUEST.json RESULTS.json

REQUEST holds {"module": name (default ladder.cli), "preload": [modules], "parallel": n,
"timeout": s, "cases": [{"argv": [...], "cwd": dir, "env": {...}}]}. The driver imports the module
and the preload modules (what the commands import lazily), then forks one child per case, at most
`parallel` at a time. A child is the process `python -m MODULE ARGV` would be, less the start-up: it
changes to its cwd (also sys.path[0], as -m puts it there), takes its environment, writes fds 1 and
2 to files, and runs the module's main with sys.argv and __main__ as -m sets them (so click names
the program `python -m ladder.cli`); main's return value (an int) or SystemExit is the exit code, an
exception that escapes is printed as the interpreter prints it (exit 1), and the exit handlers run
before the child exits. Whatever the imports printed to stderr comes
first in every child's stderr, as it would in a process of its own. A child still running after
`timeout` seconds is killed (exit -9). RESULTS gets [{"rc", "stdout", "stderr"}] in case order.
Each import of torch, JAX and the analysis modules costs a CLI process about 0.5-3 s of CPU;
forked, a case costs tens of milliseconds.

    python tests/cli_fork.py --serve '{"module": ..., "preload": [...]}'

keeps one such interpreter up for a test process (`ladder()` below): a JSON case a line on stdin,
one forked child at a time, a JSON result a line on stdout; it exits when its stdin closes. Each
case is a fork of the same untouched interpreter, so nothing one command does reaches the next.
A child's stdin is /dev/null, its environment exactly the case's, and a child still running at
the case's timeout is killed with its process group (rc -9).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ladder_many(cases: list[tuple[list, Path]], env: dict | None = None, preload: tuple[str, ...] = (),
                parallel: int = 3, timeout: float = 600, module: str = "ladder.cli") -> list[subprocess.CompletedProcess]:
    """Runs each (argv, cwd) as `python -m MODULE *argv` in cwd, forked from one driver process
    whose environment is os.environ with PYTHONPATH at the repo and `env`; one CompletedProcess a case."""
    with tempfile.TemporaryDirectory(prefix="cli_fork") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "results.json"
        req.write_text(json.dumps({"module": module, "preload": list(preload), "parallel": parallel, "timeout": timeout,
                                   "cases": [{"argv": list(map(str, a)), "cwd": str(c)} for a, c in cases]}))
        driver = subprocess.run([sys.executable, str(Path(__file__)), str(req), str(res)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                capture_output=True, text=True, timeout=timeout * max(1, len(cases)) + 120)
        assert driver.returncode == 0 and res.exists(), driver.stderr[-4000:]
        got = json.loads(res.read_text())
    return [subprocess.CompletedProcess([sys.executable, "-m", module, *map(str, a)], r["rc"], r["stdout"],
                                        r["stderr"]) for (a, _), r in zip(cases, got)]


def _child(module: str, case: dict, out: str, err: str, preamble: bytes) -> None:
    """In the forked child: become `python -m MODULE ARGV` and exit with its code."""
    import atexit
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
        os.chdir(case["cwd"])
        sys.path[0] = os.getcwd()
        if case.get("env_exact"):
            os.environ.clear()
        os.environ.update(case.get("env") or {})
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        os.write(2, preamble)
        main_mod = sys.modules["__main__"]
        main_mod.__package__ = module.rpartition(".")[0]
        sys.argv = [str(ROOT / (module.replace(".", "/") + ".py")), *case["argv"]]
        main = importlib.import_module(module).main

        try:
            rc = main()
            code = rc if isinstance(rc, int) else 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _preload(request: dict) -> bytes:
    """Imports the module and the preload modules; what they printed to stderr."""
    import threading

    r, w = os.pipe()  # what the imports print to stderr, kept for every child's stderr
    saved = os.dup(2)
    os.dup2(w, 2)
    os.close(w)
    try:
        for name in [request.get("module", "ladder.cli"), *request.get("preload", [])]:
            importlib.import_module(name)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
    preamble = b""
    os.set_blocking(r, False)
    try:
        while chunk := os.read(r, 65536):
            preamble += chunk
    except BlockingIOError:
        pass
    os.close(r)
    # forking is safe only from a process with one thread (no lock held elsewhere at the fork)
    assert threading.active_count() == 1, [t.name for t in threading.enumerate()]
    return preamble


def serve(request: dict) -> list[dict]:
    preamble = _preload(request)
    cases, parallel, timeout = request["cases"], int(request.get("parallel", 3)), float(request.get("timeout", 600))
    tmp = Path(tempfile.mkdtemp(prefix="cli_fork_out"))
    results: list[dict | None] = [None] * len(cases)
    running: dict[int, tuple[int, float]] = {}
    todo = list(range(len(cases)))
    while todo or running:
        while todo and len(running) < parallel:
            i = todo.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request.get("module", "ladder.cli"), cases[i], str(tmp / f"{i}.out"), str(tmp / f"{i}.err"),
                       preamble)
            running[pid] = (i, time.monotonic() + timeout)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for p, (i, deadline) in list(running.items()):
                if now > deadline:
                    os.kill(p, 9)
            time.sleep(0.005)
            continue
        i, _ = running.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
        results[i] = {"rc": rc, "stdout": read(tmp / f"{i}.out"), "stderr": read(tmp / f"{i}.err")}
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def serve_forever(request: dict) -> None:
    """--serve: a case a line on stdin, run to its end, its result a line on stdout."""
    module = request.get("module", "ladder.cli")
    preamble = _preload(request)
    proto_in, proto_out = sys.stdin, os.fdopen(os.dup(1), "w")
    tmp = Path(tempfile.mkdtemp(prefix="cli_fork_out"))
    proto_out.write("ready\n")
    proto_out.flush()
    try:
        for line in proto_in:
            case = json.loads(line)
            out, err = tmp / "out", tmp / "err"
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(module, case, str(out), str(err), preamble)
            deadline = time.monotonic() + float(case.get("timeout", 600))
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    os.killpg(pid, 9)
                time.sleep(0.005)
            proto_out.write(json.dumps({"rc": os.waitstatus_to_exitcode(done[1]),
                                        "stdout": out.read_text(errors="replace") if out.exists() else "",
                                        "stderr": err.read_text(errors="replace") if err.exists() else ""}) + "\n")
            proto_out.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Server:
    """One --serve interpreter of this test process (started on first use, ended with the process)."""

    def __init__(self, module: str, preload: tuple[str, ...]):
        import threading

        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--serve",
                                      json.dumps({"module": module, "preload": list(preload)})],
                                     cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        ready = self.proc.stdout.readline()
        assert ready == "ready\n", f"the fork server did not start ({ready!r}, exit {self.proc.poll()})"

    def run(self, case: dict) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        assert line, f"the fork server exited {self.proc.wait()}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


_SERVERS: dict[tuple, _Server] = {}
# what the commands import lazily: imported once by the server
PRELOAD = ("analysis.forecast", "analysis.report", "ladder.controller", "ladder.tracking", "engines.torch.engine")


def ladder(*args, cwd: Path = ROOT, env: dict | None = None, timeout: float = 600, module: str = "ladder.cli",
           preload: tuple[str, ...] = PRELOAD) -> subprocess.CompletedProcess:
    """`python -m MODULE *args` in cwd with exactly the environment `env` (default os.environ), as
    a fork of this test process's server; subprocess.TimeoutExpired when it ran past `timeout`."""
    import atexit

    key = (module, preload)
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
        _SERVERS[key] = _Server(module, preload)
        atexit.register(_SERVERS[key].close)
    argv = list(map(str, args))
    got = _SERVERS[key].run({"argv": argv, "cwd": str(cwd), "env": dict(os.environ if env is None else env),
                             "env_exact": True, "timeout": timeout})
    cmd = [sys.executable, "-m", module, *argv]
    if got["rc"] == -9:
        raise subprocess.TimeoutExpired(cmd, timeout, got["stdout"], got["stderr"])
    return subprocess.CompletedProcess(cmd, got["rc"], got["stdout"], got["stderr"])


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # not tests/, whose packages would shadow the repo's
    if sys.argv[1] == "--serve":
        serve_forever(json.loads(sys.argv[2]))
    else:
        Path(sys.argv[2]).write_text(json.dumps(serve(json.loads(Path(sys.argv[1]).read_text()))))
