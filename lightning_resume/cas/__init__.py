"""Content-addressed saves (``SafetensorsCheckpointIO(dedupe=True)``): layout, refs, the save plan, live packs."""
