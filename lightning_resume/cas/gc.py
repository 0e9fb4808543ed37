"""Collecting packs no checkpoint references any more: the only code that deletes a pack.

A pack of ``<D>/blocks/`` is removed only when every one of these holds:

- it is proved to be a pack of the lineage being collected: a regular file (never a link) named
  ``<alg>-<hex>.safetensors`` whose header is a pack record of that lineage and algorithm and whose name is the
  one ``layout.pack_name`` gives its own keys. Anything else in ``blocks/`` (another lineage's pack, a file
  someone put there, a temporary) is never touched by this rule, as retention never deletes a file that does
  not carry its own record of this run;
- no checkpoint file directly in ``<D>`` (any name, any lineage, every file whose header is safetensors)
  references it;
- no save of this process will reference it (``live.pending()``), nor does the caller keep it (``keep``).

Order makes it crash-safe and race-free within a process: what saves will reference is read first, then the
packs are listed, then the checkpoint files. A save that commits a checkpoint after that listing had its packs
pending before it, and a pack written after the listing is not a candidate. Each removal is one unlink or one
object delete, so a kill at any moment leaves some unreferenced packs behind (the next collection takes them),
never a kept checkpoint without its blocks. A checkpoint file whose references cannot be read (a damaged
header, a transient error) stops the collection: what it references is unknown, so nothing is removed, and a
``RetentionWarning`` names the file.

A lineage is one run at a time, as retention's run id is: two processes that resumed the same checkpoint into
the same directory at the same moment would each count the other's packs as their own, and one's collection
could remove a pack the other's save in flight was about to reference. Two *fresh* runs (two lineages) in one
directory never touch each other's packs. ``lightning-resume prune`` collects as a run does, so run it on a
directory no run is writing to.

Knows files (through ``storage``) and the format of refs and packs (``refs``, ``layout``); decides nothing
about which checkpoints to keep (retention does) and knows nothing of Lightning.
"""

from __future__ import annotations

import logging
import os
import stat
import warnings
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Union

from lightning_resume.cas import live
from lightning_resume.cas.layout import BLOCKS, is_pack_name, pack_name
from lightning_resume.cas.refs import read_pack_header, read_refs
from lightning_resume.errors import LightningResumeError, RetentionWarning
from lightning_resume.format.atomic import clean_stale_temporaries
from lightning_resume.format.packs import PACK_SUFFIX
from lightning_resume.format.read import is_safetensors
from lightning_resume.storage import files as storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unreadable:
    """A checkpoint file whose references could not be read, and why: the collection removes nothing."""

    path: str
    reason: str


def collect(directory: str, lineage: str, keep: Iterable[str] = frozenset(), temporaries: bool = True) -> List[str]:
    """Remove the packs of ``lineage`` in ``directory/blocks`` that nothing references (module docstring);
    return the paths removed. ``keep``: pack paths (or names) to keep besides. ``temporaries``: also remove
    the temporaries interrupted pack writes left in ``blocks`` (``format.atomic.clean_stale_temporaries``:
    this host's of dead processes, others' a day old)."""
    directory = str(directory)
    if not lineage:
        return []  # no lineage proves nothing: never a collection of packs that name none
    kept = _names(set(keep) | live.pending())  # first: a save that commits after the listings had these pending
    blocks = storage.join(directory, BLOCKS)
    if temporaries:
        for path in clean_stale_temporaries(blocks):
            log.info("removed stale temporary %s left by an interrupted pack write", path)
    candidates = {name: path for name, path in owned_packs(blocks, lineage).items() if name not in kept}
    if not candidates:
        return []
    referenced = referenced_packs(directory)
    if isinstance(referenced, Unreadable):
        warnings.warn(
            f"lightning-resume: no pack in {blocks} was collected: the references of {referenced.path} cannot be"
            f" read ({referenced.reason}); remove or repair that file and the next collection goes on",
            RetentionWarning,
            stacklevel=2,
        )
        return []
    removed = []
    for name, path in sorted(candidates.items()):
        if name in referenced or name in _names(live.pending()):  # pending again: a save that began meanwhile
            continue
        if live.remove_unless_saving(blocks, path, storage.remove):  # no save of ours in flight there: removed
            removed.append(path)
    return removed


def owned_packs(blocks: str, lineage: str) -> Dict[str, str]:
    """The packs in ``blocks`` proved to be packs of ``lineage`` (module docstring), by name -> path."""
    owned = {}
    for entry in storage.list_dir(blocks):
        name = entry.name[: -len(PACK_SUFFIX)]
        if entry.is_dir or not entry.name.endswith(PACK_SUFFIX) or not is_pack_name(name):
            continue
        if _is_pack_of(entry.path, name, name.rpartition("-")[0], lineage):
            owned[name] = entry.path
    return owned


def _is_pack_of(path: str, name: str, algorithm: str, lineage: str) -> bool:
    """Whether ``path`` proves it is a pack of ``lineage``: a regular file whose header says so and whose name
    is the one its keys give. Anything unreadable proves nothing (it is kept)."""
    if storage.is_local(path) and os.path.islink(storage.local_path(path)):
        return False  # the writer commits a new regular file; a link is someone else's
    try:
        info = read_pack_header(path)
    except (LightningResumeError, OSError, ValueError):
        return False
    return info.lineage == lineage and info.algorithm == algorithm and pack_name(algorithm, lineage, info.keys) == name


def referenced_packs(directory: str) -> Union[Set[str], Unreadable]:
    """The pack names the checkpoint files directly in ``directory`` reference, or the first file whose
    references cannot be read. Every non-hidden file counts (a checkpoint may have any name); hidden ones are
    temporaries, bookkeeping, or a save of this process in flight (``live.pending`` covers those)."""
    names: Set[str] = set()
    for entry in storage.list_dir(directory):
        if entry.is_dir or entry.name.startswith(".") or not regular_file(entry.path):
            continue
        try:
            if not is_safetensors(entry.path):
                continue  # a torch.save file, a log: no references
            names |= {ref.pack for ref in read_refs(entry.path).tensors.values()}
        except FileNotFoundError:
            continue  # deleted since the listing (a prune): it references nothing now
        except (LightningResumeError, OSError, ValueError) as err:
            return Unreadable(entry.path, str(err))
    return names


def regular_file(path: str) -> bool:
    """Whether a listed entry can hold a checkpoint: a URL's object, or a local regular file (a FIFO named
    ``*.ckpt`` would block a read forever; a link to one is followed by the reader and judged the same)."""
    if not storage.is_local(path):
        return True
    try:
        return stat.S_ISREG(os.stat(storage.local_path(path)).st_mode)
    except OSError:
        return False


def lineage_of(path: str) -> Optional[str]:
    """The lineage ``path``'s references name, or ``None``: no such file, not ours, no references."""
    try:
        if not is_safetensors(str(path)):
            return None
        refs = read_refs(str(path))
    except (LightningResumeError, OSError, ValueError):
        return None
    return refs.lineage if refs.tensors else None


def remove_and_collect(path: str, keep: Iterable[str] = frozenset()) -> List[str]:
    """Delete the checkpoint ``path`` (an error raises, as any deletion), then collect the packs of its lineage in
    its directory (the plugin's and the mirror's removal: retention proved the file is the run's, so its lineage
    is the run's); the packs removed. A failed collection is a warning: the next one tries again."""
    path = str(path)
    lineage = lineage_of(path)  # read before the file goes
    storage.remove(path)
    if lineage is None:
        return []
    return collect_quietly(storage.split(path)[0], lineage, keep, temporaries=False)


def collect_quietly(
    directory: str, lineage: str, keep: Iterable[str] = frozenset(), temporaries: bool = True
) -> List[str]:
    """:func:`collect`, a failure (a store that refuses a listing or a delete) warned about, never raised: a pack
    left is only space, collected the next time; the packs removed."""
    try:
        return collect(directory, lineage, keep, temporaries)
    except (LightningResumeError, OSError) as err:
        warnings.warn(
            f"lightning-resume: collecting the packs of {storage.join(directory, BLOCKS)} failed ({err}); training goes"
            " on, and the next collection tries again",
            RetentionWarning,
            stacklevel=2,
        )
        return []


def cleanup(directories: Iterable[str], lineage: str, temporaries: bool = True) -> List[str]:
    """The plugin's cleanup with ``dedupe``, at its first save into a directory and at the end of a fit: collect
    the packs of ``lineage`` (the run's) in each of ``directories`` (those it saves into), with ``temporaries``
    those of pack writes killed there too; the packs removed. What a killed predecessor of the run left (a pack
    whose checkpoint was never committed, or whose checkpoint was removed before its collection) goes here.
    Only a process that saves calls this: a reader (an eval job beside training) never judges another
    process's packs."""
    if not lineage:
        return []
    return [p for d in sorted(set(directories)) for p in collect_quietly(d, lineage, temporaries=temporaries)]


def _names(packs: Iterable[str]) -> FrozenSet[str]:
    """Pack names from names or paths (``live.pending`` gives paths)."""
    out = set()
    for pack in packs:
        name = storage.basename(str(pack))
        out.add(name[: -len(PACK_SUFFIX)] if name.endswith(PACK_SUFFIX) else name)
    return frozenset(out)
