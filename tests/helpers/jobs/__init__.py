"""Scripts that tests run as subprocesses: ``python tests/helpers/jobs/<name>.py ...``.

The tests locate them with ``tests.helpers.paths.job_script(name)`` and start them through
``tests.helpers.processes`` (or the harnesses on top of it: ``kill_resume`` for ``trainee.py``,
``kill_writes`` for ``async_save_loop.py``, ``sharded_runs`` for the sharded jobs), which puts the repo
root on ``PYTHONPATH`` (so the package under test and ``tests.helpers`` are importable); a job that
imports ``tests.helpers`` also puts the repo root on ``sys.path`` itself when run as a script.
``trainee.py`` is also imported in-process (its ``Model``) by the exactness tests.
"""
