"""Numerics: find the op that produced the first NaN/Inf, dtype headroom, the training sentinel."""
