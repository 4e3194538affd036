"""Ranks that start warm: a fork server for the tests' Python processes.

A fresh Python process spends 1 to 2.5 s of CPU before a step's first line: importing torch, then
torch._dynamo, which creating AdamW imports. The suite starts hundreds of them. This module starts one
server per test session that imports those modules once, then forks a process for each launch. The fork
becomes the process the command names:

- its environment is exactly the one asked for (the variables torchrun gives a rank, see harness.rank_env);
- its working folder, sys.argv, sys.path[0], __main__ and standard streams are those of
  `python [-u] SCRIPT ARGS` (or `-c CODE ARGS`, or `-m MODULE ARGS`; torchrun starts its ranks with -u), and
  PYTHONUNBUFFERED and PYTHONFAULTHANDLER act as they would at start-up;
- it imports the step's own modules fresh: the server imports only torch and the standard library, never a
  module of a step or of tests/ (steps share module names);
- the launcher gets its pid, sends it signals, and reads its exit code as subprocess.Popen's returncode:
  negative for a signal, so a killed rank reads as a torchrun child would.

What cannot be made the same after a fork: variables read when Python or torch start (PYTHON*, OMP_*,
LD_*, TORCH*, CUDA_*...). A command whose environment differs from the server's in any of them starts
cold, as before; so does any other form of command (`python -X ...`, `python -W ...`). Every warm process
of a session shares the server's hash seed (PYTHONHASHSEED); fresh processes draw one each. The module
`random` is reseeded in each fork.

It is test plumbing: nothing in a step folder knows about it. tests/test_warm.py proves that a warm launch
and real torchrun give each rank the same environment, the same output lines and the same exit codes.

    python tests/warm.py SOCKET     # the server; the tests start it (start_server), not you
"""
import atexit
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

# Read when Python or torch start, so a fork cannot change them: a command that sets them otherwise starts cold.
FIXED_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS", "LD_", "MALLOC", "TORCH", "PYTORCH", "CUDA_",
                  "NVIDIA_", "HIP_", "ROCR_", "GLIBC", "MPLBACKEND", "MPLCONFIGDIR", "LC_", "LANG")
# ... except these: the fork applies the first two itself, as start-up would; torch reads the others only when
# a process group starts (torchrun's TORCHELASTIC_* and TORCH_NCCL_ASYNC_ERROR_HANDLING).
APPLIED_IN_FORK = ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "TORCHELASTIC_", "TORCH_NCCL_")
# What a step's ranks import from outside the step: imported once, here, by the server.
PRELOAD = ("torch", "torch.nn.functional", "torch.func", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.pipelining", "torch._dynamo", "torch.optim")


def fixed_at_start(env: dict) -> dict:
    """The variables of `env` that a fork cannot change (see FIXED_AT_START)."""
    return {k: v for k, v in env.items() if k.startswith(FIXED_AT_START) and not k.startswith(APPLIED_IN_FORK)}


# ---------------------------------------------------------------------------------------------------------
# The server: one process per test session, forking one process per launch.

def serve(path: str):
    """Import the heavy modules, then fork a watcher per connection on `path` until stdin closes (the
    launcher is gone). The watcher forks the process the request names and reports its exit code."""
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers are reaped by the kernel
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable:
            return  # the launcher closed our stdin: it has exited
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            watch(conn)  # never returns in the forked process that becomes the command
        conn.close()


def watch(conn: socket.socket):
    """In a forked watcher: receive a request and its three standard streams, fork the command's process,
    send its pid, wait for it, send its exit code. The command's own process returns from here into
    become(), which ends the process itself (finish)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = receive(conn)
    pid = os.fork()
    if pid == 0:
        conn.close()
        become(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def receive(conn: socket.socket):
    """A request: its length (8 bytes), then its JSON; the three fds come with the first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = int.from_bytes(data[:8], "big")
    while len(data) < 8 + size:
        data += conn.recv(1 << 16)
    return json.loads(data[8:]), fds


def become(request: dict, fds):
    """Turn this fork into `python ARGV...` run in request["cwd"] with request["env"]."""
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets it at start-up
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = request["argv"][1:]
    unbuffered = args[0] == "-u"  # torchrun starts its ranks as `python -u SCRIPT`
    args = args[1:] if unbuffered else args
    reopen_standard_streams(unbuffered=unbuffered or bool(os.environ.get("PYTHONUNBUFFERED")))
    import faulthandler
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    else:
        faulthandler.disable()
    import random
    random.seed()
    if args[0] == "-m":
        run_module_as_main(args[1], args[2:])
    if args[0] == "-c":
        source, filename, sys.argv, sys.path[0] = args[1], "<string>", ["-c", *args[2:]], ""
    else:
        script = os.path.abspath(args[0])
        with open(script, "rb") as f:
            source = f.read()
        filename, sys.argv, sys.path[0] = script, args, os.path.dirname(os.path.realpath(script))
    run_as_main(source, filename)


def reopen_standard_streams(unbuffered: bool):
    """sys.stdin, sys.stdout and sys.stderr on the new fds 0-2, buffered as Python's start-up would: stdout
    by blocks (a file or pipe), stderr by lines, both written through at once under PYTHONUNBUFFERED."""
    import io
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        buffering = 0 if unbuffered and fd else -1
        binary = io.open(fd, "rb" if fd == 0 else "wb", buffering=buffering, closefd=False)
        stream = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors,
                                  line_buffering=fd == 2 and not unbuffered, write_through=unbuffered and fd > 0)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_as_main(source, filename: str):
    """Run the code as the module __main__, as `python` runs a script, and end the process as Python ends
    one (see finish). An uncaught exception is printed as Python prints it, from the script's first frame."""
    import types
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=__builtins__, __cached__=None)
    if filename != "<string>":
        main.__file__ = filename
    sys.modules["__main__"] = main
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as error:
        finish(uncaught(error.with_traceback(None)))
    try:
        exec(code, main.__dict__)
    except SystemExit as exit:
        finish(exit_code(exit))
    except BaseException as error:  # noqa: B036 -- what Python's top level does with it
        finish(uncaught(error.with_traceback(error.__traceback__.tb_next)))  # from the script's frame on
    finish(0)


def run_module_as_main(module: str, argv):
    """Run `python -m MODULE ARGV...`: sys.path[0] is the working folder, sys.argv[0] the module's file, and
    the process ends as run_as_main's does."""
    import runpy
    sys.argv, sys.path[0] = [module, *argv], os.getcwd()  # runpy puts the module's file in sys.argv[0]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        finish(exit_code(exit))
    except BaseException as error:  # noqa: B036 -- what Python's top level does with it
        finish(uncaught(error))
    finish(0)


def uncaught(error: BaseException) -> int:
    """Print an uncaught exception as Python's top level does; the exit code it leads to (-2: SIGINT)."""
    sys.excepthook(type(error), error, error.__traceback__)
    return -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1


def exit_code(exit: SystemExit) -> int:
    """What Python's top level makes of SystemExit(code): None is 0, a number itself, anything else is
    printed to stderr and gives 1."""
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


def finish(code: int):
    """End as Python's finalisation does, in its order: join the non-daemon threads, run the atexit
    functions, flush the standard streams; then leave without tearing the interpreter down (torch's
    thousands of modules take a second to free, and no test reads what __del__ does at exit). An uncaught
    KeyboardInterrupt ends by SIGINT, as in Python, so a parent sees the interrupt."""
    import atexit
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


# ---------------------------------------------------------------------------------------------------------
# The launcher's side.

SHARED = "PP_TESTS_WARM_SERVERS"  # the session's folder of servers: the processes the tests start use them too


class Server:
    """A server for one start-up environment, listening on `path`: started on first use, stopped when the
    process that started it exits (its stdin closes)."""

    def __init__(self, path: str, env: dict):
        self.path = path
        self.process = subprocess.Popen([sys.executable, __file__, path], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.ready, self.reading = None, threading.Lock()
        atexit.register(self.stop)

    def wait_ready(self) -> bool:
        """Whether the server is up (waits for its imports the first time). The server says "ready" once: a
        thread that asks while another reads it waits for that answer, never for a second line."""
        with self.reading:
            if self.ready is None:
                self.ready = self.process.stdout.readline().strip() == "ready"
        return self.ready

    def stop(self):
        self.process.stdin.close()
        self.process.wait()
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


class SharedServer:
    """A server that a parent process of the session started (a pytest run inside a test, a check script)."""

    def __init__(self, path: str):
        self.path = path

    def wait_ready(self) -> bool:
        return True


_servers, _lock = {}, threading.Lock()


def server_for(cmd, env: dict):
    """The server that can start `cmd` with `env`, or None: `python [-u] SCRIPT ...`, `python [-u] -c CODE
    ...` and `python [-u] -m MODULE ...` start warm, from a server whose start-up environment is the one `env` asks for. The first process of
    a session that starts a server exports its folder (SHARED); its child processes use its servers."""
    args = [str(a) for a in cmd[1:]]
    args = args[1:] if args[:1] == ["-u"] else args
    if not (cmd[0] == sys.executable and args and (args[0] in ("-c", "-m") or not args[0].startswith("-"))):
        return None
    key = json.dumps(fixed_at_start(env), sort_keys=True)
    name = hashlib.sha1(key.encode()).hexdigest()[:16] + ".socket"
    with _lock:
        if key not in _servers:
            shared = os.environ.get(SHARED)
            if shared and os.path.exists(os.path.join(shared, name)):
                _servers[key] = SharedServer(os.path.join(shared, name))
            else:
                folder = tempfile.mkdtemp(prefix="warm-")
                os.environ.setdefault(SHARED, folder)  # the first in the session shares its servers
                start_env = {k: v for k, v in os.environ.items() if k not in fixed_at_start(os.environ)}
                _servers[key] = Server(os.path.join(folder, name), dict(start_env, **fixed_at_start(env)))
        server = _servers[key]
    return server if server.wait_ready() else None


class WarmProcess:
    """A process the server forked, with the parts of subprocess.Popen the tests use: pid, poll, wait,
    send_signal, kill and returncode (negative for a signal, as Popen's)."""

    def __init__(self, server: Server, cmd, env: dict, cwd, streams):
        self.args, self.returncode = cmd, None
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(server.path)
        request = json.dumps({"argv": [str(a) for a in cmd], "env": env, "cwd": str(cwd or os.getcwd())}).encode()
        socket.send_fds(self.conn, [len(request).to_bytes(8, "big") + request], streams)
        self.reply = self.conn.makefile("r")
        self.pid = int(self.reply.readline())

    def poll(self):
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if timeout is not None and not select.select([self.conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(self.reply.readline())
            self.reply.close()
            self.conn.close()
        return self.returncode

    def send_signal(self, number):
        if self.returncode is None:
            os.kill(self.pid, number)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


def fileno(stream, default: int, devnull: int) -> int:
    """The fd a Popen-style stdin/stdout/stderr argument names: None -> ours, DEVNULL, a file or an fd."""
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        return devnull
    return stream if isinstance(stream, int) else stream.fileno()


def popen(cmd, env=None, cwd=None, stdin=None, stdout=None, stderr=None):
    """subprocess.Popen(cmd, ...) for files, fds, DEVNULL and stderr=STDOUT (not PIPE): warm where it can be."""
    env = dict(os.environ if env is None else env)
    server = server_for(cmd, env)
    if server is None:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
    with open(os.devnull, "r+b") as devnull:
        out = fileno(stdout, 1, devnull.fileno())
        streams = [fileno(stdin, 0, devnull.fileno()), out,
                   out if stderr == subprocess.STDOUT else fileno(stderr, 2, devnull.fileno())]
        try:
            return WarmProcess(server, cmd, env, cwd, streams)
        except OSError:  # a shared server that has gone: start cold
            return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)


def run(cmd, env=None, cwd=None, input=None, capture_output=False, text=False, timeout=None, check=False,
        stdout=None, stderr=None, stdin=None):
    """subprocess.run for one process: warm where it can be. Captured streams go through temporary files."""
    with tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if input is not None:
            inp.write(input.encode() if isinstance(input, str) else input)
            inp.seek(0)
            stdin = inp
        if capture_output:
            stdout, stderr = out, err
        elif stdout == subprocess.PIPE or stderr == subprocess.PIPE:
            stdout = out if stdout == subprocess.PIPE else stdout
            stderr = out if stderr == subprocess.STDOUT else err if stderr == subprocess.PIPE else stderr
        process = popen(cmd, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        got = [read_back(f, stream, text) for f, stream in ((out, stdout), (err, stderr))]
    done = subprocess.CompletedProcess(cmd, code, *got)
    if check:
        done.check_returncode()
    return done


def read_back(f, stream, text: bool):
    """What a captured stream holds (None if it was not captured), decoded as subprocess.run does."""
    if stream is not f:
        return None
    f.seek(0)
    data = f.read()
    return data.decode(errors="strict").replace("\r\n", "\n") if text else data


if __name__ == "__main__":
    serve(sys.argv[1])
