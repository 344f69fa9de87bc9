"""Pallas GPU attention kernels, one per module, each with a pure-JAX `<name>_reference` of the
same signature (see docs in the repository README). Kernels arrive with the kernel issue."""

__all__: list[str] = []
