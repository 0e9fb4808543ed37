"""Hyper-parameters ``SafetensorsCheckpointIO`` cannot write, found before a save fails on them.

``self.save_hyperparameters()`` stores every ``__init__`` argument, and Lightning writes them into every
checkpoint (``hyper_parameters``, ``datamodule_hyper_parameters``). An ``nn.Module`` or a
``functools.partial`` among them has no pickle-free encoding that loads without running code: rebuilding
either means importing and calling what the file names, which a checkpoint read must never do. So they are
refused, not encoded, and this module finds every one at once (each hyper-parameter encoded on its own), so
that the refusal comes at the start of ``fit`` or at ``convert``, naming them all, rather than at the first
save, hours in. Knows checkpoint trees and the codec, not Lightning's loops.
"""

from __future__ import annotations

from typing import Any, List, Mapping

from lightning_resume.errors import HPARAMS_KEYS, UnencodableValueError, hparam_name, hparams_fix
from lightning_resume.format.codec import encode


def unencodable(tree: Mapping[str, Any]) -> List[UnencodableValueError]:
    """One error per hyper-parameter of ``tree`` (a checkpoint dict, or just its hyper-parameter keys) that
    the codec refuses, each naming its key path (``hyper_parameters.net``)."""
    found = []
    for key in HPARAMS_KEYS:
        values = tree.get(key)
        if not isinstance(values, Mapping):
            continue
        for name, value in values.items():
            try:
                encode({key: {name: value}})
            except UnencodableValueError as err:
                found.append(err)
    return found


def refuse_unencodable(tree: Mapping[str, Any]) -> None:
    """Raise ``UnencodableValueError`` for the first unencodable hyper-parameter of ``tree``, its fix naming
    every one (``save_hyperparameters(ignore=[...])``); return if there is none."""
    found = unencodable(tree)
    if found:
        first = found[0]
        names = [hparam_name(err.key_path) for err in found]
        raise UnencodableValueError(first.key_path, first.type_name, first.reason, hparams_fix(names))
