"""Retention: which checkpoints to keep (``policy``, pure), the rolling file name (``naming``), files on disk
as records (``records``), and the ``ModelCheckpoint`` subclass that applies them (``checkpoint``)."""
