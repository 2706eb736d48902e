"""Kernels for hpc-cli: each Triton kernel sits beside its torch reference twin."""
