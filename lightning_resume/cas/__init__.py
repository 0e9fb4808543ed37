"""Content-addressed storage of checkpoint tensors (issue 43)."""
