"""What constructing the public classes changes outside their own objects is exactly what README's "What this
package changes in your process" lists: a fresh interpreter snapshots every attribute of the classes and
modules of Lightning, torch, botocore, s3fs and fsspec (and each function's defaults), the signal handlers
and the warning filters, constructs each entry point, and reports what differs (modules imported meanwhile
are new, not changed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LISTED = {
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._find_last_checkpoints",
    "lightning.pytorch.trainer.trainer.Trainer._fit_impl",
    "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector._parse_ckpt_path",
    "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector._select_ckpt_path",
    "botocore.retryhandler.random",
    "botocore.retries.standard.ExponentialBackoff.__init__.__defaults__",
    "atexit",
}
"""The README section's list, by the attribute each item replaces (``atexit``: one exit hook registered)."""

SNAPSHOT = r"""
import atexit, inspect, json, signal, sys, tempfile, warnings
import botocore.retries.standard, botocore.retryhandler, fsspec, s3fs, torch  # noqa: F401
import lightning.pytorch  # noqa: F401
import lightning_resume as lr

PREFIXES = ("lightning", "torch", "botocore", "s3fs", "fsspec", "numpy", "random")

def snapshot():
    with warnings.catch_warnings():  # reading a deprecated attribute warns
        warnings.simplefilter("ignore")
        seen = attributes()
    seen.update({f"signal {s.name}": repr(signal.getsignal(s)) for s in signal.valid_signals() if hasattr(s, "name")})
    seen["warnings.filters"] = repr(warnings.filters)
    seen["atexit"] = atexit._ncallbacks()
    return seen

def attributes():
    seen = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.split(".")[0] in PREFIXES:
            continue
        for key, value in list(vars(module).items()):
            seen[f"{name}.{key}"] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for attr, member in list(vars(value).items()):
                    where = f"{name}.{key}.{attr}"
                    seen[where] = id(member)
                    if inspect.isfunction(member):
                        seen[where + ".__defaults__"] = repr(member.__defaults__)
    return seen

before = snapshot()
tmp = tempfile.mkdtemp()
made = [
    lr.ExactResume(),
    lr.ExactResume(memory_tier=lr.MemoryTierOptions(dir=tmp + "/memory")),
    lr.SafetensorsCheckpointIO(),
    lr.SafetensorsCheckpointIO(save="async"),
    lr.RetentionCheckpoint(dirpath=tmp + "/ckpts", retention=lr.RetentionPolicy(keep_last=2)),
    lr.ActivationCheckpointingStrategy(blocks=[torch.nn.Linear]),
]
after = snapshot()
USE = ("._latest", "._cache")  # fsspec's cache of filesystem instances: any use of fsspec fills it
print(json.dumps(sorted(k for k in before if before[k] != after.get(k) and not k.endswith(USE))))
"""


def test_constructing_the_public_classes_changes_only_what_the_readme_lists() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SNAPSHOT], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    changed = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert changed == LISTED, (
        f"not in README: {sorted(changed - LISTED)}; listed but unchanged: {sorted(LISTED - changed)}"
    )
