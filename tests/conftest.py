import os

import torch

# Two shared cores: one intra-op thread keeps runs fast and steady.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The S3 server fixtures (moto on 127.0.0.1, started on first use) for tests under any directory.
from tests.helpers.s3 import s3_bucket, s3_server  # noqa: E402, F401
