"""Exact resume: the ``ExactResume`` callback (thin hooks), what it captures and restores (``capture``,
``restore``), where and when snapshots are taken (``snapshots``, ``driver``), and per-process state
mechanisms (``state``: RNG streams, data position, fingerprint)."""
