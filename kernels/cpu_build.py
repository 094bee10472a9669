"""Building the C kernels for the CPU: each source under kernels/csrc/ is compiled with the system C compiler on
first use (about a second) into a cache directory and loaded with ctypes (kernels/cpu_attention.py: the paged
decode; kernels/cpu_ops.py: the fused elementwise ops).

A build is keyed by the source, the flags, the compiler and the CPU's feature flags (the sources use
-march=native), so a cache directory shared by different machines keeps one library per machine kind. Ranks
starting together may compile at once: each writes its own temporary file and renames it into place.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC")


class BuildError(RuntimeError):
    """The C kernels could not be compiled or loaded; the message says why and what to do."""


def cache_dir() -> Path:
    """Where built libraries go: $AFSERVE_CACHE_DIR, else $XDG_CACHE_HOME/afserve, else ~/.cache/afserve."""
    if os.environ.get("AFSERVE_CACHE_DIR"):
        return Path(os.environ["AFSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "afserve"


def _compiler() -> list[str]:
    """The compiler command: $CC (split like a shell word list, e.g. "ccache gcc"), else cc, gcc or clang."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise BuildError("kernel backend 'cpu' needs a C compiler (cc, gcc or clang on PATH, or $CC); install one "
                         "or use kernel_backend='sdpa'")
    return [cc]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(source: Path, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """source compiled with flags (once per machine kind, source, the shared headers of kernels/csrc and flags)
    and loaded. Raises BuildError naming the cause."""
    cc = _compiler()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"kernel backend 'cpu': the C compiler {' '.join(cc)!r} does not run ({e}); set $CC or "
                         f"use kernel_backend='sdpa'") from e
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *flags, version, _cpu_flags()]).encode()
                         ).hexdigest()[:16]
    path = cache_dir() / f"{source.stem}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            try:
                done = subprocess.run([*cc, *flags, f"-I{CSRC}", "-o", tmp, str(source), "-lm", "-lpthread"],
                                      capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise BuildError(f"kernel backend 'cpu': compiling {source} failed ({e}); use kernel_backend='sdpa' "
                                 f"instead") from e
            if done.returncode != 0:
                raise BuildError(f"kernel backend 'cpu': compiling {source} with {' '.join(cc)} failed:\n"
                                 f"{done.stderr[-2000:]}\nuse kernel_backend='sdpa' instead")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(path))


def loads(library) -> bool:
    """Whether library() (a module's cached build and load) succeeds here."""
    try:
        library()
    except (BuildError, OSError):
        return False
    return True
