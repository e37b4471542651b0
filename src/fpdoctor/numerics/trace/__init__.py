"""The trace: which op produced the first NaN/Inf and why (`tracer`, `blame`), what arithmetic can
produce (`bounds`), headroom against the dtype limits (`headroom`), the precision recipe around the
ops (`recipes`, `scaler_skips`), dtype and device errors (`mismatch`, `op_error`), which module and
optimizer step is running (`modules`, `steps`), `trace --dtype` (`autocast_run`) and an op's
standalone reproducer (`repro`, `repro_script`).

It runs the experiment engine (`numerics.engine`) at the op it blames; `fpdoctor.trace()`
(`numerics.api`) puts it together.
"""
