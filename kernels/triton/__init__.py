"""The Triton kernels of the CUDA path (attention over the pages, the KV store); the torch
reference they must match is ../attention.py."""
