"""kvflow's native CPU backend: the C kernels (csrc/: one file per operation and instruction set, helpers in
csrc/common.h), their build and loading (build.py), the torch operators over them (ops.py), the table of weight
formats they multiply (formats.py, laid out as layout.py says; the codes as a GGUF holds them: group_quant.py), and
the kernel plan that chooses what computes a model here (plan.py).

Below layers/ and models/: it knows tensors, not modules.
"""
