"""What kvguard did to the engine that must be undone even if kvguard dies: one small file.

Almost everything kvguard does lives in its own process and dies with it: a proxy
that sheds stops shedding when it stops existing. One action does not: a paused
engine (``shed_by_pause``, or the drain of the fp8 switch without the proxy) stays
paused after a SIGKILL or an OOM kill of kvguard, and refuses every request until
someone resumes it. So before kvguard pauses an engine it writes that down, and it
clears the note once a resume worked; a kvguard that starts and finds the note for
its engine resumes it (``stale_pause_resumed``) before doing anything else. A pause
that cannot be written down is not sent at all: kvguard never pauses what a
successor could not know to resume.

The file is ``state.json`` in the first of:

1. ``$KVGUARD_STATE_DIR``;
2. ``$STATE_DIRECTORY`` (systemd sets it from ``StateDirectory=kvguard``: usually
   ``/var/lib/kvguard``; only its first entry is used);
3. ``$XDG_STATE_HOME/kvguard``, else ``~/.local/state/kvguard``.

It is JSON, ``{"version": 1, "engines": {"<engine url>": {"paused": true,
"since": <unix time>}}}``, keyed by engine URL so that a kvguard pointed at another
engine never resumes one it did not pause. Writes are atomic (a temporary file in
the same directory, fsync, :func:`os.replace`, fsync of the directory): a crash
mid-write leaves the old file or the new one, never half of one. Several kvguards on
one host (one per engine) share the file: each read-modify-write holds an exclusive
``flock`` on ``.state.lock`` beside it, so no one's entry is lost to another's write.
A file that cannot be read or parsed is logged (``state_file_unreadable``) and treated
as empty; a write that fails is logged (``state_file_write_failed``), and when it is
the note of a pause, the pause is refused (:class:`EnginePauseRecord` says why).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("kvguard.state")

STATE_FILE_NAME = "state.json"
STATE_VERSION = 1
# A state file this large is not ours: refuse to read it rather than load it all.
_MAX_STATE_BYTES = 1024 * 1024
LOCK_FILE_NAME = ".state.lock"
# Another kvguard holds the lock for one small write: milliseconds. Past this, the write
# fails (logged) rather than wait longer: the wait runs on the event loop (the proxy
# and the ticks wait with it), and an unlocked write could drop the neighbour's note.
_LOCK_WAIT_S = 0.25


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory of kvguard's state file, from the environment (see the module doc)."""
    env = os.environ if env is None else env
    explicit = env.get("KVGUARD_STATE_DIR")
    if explicit:
        return Path(explicit)
    systemd = env.get("STATE_DIRECTORY")
    if systemd:
        # systemd joins several StateDirectory= entries with ':'; the first is ours.
        return Path(systemd.split(":")[0])
    xdg = env.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path(env.get("HOME") or Path.home()) / ".local" / "state"
    return base / "kvguard"


class StateFile:
    """kvguard's persisted state, read and written whole (it is a few hundred bytes)."""

    def __init__(self, path: Path, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.wall_clock = wall_clock
        # Why the last write failed (the path and the OS's reason); None after one that worked.
        self.write_error: str | None = None

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> StateFile:
        """The state file at the location the environment chooses."""
        return cls(state_dir(env) / STATE_FILE_NAME)

    def load(self) -> dict[str, Any]:
        """The stored document; empty when there is none or it is unusable (logged)."""
        try:
            with self.path.open("rb") as handle:
                raw = handle.read(_MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("state_file_unreadable", path=str(self.path), error=exc.strerror)
            return {}
        problem = None
        doc: Any = None
        if len(raw) > _MAX_STATE_BYTES:
            problem = f"over {_MAX_STATE_BYTES} bytes"
        else:
            try:
                doc = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                problem = f"not JSON: {exc}"
        if problem is None and (not isinstance(doc, dict) or doc.get("version") != STATE_VERSION):
            problem = f"not a version {STATE_VERSION} kvguard state document"
        if problem is not None:
            log.warning("state_file_unreadable", path=str(self.path), error=problem)
            return {}
        return dict(doc)

    def engine_paused(self, engine_url: str) -> bool:
        """Whether kvguard recorded ``engine_url`` as paused by itself and not resumed."""
        engines = self.load().get("engines")
        entry = engines.get(engine_url) if isinstance(engines, dict) else None
        return isinstance(entry, dict) and entry.get("paused") is True

    def set_engine_paused(self, engine_url: str, paused: bool) -> bool:
        """Record (or clear) that kvguard paused ``engine_url``; False when the write failed."""
        with self._locked() as refused:
            if refused is not None:
                # Written unlocked, another kvguard's note written meanwhile could be
                # lost, and the engine it paused never resumed: a failed write instead
                # (a pause is then not sent; a clear leaves a note whose resume is safe).
                self.write_error = refused
                return False
            doc = self.load()
            engines = doc.get("engines")
            engines = dict(engines) if isinstance(engines, dict) else {}
            if paused:
                engines[engine_url] = {"paused": True, "since": round(self.wall_clock(), 3)}
            elif engine_url in engines:
                del engines[engine_url]
            else:
                self.write_error = None
                return True  # nothing recorded, nothing to write
            return self._write({"version": STATE_VERSION, "engines": engines})

    @contextlib.contextmanager
    def _locked(self) -> Iterator[str | None]:
        """Hold the exclusive lock beside the file for one read-modify-write.

        Without it, two kvguards marking two engines at once could each read the old
        document and the second write would drop the first one's entry. Yields None
        when the caller may write, else why it may not: the lock file cannot be opened
        (``state_file_lock_unavailable``) or a holder keeps the lock past
        ``_LOCK_WAIT_S`` (``state_file_lock_timeout``). A folder that cannot be made
        yields None: the write then fails and says why (``state_file_write_failed``).
        """
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError:
            yield None  # the write fails too, and says why
            return
        lock = directory / LOCK_FILE_NAME
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            log.warning("state_file_lock_unavailable", path=str(self.path), error=exc.strerror)
            yield f"cannot lock {lock}: {exc.strerror}"
            return
        try:
            if self._wait_for_lock(fd):
                yield None
            else:
                log.warning("state_file_lock_timeout", path=str(self.path))
                yield f"cannot lock {lock}: another kvguard held it past {_LOCK_WAIT_S:g} s"
        finally:
            os.close(fd)  # closing releases the lock

    @staticmethod
    def _wait_for_lock(fd: int) -> bool:
        """Take the lock on ``fd`` within ``_LOCK_WAIT_S``; whether it was had."""
        deadline = time.monotonic() + _LOCK_WAIT_S
        while not StateFile._try_lock(fd):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)  # a neighbour's write takes milliseconds
        return True

    @staticmethod
    def _try_lock(fd: int) -> bool:
        """Take the lock on ``fd`` if it is free now."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _write(self, doc: dict[str, Any]) -> bool:
        directory = self.path.parent
        data = json.dumps(doc, sort_keys=True).encode("utf-8")
        partial: str | None = None
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, partial = tempfile.mkstemp(prefix=".state-", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            Path(partial).replace(self.path)
            partial = None
            _fsync_dir(directory)  # the rename itself survives a power cut
        except OSError as exc:
            log.warning("state_file_write_failed", path=str(self.path), error=exc.strerror)
            self.write_error = f"cannot write {self.path}: {exc.strerror}"
            return False
        finally:
            if partial is not None:
                with contextlib.suppress(OSError):
                    Path(partial).unlink()
        self.write_error = None
        return True


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class EnginePauseRecord:
    """The state file's note about one engine: paused by kvguard, or not."""

    def __init__(self, state: StateFile, engine_url: str) -> None:
        self.state = state
        self.engine_url = engine_url

    @classmethod
    def from_environment(
        cls, engine_url: str, env: Mapping[str, str] | None = None
    ) -> EnginePauseRecord:
        """The record for ``engine_url`` in the state file the environment chooses."""
        return cls(StateFile.from_environment(env), engine_url)

    @property
    def paused(self) -> bool:
        """Whether the file says kvguard left this engine paused."""
        return self.state.engine_paused(self.engine_url)

    @property
    def write_error(self) -> str | None:
        """Why the last note could not be written (path and reason); None when it was."""
        return self.state.write_error

    def mark(self, paused: bool) -> bool:
        """Record a pause about to be sent (True) or a resume that worked (False).

        Returns whether the note is on disk. :class:`~kvguard.actuators.engine_admin.EngineAdmin`
        sends no pause when it is not: a kvguard killed while holding the engine
        paused would leave its successor no note to resume it by.
        """
        return self.state.set_engine_paused(self.engine_url, paused)
