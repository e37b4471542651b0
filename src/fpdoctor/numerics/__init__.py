"""Numerics: the op that produced the first NaN/Inf, dtype headroom, update precision, compiled
graphs and the training-step judge, each a package, layered (pyproject.toml's `numerics` contract):

    training          the step judge, the Sentinel, replay, control, reference step
    api               fpdoctor.trace()
    compiled | updates
    trace             the tracer, blame, headroom, recipes, dtype/device errors
    engine            the experiments every fix's trial comes from
    observe           how a running program is read: records, values, finite checks, GradScaler
"""
