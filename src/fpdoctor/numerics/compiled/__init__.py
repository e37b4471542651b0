"""torch.compile'd code: a bad step of a compiled model (`step`), each Dynamo graph checked where it
runs (`graphs`), the first bad graph run again apart from the step (`rerun`) and written as a
reproducer (`repro`, `repro_script`), and compiled code under `trace` (`under_trace`).
"""
