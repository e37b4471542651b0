"""The experiment engine: the interventions that decide a cause and check its fix, in one place.

Every printed fix carries its trial (`fpdoctor.Trial`); the trials come from here:

  reruns    an op that made NaN/Inf re-run on the inputs it read: as it ran, in fp64, its upstream
            chain re-run in higher precision op by op back to the origin, a constant replaced by a
            value the dtype holds (and whose derivative it holds), the rows of the batch that made
            it. `trace`, the Sentinel, `watch` and the callbacks reach it through the tracer.
  raising   a model run with some of its ops raised: the ops of some sites (op and source line)
            kept in fp64 (a running state), or every op at some lines computed in fp32 with their
            results cast back (what feeds an ill-conditioned op). `compare` and `plan` run them.

Step-level experiments (the replay of a training step as it ran, its fp32 control, the what-ifs
of a learning rate or fp32 master weights) run a whole step under `trace` and live with the step
judge that calls them.
"""
