"""A content-addressed save: hash what is predicted unchanged, write the rest into one pack, then the checkpoint file.

:class:`Lineage` is what a run's saves know between them: its lineage id (born at its first dedupe save, or taken
back from the checkpoint it resumed from), what each tensor's previous save found (``cas.plan.Seen``), and which
keys the packs referenced by the newest checkpoint it wrote or loaded hold. :func:`commit_deduped` applies the plan
of ``cas.plan``: a tensor hashed first whose key is held (in a pack that still exists) is referenced; every other
large tensor goes into the new pack (``cas.write_pack``), committed before the checkpoint file that references it
(``format.write.commit`` with ``refs``). While the save runs, the packs it wrote or will reference are held in
``cas.live`` so a collection never removes them. A kill at any moment leaves the previous checkpoint and every pack
it references as they were: a pack is only ever added (or replaced by one of the same name, hence the same blocks).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from lightning_resume.cas import live, plan
from lightning_resume.cas.write_pack import Block, commit_pack
from lightning_resume.format import framing, integrity, write
from lightning_resume.format.packs import Ref, Refs, blocks_dir, pack_path
from lightning_resume.storage import files as storage
from lightning_resume.storage import multipart


@dataclass
class Lineage:
    """What one run's dedupe saves carry from one save to the next (held by the IO plugin)."""

    lineage: str = ""
    seen: Dict[str, plan.Seen] = field(default_factory=dict)
    held: Dict[str, str] = field(default_factory=dict)
    """key -> pack name, in ``directory``: the refs of the newest checkpoint written or loaded there."""
    directory: str = ""
    step: Optional[int] = None
    """The training step of the previous save (``None``: unknown)."""

    def adopt(self, path: str, refs: Refs) -> None:
        """Continue the lineage of the checkpoint ``path`` just loaded (a resume), if it has refs."""
        if refs.lineage:
            self.lineage, self.seen = refs.lineage, plan.after_resume(refs)
            self.held, self.directory = {r.key: r.pack for r in refs.tensors.values()}, blocks_dir(path)


def commit_deduped(
    path: str,
    tree_json: str,
    tensors: Dict[str, torch.Tensor],
    algorithm: str,
    state: Lineage,
    ready: Optional[Callable[[str], None]] = None,
    mode: int = 0o666,
    upload: multipart.UploadOptions = multipart.DEFAULT_UPLOAD,
    step: Optional[int] = None,
) -> Refs:
    """Commit the encoded checkpoint (``write.encode_tree``) at ``path`` as a dedupe save; the refs it wrote.
    ``ready(name)`` blocks until ``tensors[name]`` holds its bytes (an async snapshot). ``step``: the training step
    saved (its ``global_step``), for the plan (``cas.plan.predict``'s ``same_step``)."""
    wait = ready if ready is not None else (lambda name: None)
    state.lineage = state.lineage or uuid.uuid4().hex
    views = {name: framing.host_bytes(t) for name, t in tensors.items()}
    same_step = step is not None and step == state.step
    chosen = plan.plan({name: len(v) for name, v in views.items()}, state.seen, same_step)
    first = {}
    for name in chosen.hash_first:
        wait(name)
        first[name] = integrity.digest(algorithm, views[name])
    with live.saving(blocks_dir(path)), live.holding() as holder:
        referenced = _referenced(path, tensors, first, state, holder)
        blocks = [
            Block(name, views[name], first.get(name), tensors[name].element_size())
            for name in chosen.hash_first + chosen.write
            if name not in referenced
        ]
        wrote = None
        if blocks:
            wrote, keys = commit_pack(blocks_dir(path), algorithm, state.lineage, blocks, wait, upload)
            holder.add([pack_path(path, wrote)])
            referenced.update({name: _ref(name, tensors[name], key, wrote) for name, key in keys.items()})
        refs = Refs(state.lineage, referenced, wrote)
        inline = {name: tensors[name] for name in chosen.inline}
        write.commit(path, tree_json, inline, algorithm, ready=ready, mode=mode, upload=upload, refs=refs)
    state.seen = plan.after_save(state.seen, {name: r.key for name, r in referenced.items()}, same_step)
    state.step = step
    state.held, state.directory = {r.key: r.pack for r in referenced.values()}, blocks_dir(path)
    return refs


def _referenced(
    path: str, tensors: Dict[str, torch.Tensor], first: Dict[str, str], state: Lineage, holder: live.Holder
) -> Dict[str, Ref]:
    """The tensors hashed first whose key a held pack of this directory holds, that pack still existing (a
    collection may have removed it since); those packs are held from now until the checkpoint is committed."""
    held = state.held if state.directory == blocks_dir(path) else {}
    wanted = {held[key] for key in first.values() if key in held}
    holder.add(pack_path(path, p) for p in wanted)
    present = {p for p in wanted if storage.exists(pack_path(path, p))}
    return {
        name: _ref(name, tensors[name], key, held[key])
        for name, key in first.items()
        if key in held and held[key] in present
    }


def _ref(name: str, t: torch.Tensor, key: str, pack: str) -> Ref:
    return Ref(name, framing.CODES[t.dtype], tuple(t.shape), key, pack)
