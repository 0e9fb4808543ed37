"""The checkpoint file: codec and framing, integrity digests, reading (in place too) and writing, legacy
``torch.save`` files, hyper-parameters that cannot be saved, the atomic commit."""
