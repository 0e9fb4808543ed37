import os

import torch

# Two shared cores: one intra-op thread keeps runs fast and steady.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The S3 server fixtures (moto on 127.0.0.1, started on first use) for tests under any directory.
# No test connects beyond 127.0.0.1/::1 (never the cloud metadata address): see tests/helpers/network.py.
from tests.helpers import network  # noqa: E402
from tests.helpers.s3 import s3_bucket, s3_server  # noqa: E402, F401
from tests.helpers.shm import shm  # noqa: E402, F401

network.install()
