"""The on-disk cache of generated modules.

Triton's ``@jit`` reads kernel source through ``inspect``, so generated code must live in
a real file. Files are written atomically (temp file + rename); an entry that fails to
import is rebuilt, never trusted.
"""

from __future__ import annotations

import atexit
import hashlib
import linecache
import logging
import os
import shutil
import sys
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path


def switched_on(env: str, option: bool = True) -> bool:
    """``option``, unless the environment variable ``env`` says 0, false, off or no (the
    switches that turn the plan cache and the compile pool off from outside a program)."""
    return option and os.environ.get(env, "1").strip().lower() not in ("0", "false", "off", "no")


_STAND_INS: dict[str, Path] = {}  # a cache directory that cannot be written -> this process's temp one


def cache_dir() -> Path:
    """``EQFUSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/eqfuse`` or ``~/.cache/eqfuse``. Where
    it cannot be made or written, a temporary directory of this process stands in (removed
    at exit), with a warning: the compile runs uncached rather than in eager."""
    root = os.environ.get("EQFUSE_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "eqfuse")
    if root in _STAND_INS:
        return _STAND_INS[root]
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
        problem = "not writable"
    except OSError as e:
        problem = f"{type(e).__name__}: {e.strerror or e}"
    stand_in = _STAND_INS[root] = Path(tempfile.mkdtemp(prefix="eqfuse-"))
    atexit.register(shutil.rmtree, stand_in, True)
    logging.getLogger("eqfuse").warning("eqfuse: cache directory %s: %s; compiling into %s, uncached across runs",
                                        root, problem, stand_in)
    return stand_in


def cache_key(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def write_atomic(path: Path, data: str | bytes) -> None:
    """``data`` (text or bytes) written to ``path`` whole or not at all: readers, and other
    processes writing the same path, see one complete file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def _interpreter(on: bool):
    """Triton decides at decoration time whether a kernel is interpreted."""
    old = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    elif old is not None and old == "1":
        os.environ.pop("TRITON_INTERPRET")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def load_module(key: str, source: str, interpret: bool):
    """Write ``source`` under ``key`` (unless an identical file is there) and import it."""
    path = cache_dir() / f"eqfuse_{key}.py"
    try:
        if not path.exists() or path.read_text() != source:
            write_atomic(path, source)
    except OSError as e:  # the directory removed meanwhile: the module runs from memory all the same
        logging.getLogger("eqfuse").warning("eqfuse: could not write %s (%s)", path, e)
    name = f"eqfuse_generated_{key}_{'i' if interpret else 'g'}"
    if name in sys.modules:
        return sys.modules[name]
    if interpret:
        from . import interpreter_fixes
        interpreter_fixes.apply()
    else:
        from . import ptx_loops
        ptx_loops.install()
    # Made from ``source``, not read back from the file: Triton reads a kernel's source
    # through inspect, at decoration and (the interpreter) at each launch, and a cache
    # directory removed meanwhile left it none ("@jit functions should be defined in a
    # Python file"). linecache keeps the text under the file's name; an entry without a
    # modification time is never checked against the disk.
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    module = types.ModuleType(name)
    module.__file__ = str(path)
    with _interpreter(interpret):
        exec(compile(source, str(path), "exec"), module.__dict__)
    sys.modules[name] = module
    return module
