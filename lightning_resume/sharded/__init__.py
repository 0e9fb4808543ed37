"""Sharded checkpoints: every rank writes its DCP shards, rank 0 commits; loading verifies and reshards.

``api`` holds the entry points, ``commit`` the marker and swap protocol (no DCP), ``background`` the
async saves (host-buffer staging, background write, commit at the next synchronisation point),
``safe_pickle`` the restricted DCP readers, ``strategy`` the Lightning hook. The non-sharded part of a
checkpoint is one file in ``lightning_resume.io``'s format (one codec, one integrity record for the
whole product). Import the modules themselves; this package imports nothing, so that verifying a
directory (``io.verify``) does not load DCP.
"""
