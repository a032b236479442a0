"""hvdhetero: one PyTorch model trained across MPS, CUDA and CPU machines with Horovod over Gloo."""

__version__ = "0.1.0"
