"""Where content-addressed checkpoints keep their blocks: ``<D>/blocks/<pack>.safetensors`` beside ``<D>/<name>.ckpt``.

The names are defined once, in ``format.packs`` (the file format's reader and writer need them, and ``format`` sits
below ``cas``); this module is where the rest of the package (gc, verify, the CLI, the benchmark) takes them from.
Every path is built through ``storage``: any fsspec URL keeps its scheme.
"""

from lightning_resume.format.packs import BLOCKS, MIN_BLOCK_BYTES, blocks_dir, is_pack_name, pack_name, pack_path

__all__ = ["BLOCKS", "MIN_BLOCK_BYTES", "blocks_dir", "is_pack_name", "pack_name", "pack_path"]
