"""A pytest plugin (`-p fake_cuda`) that makes this CPU machine say it has CUDA.

What it is: `torch.cuda.is_available()` answers True from the start of the run, before any test
module is imported, so modules that choose their path by it (triton_attention.py leaves Triton's
interpreter off; tests/test_level1_kernel.py moves its CPU-tensor tests to a child process) take
the GPU machine's path. tests/test_level1_kernel.py uses it to check that path without a GPU.

What it is not: a GPU. Anything that really launches on CUDA fails; select only tests that don't.
"""

import torch

torch.cuda.is_available = lambda: True
