"""Pallas kernels for Beam; each file holds op(), op_reference() in plain jnp, and the kernel. Imports nothing from beam_jax or serving."""
