"""Where bytes go: local paths and fsspec URLs, multipart uploads, private directories, host memory and the
remote-load budget. Knows bytes and files, not checkpoints."""
