"""sparsepage: sparse-attention decode through CSR page tables.

A sparse selection (top-k blocks or tokens) becomes a page table for a fused
split-KV paged decode, with a CPU reference backend and a CUDA backend. This
package binds the C++ library over DLPack tensors (numpy on the CPU, torch on
the CPU or CUDA) and adds torch custom ops (:mod:`sparsepage.torch_ops`,
imported on demand so that torch stays optional). The paged decode and the
merge of partial states are called through ``sparsepage.torch_ops``
(``paged_decode``, ``paged_decode_out``, ``merge_states``); over numpy
arrays, the engine helpers of :mod:`sparsepage.engine` run it on the CPU.

Errors from the library arrive as :class:`sparsepage.Error` (a ``ValueError``)
carrying the library's message, which names the bad argument. What the
library cannot do yet raises ``NotImplementedError`` saying what is missing.

lse values are natural logarithms of the summed exponentials of the scaled
scores; an empty request gives ``o = 0`` and ``lse = -inf``.
"""

from . import engine  # noqa: F401
from ._core import *  # noqa: F401,F403
from ._core import Error, built_with_cuda, cuda_available  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # torch_ops imports torch; load it only when asked for.
    if name == "torch_ops":
        import importlib

        return importlib.import_module(".torch_ops", __name__)
    raise AttributeError(f"module 'sparsepage' has no attribute {name!r}")
