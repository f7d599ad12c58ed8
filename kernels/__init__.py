"""Triton kernels: the FP8 group codec, the fused multi-tensor AdamW step, activation pack/unpack.

Each kernel's pure-torch twin lives in coatstate.formats (the codec) or is named in its module.
Importing this package never touches a GPU; triton itself is imported lazily by each module.
"""
