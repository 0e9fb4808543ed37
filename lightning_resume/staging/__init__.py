"""Copies off the training thread: the async saver, staging buffers, the copy overlapped with the next step,
the writer process, and the staging lent to the memory tier."""
