"""Native CPU kernels: the C++ sources in ``csrc/`` and their loader."""
