"""The prefix cache file's path at startup: what may stand there, and what a killed save left.

:func:`check_cache_path`: the path is absent or a regular file (a symlink to one included); a
FIFO, device, socket or directory is refused with a hint (opening a FIFO for the load would
block the start forever, writing a device would corrupt it).

:func:`remove_stale_temps`: a save writes ``.NAME.<pid>.<tid>.tmp`` beside the file and renames
it over the file when complete, so a kill during the save leaves the temporary file behind
(``hpc_cli.cache.cachefile.slab_io.save_cache_file``). At start every such file of a process
that no longer runs is removed and logged; one of a live process (another server saving to the
same path) is left alone.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from hpc_cli.errors import ConfigError

log = logging.getLogger("hpc_cli.cache.cachefile")

_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.(?P<tid>\d+)\.tmp$")


def check_cache_path(path: str | os.PathLike) -> Path:
    """``path`` if it is absent or a regular file; ConfigError otherwise."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return p
    except OSError as exc:
        raise ConfigError(f"cache.prefix_cache_file {p} cannot be examined: {exc.strerror or exc}",
                          hint="check the path and its permissions") from None
    if stat.S_ISREG(mode):
        return p
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "not a regular file")
    raise ConfigError(f"cache.prefix_cache_file {p} is {kind}, not a regular file",
                      hint="name a regular file, or a path that does not exist yet (the orderly stop writes it)")


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process has not saved yet: the file is an earlier process's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    except OSError:
        return False
    return True


def stale_temps(path: str | os.PathLike) -> list[Path]:
    """The temporary files of saves to ``path`` whose process no longer runs."""
    p = Path(path)
    try:
        entries = list(p.parent.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is not None and m.group("name") == p.name and not _running(int(m.group("pid"))):
            out.append(entry)
    return sorted(out)


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Remove :func:`stale_temps` (regular files only); returns the ones removed."""
    removed = []
    for tmp in stale_temps(path):
        try:
            if not tmp.is_symlink() and tmp.is_file():
                size = tmp.stat().st_size
                tmp.unlink()
                removed.append(tmp)
                log.warning("removed %s (%d MiB): a save to %s was interrupted", tmp, size >> 20, path)
        except OSError as exc:
            log.warning("could not remove the interrupted save %s: %s", tmp, exc)
    return removed
