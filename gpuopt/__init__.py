"""gpuopt: declarative, measured tuning of PyTorch training throughput."""

__version__ = "0.1.0"
