"""Safe checkpoint files: the tree codec, the safetensors framing, atomic writes, reads, the one verifier,
"last" resolution, async staging and the ``SafetensorsCheckpointIO`` plugin. Imports nothing itself:
import the module you need (the public names are re-exported by ``lightning_resume``)."""
