"""The training sentinel inside the loops that frameworks own: Lightning and the Hugging Face Trainer.

`fpdoctor.integrations.lightning.FpDoctorCallback` and `fpdoctor.integrations.hf.FpDoctorCallback`
give a framework's training loop the sentinel's semantics (`fpdoctor.Sentinel`): a finite check of
loss and gradients on the device, a skipped optimizer step for a non-finite one, its replay under
`trace` with a verdict, AMP skips counted apart, the rank that held the fault under DDP. Each
framework module imports its framework; this package imports none, and `import fpdoctor` never
imports this package.
"""
