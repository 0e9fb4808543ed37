"""Lightning's side of the files: the ``SafetensorsCheckpointIO`` plugin, the sharded strategy's IO, the one
verifier of any checkpoint, and the "last" resolver (the newest verified checkpoint by training progress).
Imports nothing itself: import the module you need (the public names are re-exported by ``lightning_resume``)."""
