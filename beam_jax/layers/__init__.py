"""Beam's building blocks, one module each: norm, rope, linear, attention, mlp, moe, decoder."""
