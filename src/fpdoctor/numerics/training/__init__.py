"""Training steps: the decisions of a step made once for every front end (`judge`), the Sentinel for a
loop of the user's own (`sentinel`), a bad step replayed (`replay`) and its control at a higher
precision (`control`), the reference step in a known-good recipe (`reference`), the learning-rate
what-if of a stalled run (`lr_whatif`), which rank held the bad gradient (`distributed`), the
last-good checkpoint (`checkpoint`), and the findings they make (`findings`).

The top of numerics: a replay runs the step again under `fpdoctor.trace()` (`numerics.api`).
"""
