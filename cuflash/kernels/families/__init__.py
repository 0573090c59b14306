"""Kernel families: one module per algorithm (standard, fa1, fa2), each implementing plans.KernelFamily."""
