"""Where the Triton tests run their kernels: on the CPU through Triton's interpreter when this machine has no GPU
(CI), on the GPU, compiled, when it has one. Import this module before anything that imports triton: it turns the
interpreter on only where no GPU exists, so that a GPU machine's suite never hands CPU tensors to compiled
kernels nor runs the engine's kernels interpreted."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def kernel_device(kernel) -> torch.device:
    """The device `kernel` (a @triton.jit function) runs on; skips the test when it cannot run here."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("Triton kernels were compiled (TRITON_INTERPRET unset at import) and there is no GPU")
