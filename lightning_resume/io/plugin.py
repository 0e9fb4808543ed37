"""``SafetensorsCheckpointIO``: the Lightning ``CheckpointIO`` hook over ``files``, ``atomic``, ``last``.

Thin by design: it validates options, cleans stale temporaries once per directory it touches, and
delegates. Its one decision is the "last" fallback: Lightning resolves ``ckpt_path="last"`` to the
newest ``last*.ckpt`` by mtime and hands that path to ``load_checkpoint``
(``lightning/pytorch/trainer/connectors/checkpoint_connector.py`` ``_parse_ckpt_path``); if that file
fails verification, the plugin loads the newest sibling checkpoint that verifies instead and warns
naming both. A file asked for by any other name is never substituted.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Dict, Literal, Optional, Set

import fsspec
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from lightning_resume.errors import CheckpointCorruptError, ConfigurationError
from lightning_resume.io import files
from lightning_resume.io.atomic import clean_stale_temporaries, is_local
from lightning_resume.io.integrity import DIGESTS
from lightning_resume.io.last import SkippedCheckpointWarning, is_last_name, newest_verified, sibling_checkpoints

log = logging.getLogger(__name__)


class SafetensorsCheckpointIO(CheckpointIO):
    """Pickle-free, atomic, checksummed checkpoints; reads legacy ``torch.save`` files weights-only.

    Args:
        verify: check every checksum when loading (on by default; ``False`` skips hashing the tensor
            bytes, the header is still fully validated).
        checksum: digest written into new files: ``"crc32"`` (default: fastest, catches accidental damage), ``"sha256"`` or ``"blake2b"``.
        fallback_to_verified: when a ``last*.ckpt`` file fails verification on load, load the newest
            sibling checkpoint that verifies (with a warning) instead of failing.
        mmap: load tensors as copy-on-write views of the file instead of copies: no extra memory and
            no read copy, but the file's disk space stays in use while any loaded tensor lives (the
            optimizer keeps its loaded moments for the whole run), even after the file is deleted.
    """

    def __init__(
        self,
        verify: bool = True,
        checksum: Literal["crc32", "sha256", "blake2b"] = "crc32",
        fallback_to_verified: bool = True,
        mmap: bool = False,
    ) -> None:
        problems = []
        if checksum not in DIGESTS:
            problems.append(f"checksum={checksum!r} is not supported; use one of {sorted(DIGESTS)}")
        if not isinstance(verify, bool):
            problems.append(f"verify={verify!r} must be True or False")
        if problems:
            raise ConfigurationError("SafetensorsCheckpointIO", problems)
        self.verify = verify
        self.checksum = checksum
        self.fallback_to_verified = fallback_to_verified
        self.mmap = mmap
        self._cleaned: Set[str] = set()

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"SafetensorsCheckpointIO.save_checkpoint takes no storage_options (got {storage_options!r})")
        self._clean_once(str(path))
        files.save_file(checkpoint, str(path), algorithm=self.checksum)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Load ``path`` (our format or a legacy ``torch.save`` file, decided by content).

        ``weights_only`` is accepted for signature compatibility and ignored: legacy files are always
        read with ``weights_only=True``, and our format never runs code.
        """
        path = str(path)
        fs, fs_path = fsspec.core.url_to_fs(path)
        if not fs.exists(fs_path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        self._clean_once(path)
        try:
            return files.load_file(path, verify=self.verify, map_location=map_location, mmap=self.mmap).checkpoint
        except CheckpointCorruptError as err:
            fallback = self._fallback_for(path, err)
            if fallback is None:
                raise
            return files.load_file(fallback, verify=False, map_location=map_location, mmap=self.mmap).checkpoint

    def _fallback_for(self, path: str, err: CheckpointCorruptError) -> Optional[str]:
        if not (self.fallback_to_verified and is_last_name(path)):
            return None
        choice = newest_verified(sibling_checkpoints(path), self.verify_checkpoint)
        if choice is not None:
            warnings.warn(
                f"{path} failed verification ({err}); resuming from the newest checkpoint that verifies: {choice}",
                SkippedCheckpointWarning,
                stacklevel=3,
            )
        return choice

    def remove_checkpoint(self, path: Any) -> None:
        fs, fs_path = fsspec.core.url_to_fs(str(path))
        if fs.exists(fs_path):
            fs.rm(fs_path, recursive=True)
            log.debug("Removed checkpoint: %s", path)

    def verify_checkpoint(self, path: str) -> None:
        """Return if ``path`` verifies; raise ``CheckpointCorruptError`` (or ``UnsafeCheckpointError``) if not."""
        files.verify_file(str(path))

    def teardown(self) -> None:
        """Nothing to release: saves are synchronous and complete when ``save_checkpoint`` returns."""

    def _clean_once(self, path: str) -> None:
        if not is_local(path):
            return
        directory = os.path.dirname(os.path.abspath(fsspec.core.url_to_fs(path)[1]))
        if directory in self._cleaned:
            return
        self._cleaned.add(directory)
        for removed in clean_stale_temporaries(directory):
            log.info("removed stale temporary %s left by an interrupted save", removed)
