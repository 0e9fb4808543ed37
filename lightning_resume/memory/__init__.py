"""The memory tier: the shared-memory store in this user's private root, and the tier in a Lightning run."""
