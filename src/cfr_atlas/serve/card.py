"""`ModelCard`: what the server says about its one model — names, details, GGUF model_info.

Built once at start-up from the GGUF file the model was loaded from; the Ollama endpoints
(/api/tags, /api/show, /api/ps) and OpenAI's /v1/models read it. `model_info` carries the GGUF
metadata as Ollama reports it (large arrays such as the vocabulary as null unless verbose),
so clients can read the topology from `{arch}.block_count`, `{arch}.attention.head_count`, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import gguf

from cfr_atlas.errors import ModelNotFoundError
from cfr_atlas.models.gguf_io import GGUFFile

_BIG_ARRAY = 64  # arrays longer than this are reported as null unless verbose


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _parameter_size(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _quant_level(file_type) -> str:
    try:
        name = gguf.LlamaFileType(int(file_type)).name
    except (TypeError, ValueError):
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


@dataclass(frozen=True)
class ModelCard:
    name: str  # "tiny-llama:latest": the name clients must send
    path: str
    size: int  # file bytes
    digest: str  # the engine's content identity (SHA-256 of header + tensor table)
    modified_at: str
    details: dict
    metadata: dict  # every GGUF key -> value (arrays included)
    template: str
    context_length: int

    @classmethod
    def from_model(cls, model, name: str | None = None) -> ModelCard:
        gf = GGUFFile(model.path)
        meta = {k: f.contents() for k, f in gf.reader.fields.items() if not k.startswith("GGUF.")}
        arch = meta.get("general.architecture", model.config.arch)
        meta.setdefault("general.parameter_count",
                        sum(int(t.n_elements) for t in gf.reader.tensors))
        stat = gf.path.stat()
        if name is None:
            name = gf.path.name.removesuffix(".gguf").lower()
        return cls(
            name=name if ":" in name else name + ":latest",
            path=str(gf.path), size=stat.st_size, digest=model.identity,
            modified_at=rfc3339(datetime.fromtimestamp(stat.st_mtime, UTC)),
            details={"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
                     "parameter_size": _parameter_size(meta["general.parameter_count"]),
                     "quantization_level": _quant_level(meta.get("general.file_type"))},
            metadata=meta, template=model.chat_template.template,
            context_length=model.config.context_length)

    def resolve(self, requested: str) -> str:
        """The served name if `requested` names this model ("x" means "x:latest")."""
        wanted = requested if ":" in requested else requested + ":latest"
        if wanted.lower() != self.name.lower():
            raise ModelNotFoundError(f"model {requested!r} not found; this server serves "
                                     f"{self.name!r}")
        return self.name

    def model_info(self, verbose: bool = False) -> dict:
        return {k: (None if isinstance(v, list) and len(v) > _BIG_ARRAY and not verbose else v)
                for k, v in self.metadata.items()}

    def summary(self) -> dict:
        """One entry of /api/tags."""
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at,
                "size": self.size, "digest": self.digest, "details": self.details}
