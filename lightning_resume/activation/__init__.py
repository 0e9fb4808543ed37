"""Activation checkpointing: which blocks to recompute (``policy``, pure), recomputing them (``apply``),
measuring saved activations (``measure``), and the Lightning strategies that plan and apply (``strategies``)."""
