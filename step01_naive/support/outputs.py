"""One rule for every file the course writes: nothing a user owns is lost or overwritten.

An output may take a path where nothing is, an empty regular file, or a regular file this course wrote,
known by its own mark for its kind (`ours`: a trace begins with timeline.TRACE_MARK, a log with a record
whose first keys are step, loss, step_time_s, tokens_per_s). Never a directory, a device, a FIFO, a socket
or a symbolic link (a link's target is somebody's file). Every file is written under a temporary name in
its own folder, then renamed over the path (write, open_temporary): a run killed half-way leaves the path
as it was. check_all checks every output of a run before any work: each path is one of the above, its
folder exists and takes a file, no two outputs share a path, none replaces an input, and none lies inside
the checkpoint folder (--save), which holds the course's checkpoints alone.
"""
import json
import os
import stat
import tempfile

from support import timeline

LOG_KEYS = ["step", "loss", "step_time_s", "tokens_per_s"]  # how the course's log records begin (report.log_step)
NOT_REGULAR = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISSOCK, "a socket"))


def is_trace(head: bytes) -> bool:
    """A Chrome trace this course wrote (timeline.write_chrome_trace)."""
    return head.startswith(timeline.TRACE_MARK)


def is_log(head: bytes) -> bool:
    """A JSON-lines log this course wrote: its first record begins with LOG_KEYS."""
    try:
        record = json.loads(head.split(b"\n", 1)[0])
    except ValueError:
        return False
    return isinstance(record, dict) and list(record)[:4] == LOG_KEYS


def head_of(path: str, size: int = 2**16) -> bytes:
    """The first bytes of a regular file."""
    with open(path, "rb") as f:
        return f.read(size)


def replaceable(path: str, ours) -> bool:
    """Whether the regular file at path may be replaced: it is empty (nothing is lost), or ours(its head)."""
    return os.path.getsize(path) == 0 or ours(head_of(path))


def refusal(flag: str, path: str, kind: str, ours):
    """Why `path` cannot take the output `flag` (a file of `kind`), as one line naming the flag, the path and
    what is true; None if it can."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there: the folder is looked at below
        mode = None
    except OSError as err:
        return f"{flag} {path} cannot be looked at: {err.strerror}"
    folder = os.path.dirname(os.path.abspath(path))
    if mode is None and not os.path.isdir(folder):
        problem = "is not a folder" if os.path.exists(folder) else "does not exist"
        return f"{flag} {path}: the folder {folder} {problem}"
    if mode is not None and stat.S_ISDIR(mode):
        return f"{flag} {path} is a directory: give a file name"
    if mode is not None and stat.S_ISLNK(mode):
        return f"{flag} {path} is a symbolic link: the course replaces only a regular file it wrote; give another name"
    what = next((name for test, name in NOT_REGULAR if mode is not None and test(mode)), None)
    if what:
        return f"{flag} {path} is {what}, not a regular file: it is left as it is; give a file name"
    try:  # the output is written under a temporary name in the same folder, then renamed over the path
        tempfile.NamedTemporaryFile(dir=folder).close()
    except OSError as err:
        return f"{flag} {path} cannot be written: {err.strerror} in {folder}"
    try:
        if mode is not None and not replaceable(path, ours):
            return f"{flag} {path} exists and is not a {kind} this course wrote: it is left as it is; give another " \
                   "file name"
    except OSError as err:
        return f"{flag} {path} cannot be read: {err.strerror}"
    return None


def inside(path: str, folder: str) -> bool:
    """Whether path is folder, or lies anywhere under it (links resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_all(outputs, inputs=(), save=None):
    """The first refusal among a run's outputs [(flag, path, kind, ours)], or None: each path on its own
    (refusal), then no two outputs on one path, no output on an input [(flag, path)], none inside --save."""
    outputs = [o for o in outputs if o[1]]
    for flag, path, kind, ours in outputs:
        problem = refusal(flag, path, kind, ours)
        if problem:
            return problem
    seen = {}
    for flag, path, _, _ in outputs:
        real = os.path.realpath(path)
        if real in seen:
            return f"{flag} {path} is also {seen[real]}: two outputs cannot share one path"
        seen[real] = f"{flag} {path}"
        for other, given in inputs:
            if given and os.path.exists(given) and real == os.path.realpath(given):
                return f"{flag} {path} is also {other} {given}: an output never replaces an input"
        if save and inside(path, save):
            return f"{flag} {path} is inside --save {save}: that folder holds the course's checkpoints alone"
    return None


def open_temporary(path: str, mode: str = "w", **kwargs):
    """A file under a temporary name in path's folder (its .name), for the caller to fill, then rename over path;
    readable as any new file is (the umask's permissions, not tempfile's owner-only ones)."""
    folder, name = os.path.split(os.path.abspath(path))
    f = tempfile.NamedTemporaryFile(mode, dir=folder, prefix=name + ".", suffix=".tmp", delete=False, **kwargs)
    umask = os.umask(0o22)
    os.umask(umask)
    os.chmod(f.name, 0o666 & ~umask)
    return f


def write(path: str, data, mode: str = "w"):
    """Write data to path whole or not at all: into a temporary file beside it, renamed over it once written."""
    with open_temporary(path, mode) as f:
        f.write(data)
    os.replace(f.name, path)
