"""Mechanisms over one process's training state: RNG streams (``rng``), the data position and loader
checks (``data``), a fingerprint of the state (``fingerprint``), and its summary for ``inspect`` (``describe``)."""
