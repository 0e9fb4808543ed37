"""What a snapshot holds beyond Lightning's own checkpoint: RNG streams, data position, fingerprint.

Mechanisms only: capture and restore plain values. No Lightning loops, no files, no decisions.
"""
