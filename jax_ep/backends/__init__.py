"""What runs an op: the reference backend (XLA collectives, anywhere) and the CUDA backend (the FFI kernels).

Both implement the Backend protocol of base.py. The CUDA module is imported on first use, so `import jax_ep` never
touches the native extension.
"""

from __future__ import annotations

import importlib

from . import reference


def load_cuda():
    """The CUDA backend module (imported lazily)."""
    return importlib.import_module(".cuda", __name__)


__all__ = ["reference", "load_cuda"]
