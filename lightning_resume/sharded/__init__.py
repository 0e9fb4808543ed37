"""Sharded checkpoints: every rank writes its DCP shards, rank 0 commits; loading verifies and reshards.

``api`` holds the entry points, ``commit`` the swap protocol and ``marker`` the commit record (no DCP),
``verify`` a directory's check, ``background`` the async saves (host-buffer staging, background write,
commit at the next synchronisation point), ``safe_pickle`` the restricted DCP readers. The Lightning side is
``io.sharded_strategy``. The non-sharded part of a checkpoint is one file in ``lightning_resume.format``
(one codec, one integrity record for the whole product). This package imports nothing, so that verifying a
directory (``io.verify``) does not load DCP.
"""
