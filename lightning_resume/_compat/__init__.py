"""Every private name of Lightning, torchdata and ``torch.distributed.checkpoint`` the package relies on.

One module per dependency (``lightning``, ``torchdata``, ``dcp``), one small function or class per
private name, each citing the upstream file:line it was read from. Nothing outside this package may
use a private name of those libraries (``tests/unit/test_layout.py`` walks the AST to hold this), so
an upgrade that renames one breaks here, loudly. ``check_versions`` is the one version check; every
entry point (callbacks, plugin, strategies, CLI) calls it, and it warns once per process.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings

from lightning_resume.errors import VersionWarning

VERIFIED: dict[str, tuple[str, ...]] = {
    "lightning": ("2.6.",),
    "torchdata": ("0.11.",),
    "torch": ("2.13.",),  # the torch.distributed.checkpoint internals of _compat/dcp.py
}
"""Version prefixes these shims were read from and tested with."""


@functools.cache
def check_versions(*packages: str) -> tuple[str, ...]:
    """Warn (once per process and set of packages) about each installed version not in ``VERIFIED``;
    return the warning lines. Default: Lightning and torchdata, which every entry point relies on."""
    lines = []
    for name in packages or ("lightning", "torchdata"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if not version.startswith(VERIFIED[name]):
            lines.append(
                f"{name} {version} is not verified with lightning-resume (built for {name} {VERIFIED[name][0]}*);"
                " the private APIs it relies on may differ: see lightning_resume/_compat"
            )
    for line in lines:
        warnings.warn(line, VersionWarning, stacklevel=3)
    return tuple(lines)
