"""Gluon (Triton's explicit dialect) kernels for Hopper (sm_90). They compile only for a real GPU target: the CPU
interpreter cannot run them, so the Triton kernels remain the path everywhere else."""
