"""One storage room for the cache: local folders and URLs (``gs://``, ``s3://``...) behind one small API.

Both sides of the cache use it: the builder writes through :class:`Store` (atomic
publish, listing, the build lock) and the reader fetches shards through it
(whole-object downloads checked against the manifest's crc32, retried with backoff).

* A local path goes through :mod:`os` and :mod:`pathlib`; nothing new is imported.
* A URL goes through `fsspec <https://filesystem-spec.readthedocs.io>`_ (``gcsfs`` for
  ``gs://``, ``s3fs`` for ``s3://``), imported on first use only. A string that looks
  like a URL but names no installed protocol raises :class:`ImportError` naming the
  package to install; it is never taken for a local folder.

Publishing: a local file is written to ``NAME.tmp-PID``, fsynced and renamed; an object
is uploaded to ``NAME.tmp-TOKEN``, copied to ``NAME`` and the temporary object removed,
so a reader never sees a half-written shard under its final name. Object stores have
no rename and no ``flock``: the build lock is an object created with
``ifGenerationMatch=0`` (gcsfs ``mode="create"``), read back to check its owner, and
refreshed by a heartbeat so that a killed build's lock goes stale.

Only the standard library and :mod:`xla_utils.cache.format` are imported here.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..utils.atomic import atomic_writer
from .format import MANIFEST, parse_manifest, read_manifest

__all__ = ["is_url", "Store", "StorageError", "LockedError", "filesystem", "install_hint", "load_manifest",
           "retry", "crc32_file", "LOCK_STALE_S"]

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# Package that gives fsspec each protocol, and the pip command to get it.
_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs", "abfs": "adlfs",
             "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp", "hf": "huggingface_hub"}
_EXTRAS = {"gcsfs": "xla_utils[gcs]"}
# A lock object not refreshed for this long belongs to a build that died.
LOCK_STALE_S = 120.0
_HEARTBEAT_S = 20.0
_TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}
_FILESYSTEMS: dict[tuple[str, int], Any] = {}
# Seconds after which a build that wrote the lock reads it again (see Store._take_lock).
_LOCK_CONFIRM_S = 0.5


class StorageError(OSError):
    """A bucket, object or credential problem; the message names the URL and the fix."""


class LockedError(StorageError):
    """Another build holds the lock of a cache (the message names it and when it was last alive)."""


def is_url(path: Any) -> bool:
    """True for a string with a protocol, ``gs://bucket/x`` style (``file://`` included)."""
    return isinstance(path, str) and bool(_URL.match(path))


def install_hint(protocol: str) -> str:
    """The pip command that adds ``protocol`` to fsspec, e.g. ``pip install 'xla_utils[gcs]'``."""
    pkg = _PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
    extra = _EXTRAS.get(pkg)
    return f"pip install '{extra}' (or pip install {pkg})" if extra else f"pip install fsspec {pkg}"


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it (``bucket/key``, no protocol).

    Raises:
        ImportError: fsspec or the protocol's package is missing; the message names the
            URL and the pip command.
    """
    m = _URL.match(url)
    if not m:
        raise ValueError(f"{url!r} is not a URL")
    protocol = m.group(1).lower()
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"{url} is a {protocol}:// URL, which needs fsspec: {install_hint(protocol)}") from None
    creds = _credential_settings(protocol, fsspec.config.conf)
    key = (protocol, os.getpid(), creds)  # one per process (fsspec's async filesystems are not fork-safe)
    fs = _FILESYSTEMS.get(key)  # and per credential setting: a new one is checked before use
    if fs is None:
        problem = _credentials_problem(url, creds)
        if problem is not None:
            raise problem
        try:
            fs = _FILESYSTEMS[key] = fsspec.filesystem(protocol, skip_instance_cache=True)
        except (ImportError, ValueError) as e:
            raise ImportError(f"{url} is a {protocol}:// URL but that protocol is not installed ({e}): "
                              f"{install_hint(protocol)}") from None
        except Exception as e:
            err = _explain(url, e)
            if err is None:
                raise
            raise err from e
    return fs, fs._strip_protocol(url)


_FIX_CREDENTIALS = ("`gcloud auth application-default login`, or GOOGLE_APPLICATION_CREDENTIALS=KEY.json (a "
                    "service-account key); on Kaggle attach a Google Cloud account under Add-ons > Google Cloud "
                    "Services; on Colab `from google.colab import auth; auth.authenticate_user()`")


def _credential_settings(protocol: str, conf: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The settings that name a credentials file for ``protocol``: ``GOOGLE_APPLICATION_CREDENTIALS``
    and a ``token`` path in fsspec's configuration (``FSSPEC_GCS_TOKEN``); GCS only."""
    if _PACKAGES.get(protocol) != "gcsfs":
        return ()
    found = []
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        found.append(("GOOGLE_APPLICATION_CREDENTIALS", os.environ["GOOGLE_APPLICATION_CREDENTIALS"]))
    for proto in ("gs", "gcs"):
        token = (conf.get(proto) or {}).get("token")
        if isinstance(token, str) and (token.endswith(".json") or "/" in token or os.sep in token):
            found.append((f"fsspec's {proto} token setting (FSSPEC_{proto.upper()}_TOKEN)", token))
    return tuple(found)


def _credentials_problem(url: str, settings: Sequence[tuple[str, str]]) -> StorageError | None:
    """A :class:`StorageError` naming ``url``, the setting and the fix when a credentials file that a
    setting names is missing or is not a Google credentials JSON (gcsfs would otherwise go on
    anonymously, or send the path as a token, and fail later with a less clear error)."""
    for what, value in settings:
        path = Path(value).expanduser()
        if not path.is_file():
            problem = "names no file"
        else:
            try:
                body = json.loads(path.read_text())
                problem = None if isinstance(body, dict) and "type" in body else "is not a Google credentials file"
            except (OSError, ValueError):
                problem = "is not a Google credentials file (not JSON)"
        if problem:
            return StorageError(f"no credentials for {url}: {what}={value} {problem}. Fix: point it at the key "
                                f"file, or unset it and use {_FIX_CREDENTIALS}")
    return None


def _http_code(e: BaseException) -> int | None:
    for attr in ("code", "status", "status_code"):
        v = getattr(e, attr, None)
        if isinstance(v, int):
            return v
    return None


def _transient(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, PermissionError, StorageError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    code = _http_code(e)
    if code is not None:
        return code in _TRANSIENT_HTTP
    name = type(e).__name__
    return name in ("ClientPayloadError", "ServerDisconnectedError", "ClientOSError", "ChecksumError",
                    "ClientConnectionError", "ServerTimeoutError", "IncompleteRead", "TransferEncodingError")


def retry(fn: Callable[[], Any], what: str, attempts: int = 5, base_delay: float = 0.5) -> Any:
    """``fn()``, retried with exponential backoff (0.5, 1, 2, 4 s) on transient errors.

    Transient: connection drops and timeouts, HTTP 408/429/5xx, a checksum mismatch.
    Other errors, and the last attempt's, are raised as they are.

    Args:
        fn: the operation.
        what: its description, for the error after the last attempt.
        attempts: tries in all. Default 5.
        base_delay: the first wait in seconds. Default 0.5.
    """
    for k in range(attempts):
        try:
            return fn()
        except Exception as e:
            if k == attempts - 1 or not _transient(e):
                if k and _transient(e) and not isinstance(e, ChecksumError):
                    raise StorageError(f"{what} failed {attempts} times, the last with {type(e).__name__}: "
                                       f"{e}; the storage or the network is unreliable: rerun later") from e
                raise
            time.sleep(base_delay * 2 ** k)
    raise AssertionError("unreachable")


class ChecksumError(IOError):
    """A download whose size or crc32 differs from the manifest (retried as transient)."""


def crc32_file(path: str | os.PathLike) -> int:
    """crc32 of a local file, read in 8 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _explain(url: str, e: BaseException) -> StorageError | None:
    """A :class:`StorageError` naming ``url`` and the fix for a missing bucket or credentials."""
    text = f"{type(e).__name__}: {e}"
    code = _http_code(e)
    if code in (401, 403) or "credential" in text.lower() or "Anonymous caller" in text:
        return StorageError(
            f"no access to {url} ({text[:200]}): give this machine credentials ({_FIX_CREDENTIALS}) "
            "and check that the account may read/write the bucket")
    return None


class Store:
    """A cache location, local folder or URL prefix, and the few operations the cache needs.

    Picklable (process-pool and Ray workers reopen the filesystem on first use).

    Args:
        root: a folder (``~`` expanded) or a URL such as ``gs://bucket/caches/train``.
    """

    def __init__(self, root: str | os.PathLike):
        self.is_url = is_url(root)
        if self.is_url:
            self.root = str(root).rstrip("/")
            filesystem(self.root)  # a clear ImportError now rather than in a worker
        else:
            self.root = str(Path(root).expanduser().resolve())
        self._fs: Any = None
        self._key = ""

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "is_url": self.is_url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.root, self.is_url, self._fs, self._key = state["root"], state["is_url"], None, ""

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    def __str__(self) -> str:
        return self.root

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (URLs only; one per process, also after a fork)."""
        self._fs, self._key = filesystem(self.root)
        return self._fs

    @property
    def name(self) -> str:
        """The last component of the root (``train`` for ``gs://b/caches/train``)."""
        return self.root.rstrip("/").rsplit("/", 1)[-1]

    def path(self, name: str = "") -> str:
        """The full path or URL of ``name`` inside the root."""
        return f"{self.root}/{name}" if name else self.root

    def local(self, name: str = "") -> Path:
        """``name`` as a local :class:`Path` (local roots only)."""
        assert not self.is_url, self.root
        return Path(self.root, name) if name else Path(self.root)

    def _k(self, name: str = "") -> str:
        self.fs  # noqa: B018 (sets _key)
        return f"{self._key}/{name}" if name else self._key

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return retry(fn, what)
        except (FileNotFoundError, StorageError):
            raise
        except Exception as e:
            err = _explain(self.path(), e)
            if err is None:
                raise
            raise err from e

    # ----------------------------------------------------------------- reading

    def check(self) -> None:
        """Raise a :class:`StorageError` naming the URL and the fix if its bucket cannot be reached."""
        if not self.is_url:
            return
        bucket = self._k().split("/", 1)[0]
        try:
            ok = self._call(lambda: self.fs.exists(bucket), f"checking {self.root}")
        except FileNotFoundError:
            ok = False
        if not ok:
            proto = self.root.split("://", 1)[0]
            raise StorageError(f"the bucket of {self.root} ({proto}://{bucket}) does not exist or this machine "
                               f"may not see it: check the name (`gcloud storage ls {proto}://{bucket}`), create "
                               f"it (`gcloud storage buckets create {proto}://{bucket}`), or check the credentials")

    def exists(self, name: str = "") -> bool:
        """Whether ``name`` (or, for ``""``, the root folder / any object under the prefix) exists."""
        if not self.is_url:
            return self.local(name).exists()
        if not name:
            return bool(self.listdir())
        return bool(self._call(lambda: self.fs.exists(self._k(name)), f"checking {self.path(name)}"))

    def entries(self) -> dict[str, dict[str, Any]]:
        """``{name: info}`` of what is directly in the root (nothing when it does not exist).

        ``info["size"]`` is the size in bytes (-1 for a folder); object stores add their
        metadata (GCS: ``crc32c``, ``generation``).
        """
        if not self.is_url:
            root = self.local()
            if not root.is_dir():
                return {}
            return {p.name: {"size": p.stat().st_size if p.is_file() else -1} for p in root.iterdir()}
        try:
            found = self._call(lambda: self.fs.ls(self._k(), detail=True, refresh=True), f"listing {self.root}")
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]:
                dict(e, size=int(e.get("size") or 0) if e.get("type") != "directory" else -1) for e in found}

    def sizes(self) -> dict[str, int]:
        """``{name: bytes}`` of what is directly in the root (-1 for a folder)."""
        return {k: v["size"] for k, v in self.entries().items()}

    def listdir(self) -> list[str]:
        """Sorted names of what is directly in the root."""
        return sorted(self.sizes())

    def info(self, name: str) -> dict[str, Any]:
        """Object metadata of ``name`` (``size``; for GCS also ``crc32c``, ``generation``)."""
        if not self.is_url:
            return {"size": self.local(name).stat().st_size}
        return self._call(lambda: self.fs.info(self._k(name)), f"reading {self.path(name)}")

    def read_bytes(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``name`` (the whole file by default)."""
        if not self.is_url:
            with open(self.local(name), "rb") as f:
                f.seek(start or 0)
                return f.read() if end is None else f.read(end - (start or 0))
        return self._call(lambda: self.fs.cat_file(self._k(name), start=start, end=end),
                          f"reading {self.path(name)}")

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Several byte ranges of ``name`` in one parallel request batch."""
        if not self.is_url:
            return [self.read_bytes(name, a, b) for a, b in ranges]
        n = len(ranges)
        return self._call(lambda: self.fs.cat_ranges([self._k(name)] * n, [a for a, _ in ranges],
                                                     [b for _, b in ranges]), f"reading {self.path(name)}")

    def crc32(self, name: str) -> int:
        """crc32 of ``name``, streamed in 8 MiB blocks (nothing kept on disk)."""
        if not self.is_url:
            return crc32_file(self.local(name))

        def once() -> int:
            crc = 0
            with self.fs.open(self._k(name), "rb", block_size=8 << 20) as f:
                while chunk := f.read(8 << 20):
                    crc = zlib.crc32(chunk, crc)
            return crc

        return self._call(once, f"reading {self.path(name)}")

    def download(self, name: str, dest: str | os.PathLike, nbytes: int | None = None,
                 crc32: int | None = None) -> None:
        """Copy ``name`` to the local file ``dest``, atomically, checked against ``nbytes``/``crc32``.

        A short or corrupt download (size or crc32 differ) is fetched again with backoff;
        if it stays wrong, :class:`ChecksumError` names the object and the fix.
        """
        dest = Path(dest)
        part = dest.with_name(f"{dest.name}.part-{os.getpid()}-{threading.get_ident()}")

        def once() -> None:
            try:
                if self.is_url:
                    self.fs.get_file(self._k(name), str(part))
                else:
                    shutil.copyfile(self.local(name), part)
                got = part.stat().st_size
                if nbytes is not None and got != nbytes:
                    raise ChecksumError(f"{self.path(name)}: downloaded {got} bytes, the manifest says {nbytes}")
                if crc32 is not None and crc32_file(part) != crc32:
                    raise ChecksumError(f"{self.path(name)}: crc32 of the download differs from the manifest")
                os.replace(part, dest)
            finally:
                with contextlib.suppress(OSError):
                    part.unlink()

        try:
            self._call(once, f"downloading {self.path(name)}")
        except ChecksumError as e:
            raise StorageError(f"{e} after several downloads: the object is damaged; run `tpu_cache_ds verify "
                               f"{self.root}` and rerun the build command to rebuild it") from None

    # ----------------------------------------------------------------- writing

    def mkdir(self) -> None:
        """Create the root folder (URLs: check the bucket; object stores need no folders)."""
        if self.is_url:
            self.check()
        else:
            self.local().mkdir(parents=True, exist_ok=True)

    def remove(self, name: str) -> None:
        """Delete ``name`` if it exists."""
        if not self.is_url:
            with contextlib.suppress(FileNotFoundError):
                self.local(name).unlink()
            return
        with contextlib.suppress(FileNotFoundError):
            self._call(lambda: self.fs.rm_file(self._k(name)), f"deleting {self.path(name)}")

    def write(self, name: str, chunks: Sequence[Any]) -> tuple[int, int]:
        """Publish ``chunks`` (bytes or arrays) as ``name``: it appears only complete.

        Returns:
            ``(bytes written, crc32 of them)``.
        """
        if not self.is_url:
            return _write_local(self.local(name), chunks)
        tmp = f"{name}.tmp-{secrets.token_hex(6)}"

        def upload() -> tuple[int, int]:
            crc, n = 0, 0
            with self.fs.open(self._k(tmp), "wb") as f:
                for c in chunks:
                    if not len(c):
                        continue
                    mv = memoryview(c).cast("B") if not isinstance(c, bytes) else c
                    f.write(mv)
                    crc, n = zlib.crc32(mv, crc), n + len(mv)
            return n, crc

        try:
            n, crc = self._call(upload, f"uploading {self.path(tmp)}")
            self._call(lambda: self.fs.copy(self._k(tmp), self._k(name)), f"publishing {self.path(name)}")
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm_file(self._k(tmp))
        return n, crc

    def free_bytes(self) -> int | None:
        """Free space of the root's disk (its nearest existing parent); None for URLs."""
        if self.is_url:
            return None
        p = self.local()
        while not p.exists() and p != p.parent:
            p = p.parent
        return shutil.disk_usage(p).free

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the URL prefix's build lock (``.lock``) for the ``with`` block.

        Raises:
            LockedError: another live build holds it.
        """
        assert self.is_url, "local folders lock with flock (builder)"
        token = secrets.token_hex(8)
        self._take_lock(token)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(_HEARTBEAT_S):
                with contextlib.suppress(Exception):
                    self.fs.pipe_file(self._k(".lock"), self._lock_body(token))

        t = threading.Thread(target=beat, daemon=True, name="xla_utils-lock-heartbeat")
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            with contextlib.suppress(Exception):
                if json.loads(self.fs.cat_file(self._k(".lock"))).get("token") == token:
                    self.fs.rm_file(self._k(".lock"))

    @staticmethod
    def _lock_body(token: str) -> bytes:
        return json.dumps({"token": token, "host": socket.gethostname(), "pid": os.getpid(),
                           "time": time.time()}).encode()

    def _take_lock(self, token: str) -> None:
        key = self._k(".lock")
        try:
            held = json.loads(self.fs.cat_file(key))
        except FileNotFoundError:
            held = None
        except ValueError:  # a lock cut short: whoever wrote it died
            held = {"time": 0}
        if held is not None:
            age = time.time() - float(held.get("time", 0))
            dead_here = held.get("host") == socket.gethostname() and not _pid_alive(held.get("pid"))
            if age < LOCK_STALE_S and not dead_here:
                raise LockedError(
                    f"another build is writing {self.root} (its lock {self.path('.lock')} was refreshed "
                    f"{age:.0f} s ago by process {held.get('pid')} on {held.get('host')}): wait for it to "
                    f"finish, or, if it is dead, wait {LOCK_STALE_S:.0f} s for the lock to go stale")
            self.fs.rm_file(key)
        try:
            self.fs.pipe_file(key, self._lock_body(token), mode="create")  # ifGenerationMatch=0
        except (FileExistsError, OSError) as e:
            if isinstance(e, FileExistsError) or _http_code(e) == 412:
                raise LockedError(f"another build took the lock {self.path('.lock')} of {self.root} just now") from e
            raise
        # Stores that ignore the precondition (emulators): the last of two writers racing for
        # the lock wins; read it again after a moment, so that the first one sees it lost.
        for pause in (0.0, _LOCK_CONFIRM_S):
            time.sleep(pause)
            if json.loads(self.fs.cat_file(key)).get("token") != token:
                raise LockedError(f"another build took the lock {self.path('.lock')} of "
                                  f"{self.root} just now")


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _write_local(path: Path, chunks: Sequence[Any]) -> tuple[int, int]:
    """Write ``chunks`` to ``path`` via temp file + fsync + rename; the temp file goes on failure."""
    crc, nbytes = 0, 0
    with atomic_writer(path) as f:
        for c in chunks:
            if not len(c):  # an empty slab (every image of the shard skipped) cannot be cast
                continue
            mv = memoryview(c).cast("B") if not isinstance(c, bytes) else c
            f.write(mv)
            crc = zlib.crc32(mv, crc)
            nbytes += len(mv)
    return nbytes, crc


def load_manifest(path: str | os.PathLike | Store) -> dict[str, Any]:
    """:func:`~xla_utils.cache.format.read_manifest` for a folder or a URL prefix.

    Raises:
        FileNotFoundError: no manifest there (the message names the URL and how to build one).
        StorageError: the bucket or the credentials are missing.
        ValueError: as :func:`~xla_utils.cache.format.read_manifest`.
    """
    store = path if isinstance(path, Store) else Store(path) if is_url(path) else None
    if store is None or not store.is_url:
        return read_manifest(store.root if store is not None else path)
    store.check()
    try:
        text = store.read_bytes(MANIFEST)
    except FileNotFoundError:
        raise FileNotFoundError(f"{store.root} holds no xla_utils image cache (no {store.path(MANIFEST)}): check "
                                f"the URL, or build the cache first: build_cache(SRC, {store.root!r}) or "
                                f"`tpu_cache_ds build SRC {store.root}`") from None
    return parse_manifest(text, store.path(MANIFEST))
