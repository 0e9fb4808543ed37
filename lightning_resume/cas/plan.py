"""Which tensors a content-addressed save writes, hashes first, or keeps inline: a pure policy over plain records.

A tensor smaller than ``MIN_BLOCK_BYTES`` stays inline in the checkpoint file. A larger one is **hashed first**
(and referenced if a pack already holds its key) when it is predicted unchanged, and otherwise **written while it
is hashed**, as a save without dedupe writes it, so a full fine-tune (every tensor changes at every save) pays one
pass over its bytes. The prediction is what this process saw: unchanged at its previous save (its key was the key
before), or, before any comparison was possible (the first saves of a process), unchanged when it was carried over
by the checkpoint the run resumed from (referenced from a pack that save did not write) or, at the second save of a
fresh run, not yet known to change; and every tensor when the previous save was at the same training step (a
``last.ckpt`` saved beside another file of that step). No filesystem, no clock, no tensors here: ``cas.save`` applies the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Mapping, Optional

from lightning_resume.format.packs import MIN_BLOCK_BYTES, Refs


class Action(Enum):
    INLINE = "inline"
    HASH_FIRST = "hash first"
    WRITE = "write"


@dataclass(frozen=True)
class Seen:
    """What the previous save of this process (or the checkpoint it resumed from) found for one tensor."""

    key: str
    unchanged: Optional[bool]
    """``True``: its key equalled the one before; ``False``: it changed; ``None``: nothing to compare with."""


@dataclass(frozen=True)
class Plan:
    inline: List[str]
    hash_first: List[str]
    write: List[str]


def predict(nbytes: int, seen: Optional[Seen], same_step: bool = False) -> Action:
    """The action for one tensor of ``nbytes`` with the history ``seen`` (``None``: never saved by this lineage).
    ``same_step``: the previous save was at this training step (``ModelCheckpoint``'s ``last.ckpt`` beside its
    other file, a snapshot beside a save), so nothing is predicted to have changed since."""
    if nbytes < MIN_BLOCK_BYTES:
        return Action.INLINE
    if seen is None or (seen.unchanged is False and not same_step):
        return Action.WRITE
    return Action.HASH_FIRST


def plan(sizes: Mapping[str, int], seen: Mapping[str, Seen], same_step: bool = False) -> Plan:
    """The plan of a save of tensors with ``sizes`` (name -> bytes, in file order), given what was ``seen``
    (``same_step``: see :func:`predict`)."""
    out: Dict[Action, List[str]] = {a: [] for a in Action}
    for name, nbytes in sizes.items():
        out[predict(nbytes, seen.get(name), same_step)].append(name)
    return Plan(out[Action.INLINE], out[Action.HASH_FIRST], out[Action.WRITE])


def after_save(seen: Mapping[str, Seen], keys: Mapping[str, str], same_step: bool = False) -> Dict[str, Seen]:
    """What the next save predicts from, once a save found ``keys`` (name -> key of each referenced tensor). A save
    at the step of the one before it (``same_step``) learns nothing about change: the history it had stays."""
    if same_step:
        return {name: seen[name] if name in seen and seen[name].key == key else Seen(key, None)
                for name, key in keys.items()}  # fmt: skip
    return {name: Seen(key, None if name not in seen else seen[name].key == key) for name, key in keys.items()}


def after_resume(refs: Refs) -> Dict[str, Seen]:
    """What the first save after resuming from a checkpoint with ``refs`` predicts from: a tensor referenced from
    a pack its save did not write was unchanged at that save; one in the pack it wrote changed, or was new (the
    record does not say which), so it is hashed first once more."""
    return {name: Seen(r.key, True if r.pack != refs.wrote else None) for name, r in refs.tensors.items()}
