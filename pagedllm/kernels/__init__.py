"""Numerical ops. Every op has a plain torch reference here; faster kernels (Triton for
GPUs) are tested against the reference."""
