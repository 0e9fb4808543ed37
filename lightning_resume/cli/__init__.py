"""The ``lightning-resume`` command: ``main`` assembles the subcommands of ``commands/``; ``render`` turns
loaded checkpoints into plain summaries for ``inspect`` and ``diff``."""
