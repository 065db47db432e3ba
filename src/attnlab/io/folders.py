"""Where attnlab may write, and how: atomically, never over the user's files, one writer at a time.

`check_output` applies the output rules every command gets (`--force` never deletes what attnlab did not write);
`write_folder`, `write_file` and `replace_with` write under a temporary name beside the target and rename it into
place; `output_lock` keeps a second run out of an output. The rules are in comments beside each section.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

MARKER = ".attnlab-output.json"
_TMP = ".attnlab-tmp-"


# -- the rules --------------------------------------------------------------------------------------
# An output path is refused when it is the current folder or one of its parents, when it is a source the run reads
# (or lies inside one, or contains one), and when it exists, unless `force` is given AND attnlab wrote it: a folder
# with attnlab's marker file (MARKER, which lists the files attnlab put there; a folder holding anything else is
# refused too), or a file that the caller's `ours(path)` recognises (a GGUF carries attnlab's key in its metadata).
def _resolved(p) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(p))))


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _marker_files(folder: Path) -> set[str] | None:
    """The files attnlab's marker lists, or None when the folder has no (readable) marker."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("written_by") != "attnlab" or not isinstance(data.get("files"), list):
        return None
    return set(map(str, data["files"]))


def written_by_attnlab(folder) -> bool:
    """True for a folder with attnlab's marker that holds nothing but the files the marker lists."""
    folder = Path(folder)
    listed = _marker_files(folder)
    if listed is None:
        return False
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {MARKER}
    return present <= listed


def check_output(path, *, force: bool = False, sources: Iterable = (), ours: Callable[[Path], bool] | None = None,
                 what: str = "--out") -> Path:
    """The output path, absolute, or a ValueError saying why writing there could lose the user's files.

    sources: paths the run reads (model folders and files, texts); the output may not be one of
    them, lie inside one, or contain one. ours(path): for an existing file, whether attnlab wrote
    it (folders are recognised by their marker).
    """
    out = _resolved(path)
    cwd = _resolved(os.getcwd())
    if _inside(cwd, out):
        where = "the current folder" if out == cwd else "a parent of the current folder"
        raise ValueError(f"{what} {path} is {where}; writing there would replace it: name a new folder")
    for src in sources:
        if src is None:
            continue
        s = _resolved(src)
        if out == s:
            raise ValueError(f"{what} {path} is the source {src}; writing there would destroy it: name a new path")
        if _inside(out, s):
            raise ValueError(f"{what} {path} lies inside the source {src}: name a path outside it")
        if _inside(s, out):
            raise ValueError(f"{what} {path} contains the source {src}; writing there would destroy it: "
                             "name a new path")
    near = out.parent
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        raise ValueError(f"cannot write to {path}: {near} is a file, not a folder")
    if not os.access(near, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write to {path}: {near} is not writable")
    if out.exists() or out.is_symlink():
        if not force:
            raise ValueError(f"{what} {path} exists; pass --force to replace it (only if attnlab wrote it)")
        if out.is_symlink():
            raise ValueError(f"{what} {path} is a symbolic link; attnlab does not replace links: name a new path")
        if out.is_dir():
            if _marker_files(out) is None:
                raise ValueError(f"{what} {path} exists and was not written by attnlab (no {MARKER}); --force "
                                 "replaces only attnlab's own outputs: remove it yourself or name a new path")
            if not written_by_attnlab(out):
                extra = sorted({str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
                               - _marker_files(out) - {MARKER})
                raise ValueError(f"{what} {path} holds files attnlab did not write ({', '.join(extra[:3])}"
                                 f"{', ...' if len(extra) > 3 else ''}); remove them or name a new path")
        elif ours is None or not ours(out):
            raise ValueError(f"{what} {path} exists and was not written by attnlab; --force replaces only "
                             "attnlab's own outputs: remove it yourself or name a new path")
    return out


# -- temporaries ------------------------------------------------------------------------------------
# Folders and files are written under a temporary name beside the target (`.NAME.attnlab-tmp-PID-XXXX`) and renamed
# into place at the end, so a failure leaves nothing half-written; the old output is moved aside first and deleted
# only once the new one is in place. A killed run's temporaries (its PID is gone) are removed by the next write
# beside them. What is written gets the permissions the user's umask gives a new file or folder (not the 0600/0700
# of a temporary).
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target) -> list[Path]:
    """Delete the temporaries of `target` left by runs that were killed (their PID is gone); returns them."""
    target = _resolved(target)
    pattern = re.compile(re.escape(f".{target.name}{_TMP}") + r"(\d+)-")
    removed = []
    if not target.parent.is_dir():
        return removed
    for p in target.parent.iterdir():
        m = pattern.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _chmod_tree(path: Path) -> None:
    """Give a finished output the permissions a plain new file or folder gets under the user's umask."""
    mask = _umask()
    if path.is_dir():
        os.chmod(path, 0o777 & ~mask)
        for p in path.rglob("*"):
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def _replace(tmp: Path, target: Path) -> None:
    """Move tmp into place; an existing target is moved aside first and deleted once tmp is in place."""
    aside = None
    if target.exists():
        aside = target.with_name(f".{target.name}{_TMP}{os.getpid()}-old")
        if aside.exists():
            shutil.rmtree(aside) if aside.is_dir() else aside.unlink()
        target.rename(aside)
    try:
        tmp.rename(target)
    except BaseException:
        if aside is not None:
            aside.rename(target)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True) if aside.is_dir() else aside.unlink(missing_ok=True)


def _disk_error(e: BaseException, target: Path) -> ValueError | None:
    """A one-line error for a write that failed on the disk (full, read-only, no permission), else None."""
    text = str(e)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
        return ValueError(f"cannot write {target}: {os.strerror(e.errno)}")
    if isinstance(e, RuntimeError) and ("No space left" in text or "file write failed" in text
                                        or "inline_container" in text):
        return ValueError(f"cannot write {target}: the disk refused the write (full?)")
    return None


# -- writing ----------------------------------------------------------------------------------------
def write_folder(folder, write: Callable[[Path], None], *, force: bool = False, sources: Iterable = (),
                 info: dict | None = None) -> Path:
    """Run write(tmp) on a fresh temporary folder beside `folder`, mark it as attnlab's, then move it into place.

    The output rules (check_output) are applied before writing and again at the end (another
    run may have written there meanwhile). info: extra fields for the marker (what was written).
    """
    sources = list(sources)
    folder = check_output(folder, force=force, sources=sources)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}{_TMP}{os.getpid()}-", dir=folder.parent))
    try:
        write(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        (tmp / MARKER).write_text(json.dumps({"written_by": "attnlab", "files": files, **(info or {})}, indent=2))
        _chmod_tree(tmp)
        check_output(folder, force=force, sources=sources)
        _replace(tmp, folder)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = _disk_error(e, folder)
        if err is not None:
            raise err from None
        raise
    return folder


def write_file(path, write: Callable[[Path], None], *, force: bool = False, sources: Iterable = (),
               ours: Callable[[Path], bool] | None = None) -> Path:
    """Run write(tmp) on a temporary file beside `path`, then move it into place (the rules of check_output)."""
    sources = list(sources)
    path = check_output(path, force=force, sources=sources, ours=ours)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}{_TMP}{os.getpid()}-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        _chmod_tree(tmp)
        check_output(path, force=force, sources=sources, ours=ours)
        _replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        err = _disk_error(e, path)
        if err is not None:
            raise err from None
        raise
    return path


def replace_with(path, write: Callable[[Path], None]) -> Path:
    """Write a file of the run's own (a checkpoint, a report) atomically through write(tmp), replacing an older one.

    Not for outputs the user names (those go through write_file and its rules): this replaces
    without asking. A disk that refuses the write gives a one-line ValueError and no leftover.
    """
    path = _resolved(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}{_TMP}{os.getpid()}-", dir=path.parent)
    os.close(fd)
    try:
        write(Path(name))
        _chmod_tree(Path(name))
        os.replace(name, path)
    except BaseException as e:
        Path(name).unlink(missing_ok=True)
        err = _disk_error(e, path)
        if err is not None:
            raise err from None
        raise
    return path


def replace_file(path, data: bytes) -> Path:
    """replace_with for bytes already in memory."""
    return replace_with(path, lambda tmp: tmp.write_bytes(data))


# -- one writer at a time ---------------------------------------------------------------------------
@contextlib.contextmanager
def output_lock(path):
    """Hold an exclusive lock on an output path for the length of a run (a lock file beside it).

    A second run asking for the same output gets a ValueError naming the process that holds it.
    The lock is the operating system's (flock): a killed run releases it.
    """
    import fcntl

    target = _resolved(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_name(f".{target.name}.attnlab-lock")
    while True:  # the file may be unlinked by the holder between our open and our lock: then take the new one
        fh = open(lock, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise ValueError(f"{path} is being written by another attnlab run (pid {holder}); wait for it to end "
                             "or name another output") from None
        try:
            same = os.fstat(fh.fileno()).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        fh.close()
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield target
    finally:
        with contextlib.suppress(OSError):
            if not fh.closed:
                fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()
        with contextlib.suppress(OSError):
            lock.unlink()
