"""HybridFlow Lab: a Jupyter-first reimplementation of HybridFlow (arXiv 2409.19256)."""

from hybridflow_lab.protocol import DataBatch

__version__ = "0.1.0"
__all__ = ["DataBatch", "__version__"]
