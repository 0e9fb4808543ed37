"""Checksums of a checkpoint file: what is recorded at save time and how a load verifies it.

The record (one JSON string in the safetensors ``__metadata__``) holds the digest algorithm, the
digest of the typed tree, every tensor's dtype, shape and digest of its raw bytes, and a digest of
the whole data section. The data-section digest is taken over the per-tensor digests in file order
(a hash list), so every byte is hashed exactly once yet any change anywhere in the data, or in the
order or set of tensors, changes it. Structural checks of the header live in ``framing``; this
module compares content. It must not import Lightning.

``xxh3-128`` (the default: ~13 GB/s on one core here, near memory speed; see benchmarks/RESULTS.md
"Checksum speed") and ``crc32`` (the default before it, ~3 GB/s) detect accidental damage (truncation,
flipped bits, torn writes); ``sha256`` is collision-resistant, for files that pass through hands you do
not control (no checksum without a key stops deliberate tampering); ``blake2b`` likewise. The algorithm
is recorded per file, so files written with any of them load and verify whatever the current default.

Every implementation here releases the GIL while it hashes a large buffer (measured on this machine:
hashing two halves of 600 MB in two threads takes 0.5-0.7x the time of one thread hashing all of it,
for xxh3-128, crc32, sha256 and blake2b alike), so a hashing thread overlaps with reads, copies and
writes on other threads. Hardware CRC32C (``google-crc32c``) was measured and not taken: it reaches
~10 GB/s but accepts only ``bytes`` (a copy of every tensor) and holds the GIL (two threads 1.6x slower).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any, Callable, Dict, Iterable, Literal, Mapping, Protocol, Tuple

import xxhash

from lightning_resume.errors import CheckpointCorruptError, ConfigurationError
from lightning_resume.format.framing import Entry, unique_keys

Algorithm = Literal["xxh3-128", "crc32", "sha256", "blake2b"]
DEFAULT_ALGORITHM: Algorithm = "xxh3-128"
"""The digest new files get unless told otherwise (``save_file``, ``SafetensorsCheckpointIO(checksum=)``)."""
RECORD_VERSION = 1  # unchanged by new algorithms: the record names its algorithm, readers look it up


class Hasher(Protocol):
    """A running digest: ``update`` with consecutive pieces of the bytes, then ``hexdigest``. Any split of
    the same bytes gives the same hex string as ``digest(algorithm, whole)``."""

    def update(self, data: Any) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC-32 as a running digest (zlib has no hasher object); 8 hex digits."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value & 0xFFFFFFFF:08x}"


def _crc32(data: Any) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


HASHERS: Dict[str, Callable[[], Hasher]] = {
    "xxh3-128": xxhash.xxh3_128,
    "crc32": _Crc32,
    "sha256": hashlib.sha256,
    "blake2b": lambda: hashlib.blake2b(digest_size=32),
}
"""Running digests by the name recorded in files; ``DIGESTS`` holds the one-shot form of each."""

DIGESTS: Dict[str, Callable[[Any], str]] = {
    "xxh3-128": xxhash.xxh3_128_hexdigest,
    "crc32": _crc32,
    "sha256": lambda b: hashlib.sha256(b).hexdigest(),
    "blake2b": lambda b: hashlib.blake2b(b, digest_size=32).hexdigest(),
}

ALGORITHMS: Tuple[str, ...] = tuple(HASHERS)
"""Every algorithm name this version reads and writes (CLI choices, plugin validation)."""


def hasher(algorithm: str) -> Hasher:
    """A fresh running digest of ``algorithm``; feeding it all the bytes in any chunking gives
    ``digest(algorithm, whole)``. Raises ``ConfigurationError`` naming the supported algorithms."""
    return _lookup(HASHERS, algorithm)()


def digest(algorithm: str, data: Any) -> str:
    """The hex digest of a bytes-like ``data`` (``bytes``, ``memoryview`` of contiguous memory) in one call."""
    return _lookup(DIGESTS, algorithm)(data)


def _lookup(table: Mapping[str, Any], algorithm: str) -> Any:
    try:
        return table[algorithm]
    except (KeyError, TypeError):
        raise ConfigurationError(
            "integrity", [f"algorithm={algorithm!r} is not supported; use one of {list(ALGORITHMS)}"]
        ) from None


def make_record(algorithm: str, tree_json: str, entries: Iterable[Entry], digests: Mapping[str, str]) -> str:
    """The integrity record as a JSON string; ``entries`` in file order."""
    ordered = list(entries)
    record = {
        "version": RECORD_VERSION,
        "algorithm": algorithm,
        "tree": digest(algorithm, tree_json.encode("utf-8")),
        "tensors": {e.name: [e.dtype, list(e.shape), digests[e.name]] for e in ordered},
        "data": digest(algorithm, "".join(digests[e.name] for e in ordered).encode("ascii")),
    }
    return json.dumps(record, separators=(",", ":"))


def parse_record(path: str, text: str) -> Dict[str, Any]:
    try:
        record = json.loads(text, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as err:
        raise CheckpointCorruptError(path, "integrity record is not valid JSON") from err
    if type(record) is not dict or record.get("version") != RECORD_VERSION:
        raise CheckpointCorruptError(path, "integrity record version", RECORD_VERSION, _get(record, "version"))
    if type(record.get("algorithm")) is not str or record["algorithm"] not in DIGESTS:
        raise CheckpointCorruptError(
            path,
            "integrity record names a digest algorithm this version does not know (written by a newer "
            f"lightning-resume? supported: {', '.join(ALGORITHMS)})",
            list(ALGORITHMS),
            record.get("algorithm"),
        )
    if (
        type(record.get("tensors")) is not dict
        or type(record.get("tree")) is not str
        or type(record.get("data")) is not str
    ):
        raise CheckpointCorruptError(path, "integrity record is missing tree/tensors/data digests")
    return record


def check_index(path: str, record: Mapping[str, Any], entries: Mapping[str, Entry]) -> None:
    """The header's tensors are exactly the recorded ones, with the recorded dtype and shape."""
    recorded = record["tensors"]
    for name in entries.keys() - recorded.keys():
        raise CheckpointCorruptError(path, f"tensor '{name}' is in the header but not in the integrity record")
    for name, spec in recorded.items():
        if name not in entries:
            raise CheckpointCorruptError(path, f"tensor '{name}' is missing from the file")
        if type(spec) is not list or len(spec) != 3:
            raise CheckpointCorruptError(path, f"tensor '{name}': integrity record entry malformed")
        entry = entries[name]
        if spec[0] != entry.dtype:
            raise CheckpointCorruptError(
                path, f"tensor '{name}': dtype differs from the recorded one", spec[0], entry.dtype
            )
        if spec[1] != list(entry.shape):
            raise CheckpointCorruptError(
                path, f"tensor '{name}': shape differs from the recorded one", spec[1], list(entry.shape)
            )


def verify_tree(path: str, record: Mapping[str, Any], tree_json: str) -> None:
    actual = digest(record["algorithm"], tree_json.encode("utf-8"))
    if actual != record["tree"]:
        raise CheckpointCorruptError(
            path, "checksum mismatch in the non-tensor state (typed JSON tree)", record["tree"], actual
        )


class DataCheck:
    """Checks the data section as it is read: each tensor's digest in file order, then the hash list.

    Feed each tensor's bytes with ``update`` (in one piece or in chunks of any size), then call
    ``end_tensor``; ``finish`` checks that every recorded tensor came and the whole-data digest. Every
    mismatch is a ``CheckpointCorruptError`` naming the tensor. Not thread-safe: one feeder at a time."""

    def __init__(self, path: str, record: Mapping[str, Any]) -> None:
        self.path, self._record = path, record
        self._algorithm = str(record["algorithm"])
        self._current = hasher(self._algorithm)
        self._parts: list[str] = []

    def update(self, data: Any) -> None:
        """The next bytes of the current tensor."""
        self._current.update(data)

    def end_tensor(self, entry: Entry, where: str = "") -> None:
        """All of ``entry``'s bytes were fed: compare its digest with the recorded one. ``where`` names the tensor
        in an error (default: its byte range in the data section)."""
        actual, expected = self._current.hexdigest(), self._record["tensors"][entry.name][2]
        self._current = hasher(self._algorithm)
        if actual != expected:
            where = where or f"tensor '{entry.name}' (data bytes {entry.begin}-{entry.end}, after the header)"
            raise CheckpointCorruptError(self.path, f"{where}: checksum mismatch", expected, actual)
        self._parts.append(actual)

    def finish(self) -> None:
        """Every recorded tensor was checked, and the digest over their digests matches."""
        recorded = len(self._record["tensors"])
        if len(self._parts) != recorded:
            raise CheckpointCorruptError(
                self.path, "tensors checked differ from the recorded ones", recorded, len(self._parts)
            )
        whole = digest(self._algorithm, "".join(self._parts).encode("ascii"))
        if whole != self._record["data"]:
            raise CheckpointCorruptError(self.path, "whole data-section digest mismatch", self._record["data"], whole)


def verify_data(
    path: str, record: Mapping[str, Any], pieces: Iterable[Tuple[Entry, Any]], where: Mapping[str, str] = {}
) -> None:
    """Check the data section from ``pieces``: ``(entry, bytes)`` for consecutive chunks of each tensor in
    file order, and ``(entry, None)`` after a tensor's last chunk (a tensor may come in one piece). ``where``:
    how an error names a tensor, by name, where not by its byte range (``DataCheck.end_tensor``)."""
    check = DataCheck(path, record)
    for entry, data in pieces:
        if data is None:
            check.end_tensor(entry, where.get(entry.name, ""))
        else:
            check.update(data)
    check.finish()


def _get(record: Any, key: str) -> Any:
    return record.get(key) if type(record) is dict else None
