"""Shared test set-up. Triton kernels run in Triton's CPU interpreter when no GPU is present;
the variable must be set before triton is first imported, hence here, at collection start."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
