"""Numerics: find the op that produced the first NaN/Inf, dtype headroom, the training sentinel.

`engine/` is the experiment engine every fix's trial comes from (op re-runs, raised sites and
lines); the tracer, the step judge and its front ends, and `compare` call it.
"""
