"""Files that are never half-written: atomic writes, appends to a run's own log, the one rule for what may stand
at an output path and where elflow keeps a file of its own (`check_own`), full disks, bounded reads of its own
files with one-line errors, and the folder lock and hold of a command's output folder. With elflow.util.jsonio
this is the one reader and writer of every file of a run."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from elflow.util import jsonio
from elflow.util.errors import ELFError


@functools.lru_cache(maxsize=None)
def _umask() -> int:
    """The process's umask (read once: os.umask can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets here: 0o666 under the umask, as open() gives."""
    return 0o666 & ~_umask()


def folder_mode() -> int:
    return 0o777 & ~_umask()


NAME_MAX = 255  # bytes in one path component on every common file system


def _temp_stem(name: str) -> str:
    """`.NAME.`: the start of the hidden temporary names of NAME, NAME cut where it must be so that a pid
    (up to 10 digits), a dot, mkstemp's 8 random characters and `.tmp` still fit in NAME_MAX bytes."""
    room = NAME_MAX - 2 - 10 - 1 - 8 - 4
    return "." + os.fsencode(name)[:room].decode(errors="ignore") + "."


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_temporaries(path: Path) -> None:
    """Temporaries of `path` left by a writer that was killed (its pid no longer runs; a minute old)."""
    prefix = _temp_stem(path.name)
    try:
        siblings = list(path.parent.glob(glob_escape(prefix) + "*.tmp"))
    except OSError:
        return
    for p in siblings:
        pid = p.name[len(prefix):].split(".", 1)[0]
        try:
            old = time.time() - p.lstat().st_mtime > 60
        except OSError:
            continue
        if pid.isdigit() and old and not _process_alive(int(pid)):
            try:
                p.unlink()
            except OSError:
                pass


def resolved(path: str | os.PathLike) -> Path:
    """`path` made absolute with every symbolic link followed; a loop of links (which Path.resolve meets as a
    RuntimeError) is an ELFError naming the path."""
    try:
        return Path(path).expanduser().resolve()
    except RuntimeError:
        raise ELFError(f"{path} is a loop of symbolic links (one link leads back to another), not a file or "
                       "folder; point the link at a real one, or pass its own path") from None


def glob_escape(text: str) -> str:
    import glob

    return glob.escape(text)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", overwrite: bool = True):
    """Open a temporary file next to `path`; on success move it to `path`, on error remove it.

    A reader never sees a half-written file, and a crash leaves the previous version intact. The move obeys
    the output rule of `check_output` once more at the end: `path` must be absent, or (with `overwrite`) a
    regular file; without `overwrite` a file that appeared at `path` meanwhile is left as it is and the
    write is refused. The file gets the mode open() would give it (0o666 under the umask). A full disk is a
    one-line `NoSpace` error naming `path`.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_temporaries(path)
        fd, tmp = tempfile.mkstemp(prefix=f"{_temp_stem(path.name)}{os.getpid()}.", suffix=".tmp",
                                   dir=path.parent)
    except OSError as e:
        if disk_full(e):
            raise NoSpace(path) from None
        raise
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        place(tmp, path, overwrite)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, Exception) and disk_full(e):
            raise NoSpace(path) from None
        raise


def place(tmp: str | os.PathLike, path: str | os.PathLike, overwrite: bool) -> None:
    """Move the finished temporary file `tmp` to `path` under the output rule (`output_rule`): without
    `overwrite` the move fails if anything is at `path` by then (a hard link, then the temporary's removal:
    no window in which another writer's file could be replaced)."""
    path = Path(path)
    output_rule(path, overwrite, "", ended=True)
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        output_rule(path, overwrite, "", ended=True)  # names what appeared
        raise
    except OSError as e:  # a file system without hard links: the check above, then the move
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        os.replace(tmp, path)
        return
    os.unlink(tmp)


@contextmanager
def signals_held(signums=(signal.SIGTERM, signal.SIGINT)):
    """SIGTERM and SIGINT held back while the block runs and raised again, to their own handlers, when it ends:
    around a writer that an exception raised mid-call leaves in a state whose clean-up fails with an error of
    its own (torch.save's zip writer: "unexpected pos"), so that the signal's own exception comes right after
    the call, with its one line. Outside the main thread (where Python runs no handler) the block runs as it
    is."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    before = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)


@contextmanager
def folder_in_place(out: str | os.PathLike):
    """A whole folder written at once: the block fills a temporary sibling (yielded), which is renamed to `out`
    when the block ends (an empty folder at `out` is replaced) and removed if it fails, so that no reader ever
    meets a half-written folder at `out`."""
    import shutil

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        os.chmod(tmp, folder_mode())
        yield tmp
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path, text: str, overwrite: bool = True) -> None:
    with atomic_write(path, "w", overwrite) as f:
        f.write(text)


def atomic_write_json(path, obj, overwrite: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n", overwrite)


def append_own(path: str | os.PathLike, text: str) -> None:
    """Append `text` to a file elflow writes line by line (a run's metrics.jsonl), created if missing: only as a
    regular file of its own, never through a symbolic link, never blocking on a fifo; ELFError naming the file
    otherwise."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, file_mode())
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise ELFError(f"{path}: a symbolic link where elflow writes its own file; refused (move it away, "
                           "then run again)") from None
        if e.errno == errno.ENXIO:
            raise ELFError(f"{path}: a fifo where elflow writes its own file; refused (move it away, then run "
                           "again)") from None
        raise
    with os.fdopen(fd, "a") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ELFError(f"{path}: not a regular file where elflow writes its own file; refused (move it away, "
                           "then run again)")
        f.write(text)


def read_json(path: str | os.PathLike, what: str = "", kind: type = dict, own: bool = True):
    """A JSON file elflow wrote (run.json, state.json, distill.json, ...): its object, which must be a `kind`,
    read by the bounded reader (elflow.util.jsonio) as a regular file of at most jsonio.RECORD_BYTES, never
    through a link unless `own` is False; one ELFError naming the file otherwise."""
    return jsonio.read_json(path, what, kind, max_bytes=jsonio.RECORD_BYTES, own=own)


def sha256_file(path: str | os.PathLike, own: bool = False) -> str:
    """The hex sha256 of a regular file, read in 1 MiB chunks (`jsonio.open_regular`: never a fifo or a
    device; with `own`, never through a symbolic link)."""
    h = hashlib.sha256()
    with jsonio.open_regular(path, own=own) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_own_text(path: str | os.PathLike, max_bytes: int, what: str = "") -> str:
    """The UTF-8 text of a file elflow wrote and owns (a lock, a sweep's CSV), by the bounded reader: a regular
    file of at most `max_bytes`, never through a link, never a fifo or a device; ELFError naming it otherwise."""
    data = jsonio.read_limited(path, max_bytes, what, own=True)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ELFError(f"{path}: corrupted (not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}); "
                       "elflow wrote it as UTF-8: move it away, then run again") from None


def not_own(path: str | os.PathLike, folder: bool = False) -> str | None:
    """What stands at `path` where elflow keeps a file (or, with `folder`, a folder) of its own, when it is
    something else: "a symbolic link (to T)", "a fifo", "a folder", "a file", ...; None where nothing stands
    there or the right kind does."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    if (stat.S_ISDIR if folder else stat.S_ISREG)(st.st_mode):
        return None
    for test, kind in (*_KINDS, (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file")):
        if test(st.st_mode):
            return kind
    return "not a regular file"


def check_own(path: str | os.PathLike, what: str, folder: bool = False) -> None:
    """ELFError naming `path` (where elflow keeps `what`) when something other than a regular file (a folder,
    with `folder`) stands there: a symbolic link (elflow never reads or writes its own files through one), a
    fifo, a device, a socket."""
    kind = not_own(path, folder)
    if kind is not None:
        want = "folders only as folders" if folder else "files only as regular files"
        links = ", never through links" if kind.startswith("a symbolic link") else ""
        raise ELFError(f"{path}: {kind} where elflow keeps {what}; refused (elflow reads and writes its own {want}"
                       f"{links}): move it away, then run again")


def own_folder(path: str | os.PathLike, what: str) -> Path:
    """`path`, a folder elflow writes its own files in (a run's tb/, wandb/), made where missing: a symbolic
    link or anything else but a folder there is an ELFError naming it (`check_own`)."""
    path = Path(path)
    check_own(path, what, folder=True)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if disk_full(e):
            raise NoSpace(path) from None
        raise ELFError(f"{path}: cannot make {what} there ({e.strerror or e})") from None
    check_own(path, what, folder=True)  # made meanwhile by another program
    return path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """elflow's cache folder: `cache_dir`, else $ELFLOW_CACHE, else ~/.cache/elflow."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("ELFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "elflow"


def writable_cache(root: str | os.PathLike, what: str) -> Path:
    """`root` (a folder of the cache, `cache_root`), made where missing, once it is known that `what` is to be
    written there: a folder this process can write in, or an ELFError naming it (a file, a fifo, a device or a
    dangling link where the folder should be, a folder that cannot be written) and how to choose another."""
    root = Path(root)
    advice = "choose another cache folder with --cache-dir or ELFLOW_CACHE"
    if os.path.lexists(root) and not root.is_dir():
        raise ELFError(f"the cache folder {root} is {not_own(root, folder=True) or 'not a folder'}, not a folder, "
                       f"and {what} is to be kept there; {advice}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe_writable(root)
    except OSError as e:
        full = "no space left on its device" if disk_full(e) else e.strerror or str(e)
        raise ELFError(f"the cache folder {root} cannot be written ({full}), and {what} is to be kept there; "
                       f"{advice}") from None
    return root


# ----------------------------------------------------------------------------------------------------------
# output paths
def probe_writable(folder: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".elflow-probe-", dir=folder)
    os.close(fd)
    os.unlink(tmp)


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a fifo"),
          (stat.S_ISSOCK, "a socket"))


def output_rule(path: Path, overwrite: bool, flag: str = "--out", folder: bool = False, ended: bool = False) -> None:
    """The one rule for what may stand where an output goes, checked before any work (`check_output`) and
    again when the output is moved into place (`place`, `ended`):

    nothing; or, with `overwrite`, a regular file (a file output) or a folder (a folder output). Never a
    symbolic link (to a file, to a folder, dangling or looping: elflow does not write through links; a link
    among the path's parents is followed), never a device, fifo or socket. `flag` names the option the path
    came from ("" for a file inside an output folder)."""
    name = f"{flag} {path}" if flag else str(path)
    other = f"choose another {flag}" if flag else "remove it"
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # absent (a path under a file is refused by check_output)
        return
    except OSError as e:
        raise ELFError(f"{name}: cannot be examined ({e.strerror or e}); {other}") from None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        if folder:
            try:
                is_dir = Path(path).is_dir()
            except OSError:  # a link loop
                is_dir = False
            if is_dir:
                raise ELFError(f"{name} is a symbolic link (to {target}); elflow does not write through links: pass "
                               f"the folder's own path ({os.path.realpath(path)}), or remove the link")
            raise ELFError(f"{name} is a symbolic link to {target}, which is not a folder (dangling, or a loop); "
                           f"remove the link or {other}")
        raise ELFError(f"{name} is a symbolic link (to {target}); elflow does not write through links: pass the "
                       "target's own path, or remove the link")
    for test, kind in _KINDS:
        if test(st.st_mode):
            raise ELFError(f"{name} is {kind}, not a regular file{' or a folder' if folder else ''}; elflow writes "
                           f"only regular files (never into devices or pipes): {other}")
    if stat.S_ISDIR(st.st_mode):
        if not folder:
            raise ELFError(f"{name} is a folder; pass a file name")
        return
    if folder:
        raise ELFError(f"{name} is a file, not a folder; {other}")
    if not overwrite:
        if ended:
            raise ELFError(f"{name} appeared while this command ran (another program wrote it); it is left as it "
                           f"is and this command's output is not written: pass --overwrite to replace it, or "
                           f"{other}")
        raise ELFError(f"{name} already exists; pass --overwrite to replace it, or {other}")


def check_output(path: str | os.PathLike, overwrite: bool = False, flag: str = "--out",
                 folder: bool = False) -> Path:
    """Refuse an output path before any work is done: an empty one, a name too long for the file system, a
    path through a folder that does not exist (`a/missing/../b`), what `output_rule` refuses (an existing
    file without `overwrite`, a link, a device, a folder where a file is wanted or the reverse), a path
    under a regular file, a place that cannot be written. A folder output may exist; what may be replaced
    inside it is the command's decision."""
    if str(path) == "":
        raise ELFError(f"{flag} is empty; pass a path")
    if not folder and os.fspath(path).endswith(os.sep):  # Path() would drop the slash and write a file there
        raise ELFError(f"{flag} {os.fspath(path)} ends with {os.sep}, the path of a folder; this output is a file: "
                       "pass a file name (without the trailing slash)")
    path = Path(path).expanduser()
    if len(os.fsencode(path.name)) > NAME_MAX:
        raise ELFError(f"{flag} {path}: the name is {len(os.fsencode(path.name))} bytes long, more than the "
                       f"{NAME_MAX} a file system allows; choose a shorter name")
    for i, part in enumerate(path.parts):
        if part == ".." and not Path(*path.parts[:i]).exists():
            raise ELFError(f"{flag} {path} goes through {Path(*path.parts[:i])}, which does not exist; pass the "
                           f"path without '..'")
    output_rule(path, overwrite, flag, folder)
    base = path if folder and path.is_dir() else path.parent
    while not base.exists() and base != base.parent:
        if base.is_symlink():
            raise ELFError(f"{flag} {path} lies under {base}, a symbolic link that leads nowhere; choose another "
                           f"{flag}")
        base = base.parent
    if not base.is_dir():
        raise ELFError(f"{flag} {path} lies under {base}, which is a file, not a folder; choose another {flag}")
    try:
        probe_writable(base)
    except OSError as e:
        raise ELFError(f"{flag} {path}: cannot write in {base} ({e.strerror or e}); choose a writable place") from None
    return path


class NoSpace(ELFError):
    """A full disk (or quota) while writing `path`: nothing was written there."""

    def __init__(self, path, message: str | None = None):
        self.path = Path(path)
        super().__init__(message or f"no space left on device while writing {path}; it is unchanged (nothing "
                                    "was written there): free some space, then run the command again")


_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


_FULL_WORDS = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122", "storagefull")


def disk_full(e: BaseException) -> bool:
    """Whether `e` (any writer's error: Python's OSError, safetensors' SafetensorError, torch.save's
    RuntimeError over the OSError of its file object) comes from a full disk or quota."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NoSpace):
            return True
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if any(w in str(e).lower() for w in _FULL_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


# ----------------------------------------------------------------------------------------------------------
# a folder's lock
def _process_start(pid: int) -> str | None:
    """When process `pid` started, as the kernel counts it (clock ticks since boot, with the boot's id): a pid
    that is reused later belongs to a process with another start. None where /proc cannot tell."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    fields_after_name = stat_line.rsplit(")", 1)[1].split()
    return f"{boot}:{fields_after_name[19]}"  # field 22 of stat: starttime


class FolderLock:
    """An exclusive hold on a folder: `.lock`, created with O_EXCL, holding pid, host, the process's start
    and the command.

    A lock whose process no longer runs on this host (a killed command, or a pid now reused by another
    process: its start differs) is stale and taken over. One written on another host cannot be checked from
    here: the refusal says how to clear it."""

    NAME = ".lock"

    def __init__(self, folder: str | os.PathLike, command: str):
        self.path = Path(folder) / self.NAME
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
                     "command": command, "time": time.time()}
        self.held = False

    def _holder(self) -> dict | None:
        try:
            info = jsonio.read_json(self.path, kind=None, max_bytes=jsonio.RECORD_BYTES, own=True)
        except ELFError:
            return None
        pid = info.get("pid") if isinstance(info, dict) else None
        return info if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31 else None

    def _stale(self, holder: dict | None) -> bool:
        if holder is None:  # empty or garbled: a holder killed while writing it, unless it is being written now
            try:
                return time.time() - os.lstat(self.path).st_mtime > 10
            except FileNotFoundError:
                return True
        if holder.get("host") != self.info["host"]:
            return False  # another machine's process: cannot be checked from here
        pid = holder["pid"]
        if pid == os.getpid():
            return True  # this process's own leftover
        if not _process_alive(pid):
            return True
        start = holder.get("start")
        now = _process_start(pid)
        return start is not None and now is not None and start != now  # the pid was reused

    def acquire(self) -> "FolderLock":
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, file_mode())
            except FileExistsError:
                check_own(self.path, "the lock of the folder")
                holder = self._holder()
                if self._stale(holder):
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                    continue
                raise ELFError(self._refusal(holder)) from None
            except OSError as e:
                raise ELFError(f"cannot take the lock {self.path} ({e.strerror or e})") from None
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(self.info) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                self.path.unlink(missing_ok=True)
                if disk_full(e):
                    raise NoSpace(self.path) from None
                raise ELFError(f"cannot write the lock {self.path} ({e.strerror or e})") from None
            self.held = True
            return self
        raise ELFError(f"cannot take the lock {self.path}: other commands keep taking it")

    @classmethod
    def text(cls, folder: str | os.PathLike) -> str | None:
        """The text of the lock of `folder` (None where there is none), by the bounded reader: a regular file
        only (`read_own_text`), never a link, a fifo or a device."""
        path = Path(folder) / cls.NAME
        if not os.path.lexists(path):
            return None
        check_own(path, "the lock of the folder")
        try:
            return read_own_text(path, jsonio.RECORD_BYTES, "the lock of the folder")
        except ELFError:
            if not os.path.lexists(path):  # released meanwhile
                return None
            raise

    def _refusal(self, holder: dict | None) -> str:
        if holder is None:
            return (f"{self.path.parent} is in use by a command that is starting ({self.path} is being written); "
                    f"wait a moment, or, if no elflow command runs, delete {self.path}")
        who = f"pid {holder['pid']} on {holder.get('host')}: {holder.get('command', '?')}"
        if holder.get("host") != self.info["host"]:
            return (f"{self.path.parent} is in use by another elflow command ({who}); it runs on another host (or "
                    f"in another container), which cannot be checked from here: wait for it, or, if no elflow "
                    f"command runs there, delete {self.path}")
        return (f"{self.path.parent} is in use by another elflow command ({who}); wait for it to finish, or, if "
                f"it no longer runs, delete {self.path}")

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("pid") == self.info["pid"]:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            self.held = False

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release()


class FolderHold:
    """A command's hold on the folder it writes: the folder is made (with the parents it lacks) and locked
    (`FolderLock`); on release the lock goes, and after a failure the folders this hold made go too, where
    nothing was left in them. Use it as a context manager, or `open()` / `close(ok)`."""

    def __init__(self, folder: str | os.PathLike, command: str, flag: str = "--out"):
        self.folder, self.command, self.flag = Path(folder), command, flag
        self.created: list[Path] = []
        self.lock: FolderLock | None = None

    def open(self) -> "FolderHold":
        p = self.folder
        while not p.exists() and not p.is_symlink() and p != p.parent:
            self.created.append(p)
            p = p.parent
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if disk_full(e):
                raise NoSpace(self.folder) from None
            raise ELFError(f"{self.flag} {self.folder}: cannot create it ({e.strerror or e})") from None
        try:
            self.lock = FolderLock(self.folder, self.command).acquire()
        except BaseException:
            self._remove_created()
            raise
        return self

    def close(self, ok: bool) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if not ok:
            self._remove_created()

    def _remove_created(self) -> None:
        for p in self.created:  # innermost first; stops at the first that is not empty
            try:
                p.rmdir()
            except OSError:
                break

    def __enter__(self) -> "FolderHold":
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc_type is None)


def stdout_to_nowhere() -> None:
    """Standard output led to /dev/null: its reader went away (a pipe into `head`) or it cannot be written, so
    that nothing fails again when Python flushes it at exit."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # a stream without a descriptor of its own
        pass


def check_stdout_open(flag: str) -> None:
    """A command whose result goes to standard output (`flag`: --json, --print-config) refused before any work
    when standard output is closed (`>&-`, which leaves Python's sys.stdout None): the result would go nowhere."""
    if sys.stdout is None:
        raise ELFError(f"{flag} prints the result on standard output, which is closed; run the command with standard "
                       f"output open (a file, a pipe), or leave {flag} out")


def print_result(text: str, done: str = "", what: str = "the result", hint: str = "",
                 closed_ok: bool = False) -> None:
    """`text` on standard output, flushed: a command's result (--json, --print-config; `what` it is). A reader
    that went away (a pipe into `head`) ends the printing without a word, as for every command; any other
    failure (a closed standard output, /dev/full) is one ELFError saying that it was not printed, after `done`
    (what the command wrote, if anything), with `hint` (what to do). `closed_ok`: a standard output closed when
    the command started prints nothing, without a word (the result is in the files `done` names). Standard
    output then leads nowhere, so that nothing fails again at exit."""
    before = f"{done}, but " if done else ""
    after = f"; {hint}" if hint else ""
    if sys.stdout is None:
        if closed_ok:
            return
        raise ELFError(f"{before}standard output is closed, so {what} was not printed; run the command with "
                       f"standard output open (a file, a pipe){after}")
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_to_nowhere()
    except OSError as e:
        stdout_to_nowhere()
        raise ELFError(f"{before}standard output cannot be written ({e.strerror or e}), so {what} "
                       f"{'were' if what.endswith('s') else 'was'} not printed{after}") from None
