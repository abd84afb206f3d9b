import os
import sys

import torch

# Tests import the repo's packages without an install step.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU the Triton kernels run (on CPU tensors) in Triton's interpreter. It must be
# chosen before triton is first imported, for the whole process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
