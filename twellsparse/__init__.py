"""twellsparse: TwELL (tile-wise ELLPACK) sparse matrices for activation-sparse LLM FFNs.

NumPy inputs run on the CPU reference path, CuPy inputs on the GPU kernels. The PyTorch and
JAX adapters (``twellsparse.torch``, ``twellsparse.jax``) are never imported from here.
"""

from __future__ import annotations

from . import testing
from ._backend import bfloat16
from ._constructors import from_dense, from_ell
from ._errors import (
    TwELLCapacityError,
    TwELLDroppedEntriesWarning,
    TwELLFallbackWarning,
    TwELLFormatError,
    TwELLSpillCapacityError,
)
from ._ops import linear_to_twell, matmul, sddmm
from ._parts import TwELLParts
from ._plans import FFN, GatedFFN, ffn, gated_ffn
from ._quantize import QuantizedRows, quantize_rows
from ._transpose import twell_transpose
from ._twell import is_twell, issparse, twell_array

__version__ = "0.1.0"

__all__ = [
    "FFN",
    "GatedFFN",
    "QuantizedRows",
    "TwELLCapacityError",
    "TwELLDroppedEntriesWarning",
    "TwELLSpillCapacityError",
    "TwELLFallbackWarning",
    "TwELLFormatError",
    "TwELLParts",
    "bfloat16",
    "ffn",
    "from_dense",
    "from_ell",
    "gated_ffn",
    "is_twell",
    "issparse",
    "linear_to_twell",
    "matmul",
    "quantize_rows",
    "sddmm",
    "testing",
    "twell_array",
    "twell_transpose",
]
