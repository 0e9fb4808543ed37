"""Subcommands of the ``lightning-resume`` CLI: one module each, exposing ``register(subparsers)``."""
