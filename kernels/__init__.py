"""Triton kernels, one file per format (group.py, activation.py, tensorwise.py) plus the fused
AdamW step (adamw_fused.py, launched by adamw_launch.py), the device functions they share
(fp8_triton.py) and the custom ops (ops.py).

Each kernel's pure-torch twin lives in coatstate.formats, the fused step's in
coatstate.optim.reference_step. Importing this package never touches a GPU; triton itself is
imported by each module, on first use.
"""
