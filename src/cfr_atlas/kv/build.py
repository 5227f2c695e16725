"""What besides the model decides the bits of cached K/V: this package's version and the build
of the kernels that computed them.

`kernel_fingerprint()` names the Python implementation and version, the machine, NumPy,
numba and llvmlite versions, numba's optimization level, and the CPU numba compiles for (its
name and a digest of the enabled feature flags; `NUMBA_CPU_NAME` / `NUMBA_CPU_FEATURES`
override the host's, exactly as numba does). Another value for any of them may round a kernel
differently, so `CacheSignature` carries the fingerprint and a block made under another one
is a miss, never a hit. `package_version()` is the installed version plus a digest of the
package's own Python sources, so an edited checkout (editable installs keep reporting one
version) never reuses blocks made by other code. Both are computed once per process; tests
monkeypatch them (`CacheSignature` looks them up at construction time). No K/V hashing here.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sys

UNKNOWN_VERSION = "0+unknown"


@functools.cache
def package_version() -> str:
    """'<installed version>+src.<digest of the sources>' ("0+unknown" without metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("cfr-atlas")
    except PackageNotFoundError:
        installed = UNKNOWN_VERSION
    return f"{installed}+src.{source_digest()}"


def source_digest(root=None) -> str:
    """SHA-256 (16 hex digits) of every .py file of this package: relative path and bytes,
    in sorted order. About 100 small files: a few milliseconds, once per process."""
    from pathlib import Path

    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def kernel_fingerprint() -> str:
    """One line naming everything that decides the kernels' machine code (module docstring)."""
    import llvmlite
    import llvmlite.binding as ll
    import numba
    import numpy

    cpu = numba.config.CPU_NAME or ll.get_host_cpu_name()
    features = numba.config.CPU_FEATURES or ll.get_host_cpu_features().flatten()
    enabled = ",".join(sorted(f for f in features.split(",") if f.startswith("+")))
    digest = hashlib.sha256(enabled.encode()).hexdigest()[:16]
    return (f"{sys.implementation.name} {platform.python_version()} {platform.machine()} "
            f"numpy {numpy.__version__} numba {numba.__version__} opt {int(numba.config.OPT)} "
            f"llvmlite {llvmlite.__version__} cpu {cpu} features {digest}")
