"""``prove_target``'s model under LightningCLI: ``python prove_cli.py fit --config fit.yaml [--ckpt_path last]``."""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lightning.pytorch.cli import LightningCLI  # noqa: E402
from prove_target import Net  # noqa: E402

if __name__ == "__main__":
    LightningCLI(Net, save_config_callback=None)
