"""How fpdoctor reads a running program without changing it: what the trace keeps per op
(`records`), how a tensor's values are read (`values`), the finite check of a loss and its gradients
(`gradcheck`), a GradScaler seen from outside (`amp`), fpdoctor's code kept out of what torch.compile
traces (`dynamo`), and what a front end hands the step judge about a batch (`batches`).

numerics' ground: every other numerics package reads through it, and it imports none of them.
"""
