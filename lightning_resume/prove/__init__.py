"""``lightning-resume prove``: run a user's training command uninterrupted and killed-and-resumed, and compare
the two step by step. ``trace`` writes what ``ExactResume`` records in each run (docs/prove.md)."""
