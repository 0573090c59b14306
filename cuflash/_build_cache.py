"""The one content-addressed cache of everything cuflash compiles: NVRTC cubins, simulator libraries and the JAX
FFI handler library. Each caller says how to build and what it stores; this module does the rest.

Key (content_key): a hash of the caller's tag, the toolchain's identity, the build options and the text of
exactly the files the build reads: its entry sources and every file they #include, transitively, that resolves
beside the includer or in the build's include folders (include_closure). Includes that resolve nowhere there
are the toolchain's own headers, covered by its identity. Editing a file no build includes changes no key.

Entry (BuildCache, under cache_dir(kind)): the artifact files under their own names, and ``<entry>.json``, the
manifest, written last: this module's format, each artifact's sha256 and the caller's details. An entry counts
only when its manifest is whole and of this format and every artifact still has its recorded hash; anything
else (a build killed half-way, a truncated or overwritten file) is rebuilt. A build runs in a private temporary
folder under an ``fcntl.flock`` lock of its entry (``locks/<entry>.lock``), so concurrent processes and threads
build once while the others wait and then read it; artifacts move into place with ``os.replace``, so no file
is ever half-written under its final name.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ._paths import cache_dir

# Bump when the manifest's layout or meaning changes: entries of another format are rebuilt.
FORMAT = "cuflash-build-cache-1"


# ---- the host C++ compiler (the simulator and the FFI handlers are both built with it) -----------------------


def compiler() -> str:
    return os.environ.get("CXX", "g++")


@functools.lru_cache(maxsize=None)
def compiler_identity(cxx: str) -> str:
    """The compiler's version line: part of every key of a g++ build."""
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0] if out else cxx


# ---- what a build reads --------------------------------------------------------------------------------------

# path -> (stat signature, value): a file is read again only after it changed, so computing a key (the simulator
# does it at every launch) costs a stat per included file.
_digests: dict[Path, tuple[tuple[int, int, int], str]] = {}
_includes: dict[Path, tuple[tuple[int, int, int], tuple[tuple[str, bool], ...] | None]] = {}
_memo_lock = threading.Lock()

# An #include line: "quoted", <angled>, or anything else (a macro, which cannot be followed without a preprocessor).
_INCLUDE_RE = re.compile(
    r'^[ \t]*#[ \t]*include[ \t]*(?:"(?P<quoted>[^"]+)"|<(?P<angled>[^>]+)>|(?P<other>\S.*))', re.MULTILINE)


def _signature(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _memoized(memo: dict, path: Path, compute: Callable[[Path], Any]) -> Any:
    signature = _signature(path)
    with _memo_lock:
        found = memo.get(path)
    if found is not None and found[0] == signature:
        return found[1]
    value = compute(path)
    with _memo_lock:
        memo[path] = (signature, value)
    return value


def file_digest(path: Path) -> str:
    return _memoized(_digests, path, lambda p: hashlib.sha256(p.read_bytes()).hexdigest())


def _read_includes(path: Path) -> tuple[tuple[str, bool], ...] | None:
    """(name, quoted) of every #include in the file, or None if one names its file through a macro.

    Includes inside #if branches and comments count too: a key may cover a file the build skips (a needless
    rebuild when it changes), never miss one it reads."""
    found = []
    for match in _INCLUDE_RE.finditer(path.read_text(errors="replace")):
        if match["other"] is not None:
            return None
        found.append((match["quoted"] or match["angled"], match["quoted"] is not None))
    return tuple(found)


def include_closure(sources: Iterable[Path], include_dirs: Sequence[Path]) -> list[Path]:
    """The sources and every file they #include, transitively: a "quoted" name beside its includer first (as g++,
    nvcc and NVRTC look), then, like an <angled> one, in include_dirs. A name found in neither is the toolchain's
    own header. An include through a macro could name any file: then every file under the includer's folder and
    the include folders counts."""
    seen: dict[Path, None] = {}
    stack = [Path(os.path.normpath(source)) for source in sources]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen[path] = None
        includes = _memoized(_includes, path, _read_includes)
        if includes is None:
            stack += (p for folder in (path.parent, *include_dirs) for p in Path(folder).rglob("*") if p.is_file())
            continue
        for name, quoted in includes:
            for folder in ([path.parent] if quoted else []) + list(include_dirs):
                candidate = Path(folder) / name
                if candidate.is_file():
                    stack.append(Path(os.path.normpath(candidate)))
                    break
    return sorted(seen)


def content_key(tag: str, *, toolchain: str, options: Sequence[str], sources: Sequence[Path],
                include_dirs: Sequence[Path], extra: Sequence[str] = ()) -> str:
    """The key of a build: `tag` names the caller's kind of artifact (bump it when the way it builds changes),
    `toolchain` identifies the compiler, `options` are its flags, `sources` the entry files compiled with
    `include_dirs`, and `extra` anything else the artifact depends on (kernel names, a dependency's entry)."""
    files = [(str(path), file_digest(path)) for path in include_closure(sources, include_dirs)]
    parts = {"format": FORMAT, "tag": tag, "toolchain": toolchain, "options": list(options), "files": files,
             "extra": list(extra)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# ---- entries on disk -----------------------------------------------------------------------------------------


def write_atomically(path: Path, data: bytes) -> None:
    """Write `path` through a private temporary file moved into place: readers see the old file or the new one."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


@dataclass(frozen=True)
class Entry:
    paths: tuple[Path, ...]  # the artifacts, in the order the build was asked for them
    details: Any  # what the build returned, kept in the manifest


class BuildCache:
    """The entries of one kind of artifact, under cache_dir(kind) (read at each call: tests move it)."""

    def __init__(self, kind: str):
        self.kind = kind
        # manifest path -> signatures of it and its artifacts when their hashes last matched: a hit in the same
        # process hashes a large library again only after a file changed.
        self._verified: dict[Path, tuple] = {}
        self._verified_lock = threading.Lock()

    def directory(self) -> Path:
        return cache_dir(self.kind)

    def lookup(self, entry: str) -> Entry | None:
        """The complete, intact entry, or None."""
        manifest_path = self.directory() / f"{entry}.json"
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest["format"] != FORMAT:
                return None
            paths = tuple(manifest_path.parent / name for name in manifest["artifacts"])
            signature = tuple(_signature(path) for path in (manifest_path, *paths))
            with self._verified_lock:
                verified = self._verified.get(manifest_path) == signature
            if not verified:
                if any(hashlib.sha256(path.read_bytes()).hexdigest() != digest
                       for path, digest in zip(paths, manifest["artifacts"].values())):
                    return None
                with self._verified_lock:
                    self._verified[manifest_path] = signature
            return Entry(paths, manifest["details"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def get(self, entry: str, artifacts: Sequence[str], build: Callable[[Path], Any]) -> Entry:
        """The entry, built first if it is missing or damaged: ``build(workdir)`` writes each named artifact into
        the empty folder workdir and returns the details (JSON) to keep with them. Whatever build raises, nothing
        is cached."""
        found = self.lookup(entry)
        if found is not None:
            return found
        directory = self.directory()
        locks = directory / "locks"
        locks.mkdir(exist_ok=True)
        with open(locks / f"{entry}.lock", "a+") as lock:  # closing it releases the lock
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = self.lookup(entry)  # built by whoever held the lock before us
            if found is not None:
                return found
            with tempfile.TemporaryDirectory(dir=directory, prefix=f".build-{entry}-") as workdir:
                details = build(Path(workdir))
                built = [Path(workdir) / name for name in artifacts]
                missing = [path.name for path in built if not path.is_file()]
                if missing:
                    raise RuntimeError(f"the build of cache entry {entry} did not write {', '.join(missing)}")
                digests = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in built}
                for path in built:
                    os.replace(path, directory / path.name)
            manifest = json.dumps({"format": FORMAT, "artifacts": digests, "details": details}, indent=1)
            write_atomically(directory / f"{entry}.json", manifest.encode())
        # The details as a later hit reads them back (JSON: tuples become lists), so a caller sees one shape.
        return Entry(tuple(directory / name for name in artifacts), json.loads(manifest)["details"])
