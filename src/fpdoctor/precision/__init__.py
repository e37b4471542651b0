"""Precision: four capabilities around a shared core.

  audit/    mixed dtypes and devices, dtype errors explained and their fixes checked; harmonize and
            fp32 boundary casts
  compare/  layerwise A/B of a candidate precision against fp64: the passes, the op-level judges
            (first overflow, a container's own ops, ops near the format's max), fp8 statistics
  plan/     the smallest keep-in-fp32 set, verified; op-level fixes and the code to paste
  record/   a compare run saved on one machine and judged against on another

The core at this level is what more than one of them reads: the precision names, the candidate
copies of a model, the error metrics, parameters that do not fit a format, example inputs, the
per-module error profile, and one module of a large model compared alone (scope, modes).
Dependencies point one way: plan > compare > audit | record > the core.
"""
