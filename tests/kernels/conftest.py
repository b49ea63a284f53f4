"""The GPU path's Triton kernels, run on CPU tensors by Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated (`triton.jit`), that is when a module of
`chatstore.kernels.triton` is first imported, so it is set here, before any test module of this
folder imports one. Nothing else in the suite imports those modules (the CPU path never does).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
