"""Shared test helpers: models and data, comparisons, file surgery, the kill/resume harness and the
job scripts that tests run as subprocesses (``tests/helpers/jobs``). Test modules import from here,
never from one another."""
