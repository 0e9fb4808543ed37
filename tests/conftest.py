import os

import torch

# Two shared cores: one intra-op thread keeps runs fast and steady.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
