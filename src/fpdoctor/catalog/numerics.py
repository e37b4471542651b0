"""Numerics (NUM) and training (TRN) finding codes."""

from __future__ import annotations

from fpdoctor.catalog import RuleInfo
from fpdoctor.report.model import Severity

E, W, I = Severity.ERROR, Severity.WARNING, Severity.INFO  # noqa: E741


# RuleInfo.untried, for the codes whose fix no run of the user's model can try.
_BOTH_MACHINES = "a change to how both machines run the job: one machine's run cannot make or measure it"
_MACHINE = "an action on the machine (check, drain), not a change to the run that fpdoctor can measure"
_OUTSIDE = (
    "the value came into the traced code from outside it (the data, a checkpoint, another rank): nothing in the "
    "traced run to change and re-run"
)
_SYMPTOM = (
    "a symptom of the step: the replay's verdict (or the op the trace names) is the cause, and its finding carries "
    "the fix's trial"
)
_RISK = (
    "a risk measured on these inputs: nothing failed, so there is no failure for a fix to remove and no "
    "before -> after to measure"
)
_SETTING = (
    "read from the optimizer's settings and the gradients seen: changing the training recipe is not a re-run "
    "fpdoctor makes"
)
_HISTORY = "the spiking step was finite and is not re-run: the advice is read from the loss history, not tried"
_COMPILER = (
    "a compiler setting or a bisection to run: the re-runs fpdoctor made (eager, compiled again, "
    "emulate_precision_casts) are in the message and evidence"
)
_RECORDED = (
    "the other machine's run is a record, not a run fpdoctor can repeat with the fix; on this machine `fpdoctor "
    "plan` tries and verifies a keep-in-fp32 plan"
)
_OWN = "fpdoctor's own failure, or a path it could not write: nothing in the run to change"

NUM_RULES: tuple[RuleInfo, ...] = (
    RuleInfo(
        code="NUM001",
        name="nonfinite-produced",
        severity=E,
        title="An op produced NaN or Inf from finite inputs, and it reaches what you see",
        what="Traces every aten op (forward, backward, optimizer) and reports the first op whose inputs were "
        "finite but whose output was not, among those whose non-finite values reach a module output, a value "
        "returned to your code, a gradient or a parameter. First Inf and first NaN are reported separately.",
        why="The op that produced the first non-finite value is where the fix goes; every later NaN is a "
        "consequence. A NaN that is masked away before anything sees it is not reported as an error.",
        fix="Look at the op's input statistics: overflow (values near the dtype's max) wants a rescale or fp32 "
        "for that op; 0/0, log(0), sqrt(<0) want an epsilon or a clamp at the shown source line.",
    ),
    RuleInfo(
        code="NUM002",
        name="nonfinite-input",
        severity=E,
        untried=_OUTSIDE,
        title="NaN or Inf was already in an input, parameter or constant",
        what="A tensor that entered the traced code (a batch, a parameter, a buffer, a constant) already held "
        "NaN or Inf, and it reaches what you see.",
        why="No op in the model is at fault: the data, a checkpoint or an earlier step is.",
        fix="Check the data pipeline (torch.isfinite(batch).all()) or the checkpoint the parameters came from.",
    ),
    RuleInfo(
        code="NUM003",
        name="overflow-risk",
        severity=W,
        untried=_RISK,
        title="Values come close to the largest finite value of a dtype",
        what="The largest magnitude of op outputs, inside modules too (attention scores), and of module outputs, "
        "against the max of the dtype in use (fp16 / bf16 / fp8), and of fp16 as a what-if for a model in fp32; "
        "compare checks the candidate run's ops, with the fp64 run's value beside it. Reported from 50% of the "
        "max, with the op, its module and source line.",
        why="From half the max, one doubling overflows to Inf: twice the sequence length under a sum, an input "
        "scaled by 2, a weight a learning-rate step doubles. The batch traced is rarely the largest that comes.",
        fix="Keep that op in fp32, rescale (e.g. divide scores by sqrt(d) earlier), or use bf16 instead of fp16.",
    ),
    RuleInfo(
        code="NUM004",
        name="underflow-risk",
        severity=W,
        untried=_RISK,
        title="Many non-zero values would flush to zero in a narrower dtype",
        what="Per module, the share of non-zero values below the smallest subnormal of fp16 / bf16, or below "
        "what fp8 e4m3 / e5m2 can hold after tensorwise scaling.",
        why="Values that flush to zero fail silently: no NaN, just zeros (a vanishing variance, dead gradients).",
        fix="Keep that module in fp32, or scale it (loss scaling for gradients, per-row scaling for fp8).",
    ),
    RuleInfo(
        code="NUM005",
        name="nonfinite-masked",
        severity=I,
        title="NaN or Inf was produced but masked before anything saw it",
        what="An op produced non-finite values that no module output, returned value, gradient or parameter "
        "received (for example masked attention rows, or a torch.where that discards them).",
        why="Harmless today, but a change in masking turns it into a real NaN; it also breaks NaN checks that "
        "look at every op.",
        fix="Usually nothing; prefer masking before the op (e.g. a large negative instead of -inf) to silence it.",
    ),
    RuleInfo(
        code="NUM006",
        name="precision-divergence",
        severity=E,
        title="A module adds far more error in the candidate precision than rounding explains",
        what="Runs fp64, the reference and the candidate side by side, module by module, and compares each "
        "module's isolated error (the candidate module fed fp64 inputs) with the noise floor: the error rounding "
        "the fp64 output to the candidate's format causes, or the reference's own error against fp64.",
        why="Accumulation loss, overflow and cancellation land orders of magnitude above rounding; the first "
        "module that does is where precision breaks the model.",
        fix="Keep the named module in fp32 (fpdoctor plan), or change the recipe (bf16 for range, fp32 "
        "accumulation for long reductions).",
    ),
    RuleInfo(
        code="NUM007",
        name="fp8-saturation",
        severity=W,
        title="A Linear layer's input or weight does not survive fp8 with tensorwise scaling",
        what="For every Linear, quantizes its input and weight to fp8 with tensorwise and rowwise amax scaling "
        "and measures SQNR, the share of values flushed to zero, and what an unscaled cast would clip.",
        why="A few outlier channels set a tensorwise scale for everyone; the rest drop below fp8's smallest value "
        "and training degrades or diverges while bf16 is fine.",
        fix="Use rowwise scaling where it keeps the SQNR, keep the layer in bf16 where it does not.",
    ),
    RuleInfo(
        code="NUM008",
        name="nonfinite-zeroed",
        severity=E,
        title="An overflow's Inf was turned into zeros or finite garbage that reaches what you see",
        what="An op overflowed to Inf from finite inputs, and a later op (rsqrt, reciprocal, exp of -Inf, division "
        "by Inf, a negative power, sigmoid/tanh) turned the Inf into 0 or a saturated finite value that reaches a "
        "module output, a returned value, a gradient or a parameter. Masking by where, masked_fill or a softmax "
        "over an -inf mask is deliberate and stays nonfinite-masked.",
        why="No NaN appears, so NaN checks pass, but the values are destroyed: an fp16 RMSNorm whose x.pow(2) "
        "overflows computes rsqrt(Inf) = 0 and outputs zeros for those rows.",
        fix="Fix the overflowing op named in the finding: compute it in fp32 (e.g. the variance of a norm), rescale "
        "its input, or use bf16 when the cause is fp16's range.",
    ),
    RuleInfo(
        code="NUM009",
        name="fp16-adam-eps",
        severity=E,
        untried=_SETTING,
        title="Adam's eps rounds to zero in fp16",
        what="An Adam-family optimizer stepped fp16 parameters (so its state is fp16) with an eps below 1e-4; "
        "the default 1e-8 is below fp16's smallest subnormal (6e-8) and rounds to 0.",
        why="The update is m / (sqrt(v) + eps); with eps = 0 and a small v it divides by ~0, and the parameters "
        "jump to Inf or huge values a few steps in.",
        fix="eps=1e-4 (or larger) for pure fp16 parameters; better, keep fp32 master weights and run the forward "
        "under torch.autocast(dtype=torch.float16) with a GradScaler.",
    ),
    RuleInfo(
        code="NUM010",
        name="fp16-without-grad-scaler",
        severity=W,
        untried=_SETTING,
        title="fp16 autocast training without a GradScaler: small gradients flush to zero",
        what="The forward ran under fp16 autocast, backward ran and an optimizer stepped, but not through "
        "GradScaler.step; the finding gives the measured share of gradient values that are 0 or fp16 subnormals.",
        why="fp16 cannot hold gradients below 6e-8 and keeps few bits below 6.1e-5; without loss scaling they "
        "vanish in the fp16 backward and the weights stop learning, with no NaN to warn you.",
        fix="scaler = torch.amp.GradScaler(device); scaler.scale(loss).backward(); scaler.step(opt); "
        "scaler.update() - or autocast to bf16, which needs no scaler.",
    ),
    RuleInfo(
        code="NUM011",
        name="machine-departure",
        severity=E,
        untried=_RECORDED,
        title="This machine's run departs from the recorded machine's at a module",
        what="`compare --against FILE` runs the same compare as the record (`--save-reference` on machine A) and "
        "compares each module's candidate output with A's, relative to the fp64 output: beyond 16x the noise "
        "floor (and the error both runs carried in), or NaN/Inf on one machine only, is a departure. The first "
        "module that departs while every module before it agreed is named, with both machines' errors against "
        "fp64 and the environment facts that differ.",
        why="The same model, weights and inputs give different results on two machines when their kernels round "
        "differently: fp16 accumulation in attention overflows on one GPU generation and not another, TF32 or "
        "reduced-precision reductions are on in one place only. The first departing module is where to act.",
        fix="Keep the named module in fp32 on this machine (`fpdoctor plan` there), turn off TF32 and "
        "reduced-precision reductions where the flags differ, and compare the environment facts that differ "
        "(`fpdoctor env` on both machines).",
    ),
    RuleInfo(
        code="NUM012",
        name="reference-inputs-differ",
        severity=W,
        untried=_BOTH_MACHINES,
        title="The two runs did not see the same inputs",
        what="The digest of an input set (every tensor's name, dtype, shape and values), the random draws the "
        "forward makes itself, or the number of input sets differ between the compare record and this run.",
        why="With other inputs every module's output differs for a reason that is not the machine; those input "
        "sets are not compared module by module.",
        fix="Give both machines the same inputs: seed the factory (torch.manual_seed) or load saved inputs, and "
        "the same seed for a forward that draws random numbers.",
    ),
    RuleInfo(
        code="NUM013",
        name="reference-weights-differ",
        severity=W,
        untried=_BOTH_MACHINES,
        title="The two runs did not use the same weights",
        what="Per module, a digest of its own parameters and buffers (name, dtype, shape, values) differs between "
        "the compare record and this run; the modules are named.",
        why="A module with other weights computes another output on any machine; what follows it cannot be "
        "blamed on the machine.",
        fix="Load the same checkpoint on both machines; a randomly initialised model needs the same seed.",
    ),
    RuleInfo(
        code="NUM014",
        name="reference-computation-differs",
        severity=E,
        untried=_BOTH_MACHINES,
        title="A module computes something else than on the recorded machine",
        what="With the same inputs and weights, a module's fp64 output differs from the record's by more than "
        "1e-9 relative, every module before it agreeing; fp64 on two machines differs by summation order only "
        "(about 1e-12). Modules or calls that only one of the two runs has are listed too.",
        why="The model's code or configuration is not the same on the two machines, or an op's definition "
        "changed between their library versions: results differ before any rounding does.",
        fix="Run the same code and configuration on both machines (the same commit, the same config files), and "
        "compare the library versions that differ.",
    ),
    RuleInfo(
        code="NUM015",
        name="grad-scaler-stalled",
        severity=E,
        title="GradScaler keeps skipping steps: the optimizer does not run",
        what="`trace` reads an enabled torch.amp.GradScaler's own found-inf flag and scale on every step it "
        "steps. Skipping that persists is reported: every step skipped (from 8 steps on: eight halvings take "
        "the default scale from 65536 to 256), 24 in a row, or a scale below 1. The finding names the origin "
        "of the recurring non-finite value: the producing op found on the most skipped steps, with its line "
        "(for a backward op, the forward op on your line: the backward of sqrt, not the div autograd ran).",
        why="A skipped step is a step the weights do not move. A NaN or an overflow that recurs at every scale "
        "is not the scaler calibrating: the loss stays flat, nothing crashes, and the run learns nothing.",
        fix="Fix the named op: an eps that rounds to 0 in fp16 (1e-12 does; 1e-4 does not), a product that "
        "overflows fp16 (scale the scores by 1/sqrt(d) before the matmul), or keep that op in fp32.",
    ),
    RuleInfo(
        code="NUM016",
        name="grad-scaler-calibrated",
        severity=I,
        title="GradScaler skipped steps while calibrating its scale",
        what="An enabled GradScaler skipped some optimizer steps for non-finite gradients, and the skipping did "
        "not persist (grad-scaler-stalled says when it does). The non-finite gradients of those steps are not "
        "blamed on an op: the scale made them.",
        why="fp16 loss scaling starts high (65536) and halves the scale on each overflow until the gradients "
        "fit: a few skipped steps at the start, and one now and then when the scale grows back, are by design.",
        fix="Nothing to do. To skip fewer steps, start lower: torch.amp.GradScaler(device, init_scale=2.0**10).",
    ),
    RuleInfo(
        code="NUM017",
        name="update-blew-up",
        severity=E,
        title="An optimizer update blew the weights up: the learning rate is too large",
        what="`trace` reads the largest |weight| of each optimizer's parameters before each of its steps and after "
        "its last (one reduction, read after the trace). An update that multiplies it by 100 or more in one step, "
        "or the updates that do it within 20 steps (momentum at a rate too high grows it 2x to 20x a step), is "
        "reported with the learning rate and its steps as the training log counts them, before the NaN or Inf it "
        "leads to; those later findings get the rate as their fix.",
        why="After such a step every activation and gradient is out of scale: the first op to overflow (a "
        "gradient norm, a matmul) is only where it shows, and its own fix (an epsilon, fp32) changes nothing.",
        fix="Lower the learning rate (warmup helps) and clip the gradients before the step "
        "(torch.nn.utils.clip_grad_norm_).",
    ),
    RuleInfo(
        code="NUM018",
        name="decisions-changed",
        severity=E,
        title="The candidate changes which class the output picks",
        what="When the model's output is logits (its last call is a Linear from features to classes), `compare` "
        "judges it by what it decides: top-1 agreement with fp64 over its rows, top-5 and KL, each beside the "
        "same metric for the exact output rounded to the candidate's format. Then it re-runs the candidate with "
        "the logits' layer, and with each of the worst modules, kept in fp32. `compare --against FILE` judges "
        "this machine's candidate the same way against the record's fp64 output (a record keeps each row's "
        "decisions), beside the recording machine's own candidate.",
        why="A relative error can stay small while the winning class changes: when the logits' norm sits in "
        "values no decision reads (a common offset, masked classes) or their margins are below the format's "
        "spacing. Accuracy drops while every error figure looks fine.",
        fix="Keep the named module in fp32 (return fp32 logits where the format cannot hold them); "
        "`fpdoctor plan` for a set of modules.",
    ),
    RuleInfo(
        code="NUM019",
        name="output-too-coarse",
        severity=W,
        title="The candidate's format is too coarse for the output: rounding it alone loses what it measures",
        what="When the model's output is not logits, `compare` judges its error in the output's units beside "
        "the floor (the exact output rounded to the candidate's format) and the output's spread (its standard "
        "deviation over the sampled values). Where the floor alone is 5% of the spread or more, it re-runs the "
        "candidate with the layer that makes the output kept in fp32, returning fp32. For logits, where rounding the "
        "exact output alone changes 1% of the decisions or more, it names the output's format, checked by the exact "
        "output held in fp32.",
        why="A regression output that sits far from zero and varies little about it (a temperature near 288 K "
        "that varies by 3 K) is rounded by bf16 in steps of 2: the error matches the floor, so every relative "
        "figure looks fine, while the prediction is several times worse than fp32's.",
        fix="Keep the output's layer in fp32 returning fp32, or predict the offset from a constant and add it "
        "back in fp32.",
    ),
    RuleInfo(
        code="NUM020",
        name="whole-numbers-rounded",
        severity=E,
        title="Whole numbers made inside the model in the candidate's format are rounded",
        what="In its fp64 pass `compare` notes each line of the model's forward that makes whole numbers in the "
        "model's dtype (an arange, integers cast to it: positions, timesteps, counts) past the largest whole "
        "number the candidate's format holds exactly (256 in bf16, 2048 in fp16). It re-runs the candidate "
        "with that line, and then the lines after it that read its values, in fp32, their results cast back, "
        "and names the line where that takes the end-to-end error down by 4x or more.",
        why="Past 256, bf16 holds every second whole number, then every fourth: position 1023 becomes 1024 and "
        "the distance between two nearby tokens becomes 0 or 4. Relative error figures barely move, because "
        "the large values are nearly right; what reads the small differences (a relative-position bias, a "
        "rotary angle, a count used as a divisor) is wrong.",
        fix="Make the whole numbers in fp32 (dtype=torch.float32, or integers then .float()), compute what "
        "reads them in fp32, and cast the result to the model's dtype.",
    ),
    RuleInfo(
        code="NUM021",
        name="random-draw-rounded",
        severity=E,
        title="A random draw made inside the model in the candidate's format biases what it samples",
        what="In its fp64 pass `compare` notes each line of the model's forward that draws random numbers in the "
        "model's dtype (rand_like, randn_like, uniform_ of an activation). With a 16-bit candidate it re-runs "
        "the candidate with that line, and then the lines after it that transform the draw, in fp32, their "
        "results cast back, and names the line where that takes the end-to-end error down by 4x or more. "
        "compare replays the fp64 run's draws in every run, so the errors compare like with like.",
        why="A uniform draw in bf16 takes bf16's values only: nothing between 0.996 and 1, and exactly 0 once in "
        "512 draws (torch gives 0 where a draw rounds up to 1). A spike u < p at p = 0.002 fires twice as often; a "
        "Gumbel noise -log(-log(u)) or an exponential time -log(u) made from it is capped and biased at the end "
        "that decides a sample, with no NaN and a relative error that looks like any other.",
        fix="Draw in fp32 (torch.rand_like(x, dtype=torch.float32)), transform the draw in fp32, and cast the "
        "result to the model's dtype.",
    ),
    RuleInfo(
        code="NUM022",
        name="selection-changed",
        severity=E,
        title="A selection inside the model (a router's top-k, an argmax, a bucket) picks other elements in the "
        "candidate",
        what="Where no module or op explains the end-to-end error, a module's output is far off while its floating "
        "inputs are not (an embedding fed other indices), or module calls got other shapes than in fp64, "
        "`compare` runs the forward in fp64, in the floor model's format and in the candidate, records what each "
        "topk, argmax, argmin, max/min over a dim and kthvalue picks (a top-k as a set), what each comparison "
        "(>, <, >=, <=: a threshold, a gate's mask) decides and which integer each rounding of floats makes (a cast "
        "to integers, floor, ceil, round, trunc, bucketize: a relative position's bucket), and names the first one "
        "that picks other elements than fp64 in 1% of its rows or more, and 4x the floor model's share. It then "
        "re-runs the candidate with that line, and the lines that made what it ranks (nearest first), in fp32, "
        "their results cast back, and names the first set that leaves 4x fewer rows changed.",
        why="A selection rounds nothing: it picks. Scores closer together than the format's spacing (a router's "
        "softmax over 8 experts near 1/8 is held in steps of 0.001 in bf16) are ranked differently, and the rows "
        "sent to another expert or codebook entry get a different computation. Each op is within its floor, so "
        "nothing stands out but the end-to-end error.",
        fix="Compute the scores and the selection in fp32 (the router's logits, softmax and topk on .float() "
        "operands) and cast what they feed back to the model's dtype.",
    ),
    RuleInfo(
        code="NUM023",
        name="gradients-still-scaled",
        severity=E,
        title="Gradients of a GradScaler-scaled output are read without unscaling them (a gradient penalty)",
        what="`trace` watches what `torch.autograd.grad(..., create_graph=True)` returns where it differentiates "
        "an output `GradScaler.scale` returned: the first op that reads those gradients must multiply them by "
        "1/scale or divide them by the scale (torch's AMP recipe for a gradient penalty); any other op reads "
        "them scaled.",
        why="Those gradients are the true ones times the loss scale. A penalty made from them grows with the "
        "scale (its square for a squared norm): it overflows at the first scales, the scaler backs off until "
        "the scaled penalty fits (a scale of a few dozen, which looks like calibration), and the penalty never "
        "measures the gradients it is meant to.",
        fix="Right after torch.autograd.grad: inv_scale = 1.0 / scaler.get_scale(); grads = [g * inv_scale for g "
        "in grads]; then compute the penalty from them.",
    ),
    RuleInfo(
        code="NUM024",
        name="error-builds-up",
        severity=W,
        title="No part of the model diverges, and the error it builds up is past what the format's rounding explains",
        what="Where no module, op, running state, selection or input explains the end-to-end error, `compare` "
        "judges it against the target `fpdoctor plan` aims for: 16x what rounding the exact output to the "
        "candidate's format costs, or 2x what rounding the inputs costs where that is more. Past it, compare "
        "re-runs the candidate with the worst 1, 2, 4, ... modules (by isolated error over floor) kept in fp32, "
        "up to six runs, and names the first set that reaches the target; a set that holds every module the model "
        "calls is the model in fp32, said so. fp16 and bf16 candidates only: plan keeps no module in fp32 for fp32.",
        why="Each module rounds a little, within a few times its floor, and a deep model compounds it: a "
        "normalizing flow's couplings, each 2-3x its floor, carry 20x to the log-likelihood. No single change "
        "takes it away, so no other finding fires; an OK would say nothing is wrong where plan, on the same "
        "model, finds the output past its target.",
        fix="Keep the named modules in fp32 (`fpdoctor plan` finds the smallest set and writes the code), or run "
        "the model in fp32 where this output matters.",
    ),
)

TRN_RULES: tuple[RuleInfo, ...] = (
    RuleInfo(
        code="TRN001",
        name="nonfinite-loss",
        severity=E,
        untried=_SYMPTOM,
        title="The loss was NaN or Inf",
        what="The training sentinel checks the loss on the device every step.",
        why="A non-finite loss means a non-finite gradient; stepping would corrupt the weights.",
        fix="See the replay verdict (deterministic-nonfinite or transient-fault-suspected) for the cause.",
    ),
    RuleInfo(
        code="TRN002",
        name="nonfinite-gradient",
        severity=E,
        untried=_SYMPTOM,
        title="A gradient was NaN or Inf",
        what="The sentinel reduces all gradients to one finite flag per step, read once per step.",
        why="One non-finite gradient poisons every parameter it reaches through the optimizer.",
        fix="See the replay verdict for the op that produced it; the step was skipped.",
    ),
    RuleInfo(
        code="TRN003",
        name="loss-spike",
        severity=W,
        untried=_HISTORY,
        title="The loss jumped far above its recent level",
        what="Compares each finite loss with a running mean and deviation of recent steps.",
        why="Spikes often precede divergence to NaN (fp16 overflow, a bad batch, too high a learning rate).",
        fix="Inspect the batch of that step; consider gradient clipping or a lower learning rate.",
    ),
    RuleInfo(
        code="TRN004",
        name="transient-fault-suspected",
        severity=E,
        untried=_MACHINE,
        title="A non-finite step did not reproduce when replayed: the machine, a race, an uninitialised read or a "
        "nondeterministic kernel",
        what="The sentinel replays the failing step with the same batch, RNG state and weights under trace; a "
        "replay that stays finite means the first run did not compute what the code asks for. Experiments on "
        "the same step then tell four causes apart (evidence.cause, evidence.experiments): run again as it ran "
        "(does the result vary, bit for bit?), under torch.use_deterministic_algorithms (one result: a "
        "nondeterministic kernel), with fill_uninitialized_memory putting NaN in every fresh tensor (NaN in the "
        "result: an uninitialised read), with a synchronisation after every op and no memory block reused within "
        "the step (one finite result: a race), and on another device (a second GPU, or the CPU). A step whose "
        "every re-run gives one finite result was the machine's; one that no experiment explains is undecided, "
        "with what was tried. The causes of the first 3 such steps are told apart; not under torch.distributed.",
        why="Each cause has another owner: a faulty GPU (Xid errors, ECC, silent bit flips) is drained, a race or "
        "an uninitialised read is a bug in the code or a kernel, a nondeterministic kernel is a setting. Calling "
        "them all the machine drains healthy nodes and leaves code bugs in place.",
        fix="The machine: check the named device (fpdoctor health, nvidia-smi -q -d ECC, dmesg for Xid) and drain "
        "it if it repeats. A race: make the read wait for its write (wait_stream, record_stream). An uninitialised "
        "read: torch.zeros in place of torch.empty. A nondeterministic kernel: torch.use_deterministic_algorithms"
        "(True). Each finding carries the fix its cause calls for, tried where a re-run can try it.",
        references=(
            "https://docs.pytorch.org/docs/stable/deterministic.html",
            "https://docs.pytorch.org/docs/stable/notes/cuda.html#cuda-semantics",
        ),
    ),
    RuleInfo(
        code="TRN005",
        name="deterministic-nonfinite",
        severity=E,
        title="A non-finite step reproduced on replay: a numerical bug at the named op",
        what="The replay under trace produced the same non-finite values and found the op that produced them. "
        "When the step computed in fp16/bf16, a control replay follows with every fp16/bf16 parameter, buffer "
        "and input in fp32 and autocast off (evidence.control_fp32): finite there means the precision is the "
        "cause; non-finite there too means the data or the model's math.",
        why="The same inputs give the same NaN: it is the model or its precision, not the hardware; the control "
        "replay tells which of the two.",
        fix="Fix the producing op named in the finding (see nonfinite-produced).",
    ),
    RuleInfo(
        code="TRN006",
        name="amp-scale-collapse",
        severity=E,
        untried=_SYMPTOM,
        title="The GradScaler's loss scale keeps falling: fp16 gradients overflow step after step",
        what="Under torch.amp.GradScaler an overflowing step is expected now and then (the scaler skips it "
        "and halves the scale); the sentinel counts those skips and reports when the scale falls below 1 or "
        "24 steps in a row are skipped.",
        why="A scale below 1 means the gradients overflow fp16 even unscaled; every skipped step is a step "
        "the model does not learn from, and the loss curve flattens while nothing reports a NaN.",
        fix="Find the op that overflows (the finding's replay names it when it can): keep it in fp32, rescale "
        "it, or train in bf16, which has fp32's range.",
    ),
    RuleInfo(
        code="TRN007",
        name="sentinel-error",
        severity=W,
        untried=_OWN,
        title="The sentinel could not check a step; training went on unguarded",
        what="A failure inside the sentinel itself (reading the loss, the gradient check, the replay, a DDP "
        "hook). It is reported once per distinct error, never raised into the training step.",
        why="The steps it names were not checked for NaN/Inf, so a bad step there could have reached the "
        "weights unnoticed.",
        fix="Read the message: usually step_fn returned something that is not the loss tensor. Otherwise "
        "report it to fpdoctor with the message.",
    ),
    RuleInfo(
        code="TRN008",
        name="checkpoint-failed",
        severity=W,
        untried=_OWN,
        title="The sentinel could not write its last-good checkpoint",
        what="Writing checkpoint_path failed (missing directory, full disk, permissions); training went on and "
        "the previous checkpoint, if any, was left as it was.",
        why="Without it there is no last-good state to go back to after a bad step.",
        fix="Create the directory or free space at the path named in the finding.",
    ),
    RuleInfo(
        code="TRN009",
        name="training-stalled",
        severity=E,
        title="Training is not progressing: most optimizer steps are skipped",
        what="The step judge counts the optimizer steps that were not applied (non-finite steps it skipped, "
        "overflows the GradScaler skipped); when 8 of the last 10 were, or every step so far, it says so once "
        "per episode, with the counts kept current and the cause the evidence points to.",
        why="A skipped step is a step the model does not learn from: a run whose steps are all skipped reports "
        "a flat loss and no crash, while its weights never move.",
        fix="Follow the cause the finding names: a loss that climbed before the first skip points at the learning "
        "rate (the finding names the lower rate that kept a few steps from the climb's start finite, tried on "
        "copies of the model and optimizer, or says why none was tried); an op whose fp32 replay is finite "
        "points at its precision; a scaler that skips every step at an op that overflows fp16 even unscaled.",
    ),
    RuleInfo(
        code="TRN010",
        name="update-rounded-away",
        severity=W,
        title="Optimizer updates are rounded away: low-precision weights stop moving",
        what="On a sample of each bf16/fp16 trainable parameter (every 10th optimizer step, then, after three, as far "
        "apart as keeps a measured step under 0.5% of the steps' time), the update the step "
        "intends, computed by the same optimizer in fp32 on the sample, against what the step did to the weights: "
        "an element bit-identical after the step although its update was non-zero was rounded away. Weight decay "
        "is counted apart (lr*wd*|w| against half the spacing). Reported when parameters holding a quarter of the "
        "low-precision weights lose half their updates or more, with the dtype's spacing at their magnitude "
        "against the update size and the update-to-weight ratio; the fix is tried by a short what-if run on copies "
        "(the sentinel, `fpdoctor watch` and the callbacks; `trace` says it is untried). `trace` also redoes the first "
        "in-place running updates of each source line outside the optimizer (an EMA of weights, a running statistic "
        "in bf16/fp16) exactly and in fp32: a line whose tensor keeps under half of every update it was given; "
        "and BatchNorm's running statistics, in bf16/fp16 when the model was cast whole, on training calls spread "
        "over the run (the 1st, 2nd, 4th, ...): a statistic that lost half of each of its latest three updates.",
        why="A bf16 weight near 0.05 has neighbours 2^-12 apart; an update below half that gap (AdamW at lr 1e-4, SGD "
        "with small gradients) leaves it bit for bit as it was. Nothing goes NaN: the loss stops falling short of "
        "what fp32 reaches, and weight decay is lost entirely. A larger learning rate is not the fix: the update "
        "must clear the gap of the largest weights, which makes it far too large for the rest.",
        fix="Keep fp32 master weights: the optimizer steps fp32 copies and the model computes with casts of them "
        "(+4 bytes per parameter, and the optimizer state in fp32). Or keep the model in fp32 and compute in "
        "bf16 under torch.autocast (the usual mixed precision); or a bf16 optimizer with stochastic rounding "
        "(torchao's AdamW(bf16_stochastic_round=True), no extra memory) or Kahan summation (torch-optimi's "
        "kahan_sum=True, +2 bytes per parameter).",
        references=("https://arxiv.org/abs/2010.06192",),
    ),
    RuleInfo(
        code="TRN011",
        name="accumulation-stalled",
        severity=W,
        title="A low-precision accumulator stopped growing: its additions change nothing",
        what="Gradients accumulated over micro-batches in a bf16/fp16 .grad (every micro-batch's gradient summed "
        "in fp32 on a sample, against the .grad the step reads) and low-precision optimizer state (Adam's "
        "exp_avg_sq in bf16: what the same step does to an fp32 copy of it, against what it did to the state). "
        "Reported when the low-precision sum is 5% or more off the fp32 one, or half the state elements the fp32 "
        "step changes stay as they were (or flush to zero).",
        why="Once a bf16 sum is 256 times its addend, each addition is below half its spacing and vanishes: a "
        "gradient accumulated over many micro-batches is short of the true one, and exp_avg_sq (multiplied by "
        "0.999 each step, a change below bf16's spacing) stops following the gradients.",
        fix="Accumulate in fp32: fp32 master weights (their .grad and the optimizer state are fp32), or add each "
        "micro-batch's gradient into an fp32 buffer (acc += p.grad.float(); p.grad = None) and step on that.",
    ),
    RuleInfo(
        code="TRN012",
        name="compiled-only-nonfinite",
        severity=E,
        untried=_COMPILER,
        title="The compiled program makes NaN/Inf that the same step run eagerly does not",
        what="A step of a torch.compile'd model was non-finite; replayed eagerly under trace (same batch, RNG "
        "state and weights) it was finite, and run compiled once more it was non-finite again. Every finding of a "
        "compiled model says where it was seen (evidence.seen_in: compiled, or eager replay). The first Dynamo "
        "graph whose finite inputs gave NaN/Inf is named (evidence.compiled_graph), run eagerly node by node, "
        "recompiled alone, with emulate_precision_casts, and bisected with CompilerBisector "
        "(evidence.graph_compiled); a reproducer of the graph is written and run once (evidence.reproducer). "
        "Under trace, the graphs compiled in the block run compiled and the first graph whose finite inputs gave "
        "NaN/Inf is judged the same way when its ops run eagerly are finite.",
        why="The compiled kernels do not compute what the model's eager ops compute: a fusion, a decomposition or "
        "lowering, or an intermediate kept in lower precision. The eager trace cannot name the op, because the "
        "eager ops are finite.",
        fix="Where emulate_precision_casts made the graph finite, set torch._inductor.config.emulate_precision_casts "
        "= True. Where the bisector named a pass, run the reproducer with each side's TORCH_BISECT_* variables "
        "and report it to PyTorch (or to the owner of a custom pass). Meanwhile compile less "
        "(torch.compiler.disable on the code the graph covers) or run it eagerly.",
    ),
    RuleInfo(
        code="TRN013",
        name="compiled-departure",
        severity=E,
        untried=_COMPILER,
        title="A module compiled computes something else than the same module run eagerly",
        what="compare --candidate compiled (compiled-bf16, compiled-fp16) runs the model compiled by Inductor and "
        "eagerly in the same dtype, both against fp64. Where the two differ by more than the floor (rounding to the "
        "dtype, or eager's own error against fp64, whichever is larger), each child module on the way down is "
        "compiled alone and fed the fp64 run's inputs, to the first module that departs by itself; that module is "
        "compiled again with emulate_precision_casts. Reported when the departure stays: the compiled program, "
        "not its rounding, changes the result.",
        why="A fusion, decomposition, lowering or custom pass that computes another function than the eager ops "
        "gives numbers eager never gives; training and evaluation then describe different programs.",
        fix="Compile the named module alone on its inputs and bisect the compiler on it (PyTorch's "
        "CompilerBisector), then report it to PyTorch (or to the owner of a custom pass); meanwhile "
        "torch.compiler.disable the module.",
    ),
    RuleInfo(
        code="TRN014",
        name="compiled-fused-precision",
        severity=I,
        title="Compiled and eager differ because Inductor keeps low-precision intermediates in fp32",
        what="compare --candidate compiled-bf16 (or compiled-fp16) found a module whose compiled output departs from "
        "its eager output beyond the floor, and the departure falls to eager's level when the module is compiled "
        "with torch._inductor.config.emulate_precision_casts=True.",
        why="Inductor fuses elementwise chains and keeps their intermediates in fp32, where eager rounds each one to "
        "bf16/fp16: the compiled result is usually closer to fp64, but not bit-like eager. Expected, not a bug.",
        fix="Nothing is wrong. To make compiled match eager (e.g. to compare losses), set "
        "torch._inductor.config.emulate_precision_casts = True.",
    ),
    RuleInfo(
        code="TRN015",
        name="gradients-depart-from-reference",
        severity=W,
        title="The gradients depart from the same step computed in fp32",
        what="On the first judged step and every 500th after, the Sentinel runs the step again from the same "
        "weights, batch and RNG under a reference recipe (fp32 parameters and math, no autocast, no loss scaling) "
        "on copies of the parameters, and compares each parameter's gradient with the step's own, as the backward "
        "left them and as step_fn handed them to the optimizer. A norm more than twice or under half the "
        "reference's, or a cosine under 0.9, is a departure; the stage where the two part is named.",
        why="A recipe's rounding moves gradients by a fraction of a percent; a departure this large means the "
        "recipe computes another step: gradients flushed to zero in fp16, processing that reads a gradient still "
        "multiplied by the loss scale, a module whose precision loses its signal. No rule has to foresee it: "
        "the run trains, slower or not at all, and every check that looks for NaN says OK.",
        fix="Depends on the stage: unscale before clipping (optimizer), scale the loss where gradients flush "
        "to zero (backward), or keep the module that owns the departing parameters in fp32.",
    ),
    RuleInfo(
        code="TRN016",
        name="training-not-progressing",
        severity=W,
        title="The loss stopped improving, and the same steps in fp32 improve it",
        what="Every 200 finite steps the judge compares the mean loss of the window's two halves. When the "
        "second is no better than the first beyond the noise, it runs 8 optimizer steps on the last step's batch "
        "from its state twice, on copies: in your recipe and in fp32 without autocast. The reference lowering "
        "the batch's loss by 2% while your recipe makes under a quarter of that is this finding.",
        why="A flat loss alone is no diagnosis: a converged run is flat too, and so is one whose learning rate is "
        "wrong. The same steps from the same state in a known-good recipe tell them apart: where fp32 makes the "
        "progress and your recipe does not, the precision is what stops the run, whatever rule did or did not fire.",
        fix="Find the part of the recipe that loses the step: the reference step's gradients (TRN015), updates "
        "rounded away (TRN010), or a sum or residual in bf16/fp16 whose small terms round away in the forward.",
    ),
    RuleInfo(
        code="TRN017",
        name="silent-corruption-suspected",
        severity=E,
        untried=_MACHINE,
        title="One rank's device computes finite wrong numbers: its gradients leave the spread of the others'",
        what="Under DDP each rank's own gradient norm, taken before the all-reduce, travels in the sentinel's "
        "per-step all-reduce (one float per rank). The log-ratio of each rank's norm to the median over ranks is "
        "calibrated on the run's first 32 finite steps (each rank's median, one spread: 1.4826 x the median "
        "absolute deviation) and recalibrated every 64 steps on the last 256 without a strike. A rank beyond 8 "
        "spreads is a strike; 3 strikes in 32 steps escalate: up to 8 of the model's nn.Linear layers are run "
        "again on every rank, 16 times each on seeded inputs, against the same product in fp64 and against every "
        "other rank's results. The rank whose results leave the rounding bound, or differ where all other ranks "
        "agree, is named by rank, host, device, GPU index and UUID (evidence: the calibration, the strikes, the "
        "recomputation).",
        why="Most corruption makes no NaN: a flipped bit, a wrong tile of a GEMM or a stale buffer gives finite "
        "wrong numbers, which DDP averages into every rank's gradients and the checkpoints keep. A check that waits "
        "for a NaN finds it days later, or never.",
        fix="Check the named device (fpdoctor health on its host, nvidia-smi -q -d ECC, the kernel log for Xid "
        "errors), drain it, and resume from a checkpoint written before the first strike.",
    ),
    RuleInfo(
        code="TRN018",
        name="update-departs-from-reference",
        severity=W,
        title="The gradients agree with the fp32 step, but the update the weights get departs from its update",
        what="On a reference step whose gradients agree with the fp32 step's (TRN015), the same optimizer (its "
        "class, hyperparameters and state, copied) is stepped once over fp32 copies of the weights on the "
        "reference's gradients, and once over copies at your weights' and state's own dtypes on your step's "
        "gradients (the update it intended); when the next step begins, the change your weights kept is taken "
        "too. Each parameter's update against the reference's: a norm more than twice or under half, or a cosine "
        "under 0.9, is a departure, with the update-to-weight ratio of each; the stage where they part is named, "
        "and for the kept stage the calls from your code that wrote the weights between the two steps, with their "
        "lines.",
        why="A step can compute the right gradients and still lose its update: a bf16 weight or optimizer state "
        "rounds it away, a weight decay applied again after the optimizer's, an update clipped or zeroed by code "
        "that writes the weights. Nothing goes NaN and the gradients look healthy; only the update against a "
        "known-good one shows where the step is lost.",
        fix="Depends on the stage: keep fp32 master weights and optimizer state (intended), or remove or correct "
        "the code that writes the weights after the optimizer's step (kept).",
    ),
    RuleInfo(
        code="TRN019",
        name="output-too-coarse-in-training",
        severity=W,
        title="The model's output is in a format too coarse for what it predicts",
        what="At steps 4, 8, 16, 32, 64, then every 64th, `fpdoctor watch`, the callbacks and the Sentinel read the "
        "model's output as the training forward made it (the Lightning callback and the Sentinel, which see only "
        "the loss, from the model's own call on those steps, hooked for that call alone): for "
        "an output in bf16/fp16 with few columns (a regression, not logits), each column's mean magnitude, its "
        "spread over the batch (standard deviation) and what rounding to the format costs at that magnitude on "
        "average (a quarter of its spacing there). Where rounding alone costs 5% of the spread or more, the "
        "output cannot hold what the model is asked to predict.",
        why="A regression target far from zero that varies little (a temperature near 288 K that varies by 3 K) "
        "sits where bf16's spacing is 2: the loss is computed on values rounded by a large share of what they "
        "vary by, and the fit stalls at that error with no NaN and no gradient out of line. watch's reference step "
        "replays the backward from the gradient that reached the output, so it cannot see it; where the reference "
        "step runs the forward in fp32 (the Lightning callback, the Sentinel), its gradients depart (TRN015), and "
        "this finding goes ahead of that departure as its cause.",
        fix="Return the output in fp32 (its last layer outside autocast on its input .float(), or kept in fp32 in "
        "a model cast to bf16), or predict the offset from a constant and add it back in fp32.",
    ),
    RuleInfo(
        code="TRN032",
        name="input-too-coarse-in-training",
        severity=W,
        title="The model's input reaches it in a format too coarse for what it varies by",
        what="`fpdoctor watch` reads the training forward's floating inputs at steps 1, 2, 4, 8, ... then every "
        "64th, as TRN019 reads its outputs: for an input in bf16/fp16 with at most 256 features, each feature's mean "
        "magnitude, its spread over the batch and what rounding to the format costs there (a quarter of its "
        "spacing). Where rounding costs 5% of the spread or more at two checks in a row, the input is named.",
        why="Raw readings far from zero that vary little (air pressure near 1013 hPa varying by 4, bf16's spacing "
        "there 8) cast to bf16 before the model keep a few distinct values: the standardisation inside the model "
        "subtracts the offset from values already rounded, and the model learns from what is left. Nothing is NaN "
        "and no precision of the model's own gives the information back.",
        fix="Standardise the inputs in fp32 before casting them, or feed them in fp32 and keep the model's first "
        "layer and its standardisation in fp32.",
    ),
    RuleInfo(
        code="TRN034",
        name="step-not-replayed",
        severity=W,
        title="A non-finite step could not be run again: neither the code nor the machine is named",
        what="The front end replays a bad step from the micro-batches it saw go through the model's forward. "
        "Where none did (a Trainer's compute_loss of the script's own that calls the model's submodules directly, "
        "a forward the front end does not hook), there is nothing to run again; the step is still skipped.",
        why="A replay that runs something else than the step (no micro-batch at all, or another forward) cannot "
        "tell a bug of the code from a fault of the machine: an empty replay reads as a finite one, and the "
        "machine would be blamed for a NaN the code makes on every run.",
        fix="Run `fpdoctor trace -- <your script>`: it follows the loss code op by op (a compute_loss of your own "
        "included) and names the op that makes the NaN/Inf, with its fix checked.",
    ),
    RuleInfo(
        code="TRN033",
        name="updates-outside-optimizer",
        severity=W,
        title="The model's weights changed, and no torch.optim optimizer stepped: no update was judged",
        what="`fpdoctor watch` judges the steps of torch.optim optimizers. Where 20 or more training forwards "
        "ran, backwards reached them and no such optimizer stepped, it keeps a few values of the model's first "
        "trainable weights at the 20th forward and reads them again at the report: changed, the weights were "
        "updated by code of the script's own (a hand-written optimizer, `p.data.add_(...)`), which the watch does "
        "not see, so nothing was judged; the report says so instead of OK.",
        why="A hand-written Adam or SGD whose states are created with `torch.zeros_like(p)` on a bf16 model keeps "
        "them in bf16, where `v.mul_(0.999)` rounds back to `v`: the run trains worse, nothing is NaN, and a "
        "watch of optimizer steps sees none.",
        fix="Run `fpdoctor trace -- <your script>`: it follows the update op by op and names a running state or "
        "an update that the format rounds away. Or write the optimizer as a torch.optim.Optimizer subclass, "
        "whose steps the watch judges.",
    ),
    RuleInfo(
        code="TRN035",
        name="loss-not-scaled",
        severity=E,
        title="The backward ran on the unscaled loss, and the GradScaler divided its gradients by the scale",
        what="`fpdoctor watch` notes each tensor the script hands `scaler.scale()` in a step: a backward run on "
        "one of them (the loss itself, not the scaled loss scale() returned) before a `scaler.step()` of that "
        "step is named with both lines.",
        why="`scaled = scaler.scale(loss); loss.backward()` gives gradients of the loss as it is, and "
        "scaler.step() divides them by the loss scale (65536 at first) before the optimizer's step: under SGD "
        "every update is 1/65536 of the one meant and the loss barely moves, with no NaN; Adam's updates divide "
        "the factor out except near its eps (a warning there), and the scale no longer protects fp16 gradients. "
        "A reference step of the same step agrees with the backward: the gradients are right until the scaler "
        "divides them.",
        fix="Call .backward() on what scaler.scale() returns: `scaler.scale(loss).backward()`.",
    ),
    RuleInfo(
        code="TRN036",
        name="loss-scale-not-undone",
        severity=E,
        title="The loss was multiplied by a scale of the script's own, and the gradients were never divided by it",
        what="`fpdoctor watch` reads each backward's root: a loss multiplied by a power of two of at least 128 "
        "(`(loss * 1024).backward()`, with no GradScaler) is a loss scale written by hand, and the reference step "
        "divides it out of both runs. Where the gradients the optimizer took are still the scale times the "
        "backward's, the optimizer's step is run on copies of the weights and its state as taken, with the scale "
        "divided out, and on the fp32 reference's gradients; the finding is made where the updates as taken "
        "depart from the reference's and names the parameters the division missed.",
        why="A hand-written scale keeps small fp16 gradients from flushing to zero in the backward, and the "
        "optimizer must then take them divided by it (GradScaler's unscale_ does that). Left out, SGD steps the "
        "scale times too far (1024x the learning rate meant): the weights grow by orders of magnitude in a few "
        "steps and the run goes NaN, and a rule that judges each step's values alone names the learning rate or "
        "the op that overflowed. Adam and its kin divide the factor out but for their eps: no finding there.",
        fix="Divide every gradient by the scale between the backward and the optimizer's step "
        "(`for p in model.parameters(): p.grad.div_(scale)`), or use torch.amp.GradScaler.",
    ),
    RuleInfo(
        code="TRN037",
        name="loss-divided-twice",
        severity=W,
        title="The loss was divided by the number of micro-batches twice: the gradients are that many times too small",
        what="`fpdoctor watch` reads each backward's root: where every backward of a step of k micro-batches ran "
        "on the loss divided by k * k (a loss function that returns `loss / accum`, divided again by the loop), "
        "the optimizer's step is run on copies of the weights and its state on the gradients as taken and on k "
        "times them (the loss divided once); the finding is made where the updates differ by more than 2x.",
        why="Gradient accumulation divides each micro-batch's loss by k so that the summed gradients are their "
        "mean. Divided twice, they are 1/k of it: SGD steps k times less (a learning rate k times lower) and the "
        "loss falls slower, with no NaN and nothing skipped, and a reference step of the same code agrees with it. "
        "Adam divides the factor out but for its eps: no finding there.",
        fix="Divide the loss by the number of micro-batches once: drop the second division.",
    ),
    RuleInfo(
        code="TRN020",
        name="training-never-stepped",
        severity=E,
        title="Training forwards ran, and no backward and no optimizer step followed them",
        what="`fpdoctor watch` counts the forwards of a model in training mode with trainable parameters and "
        "gradients enabled, and those a backward (or torch.autograd.grad) reached. Where 20 or more ran, an "
        "optimizer held the model's parameters, no backward reached any and no optimizer stepped, the script "
        "trained nothing and nothing was judged: the report says so instead of OK.",
        why="A loop that skips the step when its loss is not finite (`if not torch.isfinite(loss): continue`) "
        "runs every forward and never learns when every loss is: no NaN reaches a gradient, no step is skipped "
        "by a scaler, and a watch that judges steps sees none to judge.",
        fix="Find why the loss is skipped: `fpdoctor trace` follows the loss op by op and names the op that makes "
        "it non-finite, with its fix checked.",
    ),
    RuleInfo(
        code="TRN021",
        name="unscaled-then-accumulated",
        severity=E,
        title="A backward added scaled gradients to gradients the GradScaler had already unscaled",
        what="`fpdoctor watch` follows the script's `scaler.unscale_(optimizer)` and `scaler.update()` calls: a "
        "backward after an unscale_ and before that optimizer's step that writes into gradients holding values "
        "mixes gradients divided by the loss scale with gradients still multiplied by it. The first such step gets "
        "a reference step: the gradients the optimizer took, and the step's micro-batches summed and unscaled "
        "once, are each compared by direction with the fp32 reference's. The finding names the unscale_ and "
        "update() lines and the micro-batch loop that holds them, read from the script.",
        why="Gradient accumulation that unscales and clips on every micro-batch divides each earlier micro-batch's "
        "gradients by the scale again at every later unscale_ (65536 once more: 1.5e-5 of their weight). "
        "GradScaler raises at a second unscale_ in one step, and a scaler.update() after each micro-batch silences "
        "it: the optimizer then steps on the last micro-batch alone, the loss falls slower, and nothing is NaN or "
        "skipped.",
        fix="Unscale once per optimizer step: after the last micro-batch's backward, call scaler.unscale_(optimizer), "
        "the clip, scaler.step(optimizer) and scaler.update(), once each.",
    ),
    RuleInfo(
        code="TRN022",
        name="gradients-cleared",
        severity=E,
        title="The optimizer stepped on gradients cleared after the backward",
        what="`fpdoctor watch` notes a `zero_grad()` (an optimizer's, or a module's that holds the optimizer's "
        "parameters) called after a backward and before that optimizer's step, and confirms it at the step: every "
        "gradient the optimizer holds is None or zero. The finding names the zero_grad() line and counts the steps.",
        why="`loss.backward(); optimizer.zero_grad(); optimizer.step()` throws the step's gradients away before "
        "the optimizer reads them: the weights do not move by any gradient, the loss stays flat, and nothing is "
        "NaN or skipped, so a judge of values alone sees a healthy run.",
        fix="Call zero_grad() where a step begins (before the forward) or just after optimizer.step(), never between "
        "loss.backward() and optimizer.step().",
    ),
    RuleInfo(
        code="TRN023",
        name="lr-zero-group",
        severity=W,
        title="A param group's learning rate is 0: its parameters never move",
        what="`fpdoctor watch` and the callbacks read each optimizer's param groups at every step: a group whose "
        "lr is 0 at the first step and at the report while another group's is not is named with its parameters; "
        "every group's lr at 0 for the last quarter of the run (20 steps or more) is named with the step it "
        "reached 0.",
        why="A group left at lr 0 (a typo in the param_groups, a scheduler factor of 0 for it) trains nothing, "
        "while its parameters still require gradients and pay for their backward: the model learns with part "
        "of itself, nothing is NaN, and a judge of values sees a healthy run. A schedule that ends early (sized "
        "in epochs, stepped per step) holds the whole model there.",
        fix="Give the group its learning rate; to freeze parameters on purpose, call requires_grad_(False) on them.",
    ),
    RuleInfo(
        code="TRN024",
        name="weight-decay-too-strong",
        severity=W,
        title="The weight decay alone holds the weights near 0",
        what="`fpdoctor watch` and the callbacks read each optimizer's param groups: where the decay is applied apart "
        "from the gradient (AdamW, SGD, a decoupled_weight_decay flag) and weight_decay is 10 or more, or lr x "
        "weight_decay at the group's highest lr is 0.1 or more, the group is named with the share of its weights "
        "the decay takes each step.",
        why="AdamW multiplies the weights by 1 - lr x weight_decay every step before the update: weight_decay=1e3 "
        "meant as 1e-3 sets them to 0 at lr 1e-3, and 10 takes 1% a step. The gradients cannot hold the weights up: "
        "the loss stays high, nothing is NaN, and the update check agrees with the optimizer it copies.",
        fix="Lower weight_decay: AdamW multiplies it by the learning rate, so 0.01 to 0.1 is usual.",
    ),
    RuleInfo(
        code="TRN025",
        name="parameters-outside-optimizer",
        severity=E,
        title="The forward trains parameters no optimizer holds, and the optimizer holds tensors no forward uses",
        what="`fpdoctor watch` reads each optimizer at its first step: the tensors it holds that no training "
        "forward used (and that got no gradient), and the parameters of the model that got a gradient and are "
        "held by no optimizer that stepped in the run. Both together are the finding, with the line that "
        "replaced the module where the script has one.",
        why="An optimizer holds the tensors it was given when it was built: `model.head = nn.Linear(...)` after "
        "`AdamW(model.parameters())` leaves it stepping the old head, which is no longer in the model, while the "
        "new head gets a gradient every step and never moves. The loss is finite and flat, nothing is NaN.",
        fix="Build the optimizer after the model is final (after the line that replaces the module), or add the "
        "new parameters: optimizer.add_param_group({'params': model.head.parameters()}).",
    ),
    RuleInfo(
        code="TRN026",
        name="scheduler-per-micro-batch",
        severity=W,
        title="The LR scheduler steps once per micro-batch, and its schedule ran out early",
        what="`fpdoctor watch` and the callbacks count, at the report, each scheduler's steps against its optimizer's:"
        " a whole number of 2 or more per optimizer step, as many as the training forwards per step, where the "
        "schedule is sized in optimizer steps (its declared length is under half the steps it took, or a "
        "LambdaLR's factor is at its final value where one step per optimizer step would not be).",
        why="With gradient accumulation, `scheduler.step()` inside the micro-batch loop runs the schedule k times "
        "too fast: a warmup ends k times early and the decay reaches its floor after 1/k of the run, where the "
        "rate stays. Every update is smaller than planned; nothing is NaN and the loss falls, slower.",
        fix="Call scheduler.step() once per optimizer step, next to optimizer.step(), out of the micro-batch "
        "loop; or size the schedule in micro-batches.",
    ),
    RuleInfo(
        code="TRN027",
        name="optimizer-eps-too-large",
        severity=W,
        title="The adaptive optimizer's eps dominates its denominator: every update shrinks",
        what="`fpdoctor watch` and the callbacks read each adaptive optimizer's state at the report: where eps is 1e-4"
        " or more and the median root of the bias-corrected second moment is under a tenth of it, the updates are"
        " lr x m / eps, a tenth or less of the optimizer's own step. Named with eps, the gradients' size and the "
        "share.",
        why="Adam divides each update by sqrt(v) + eps; eps is there to keep the division finite (1e-8). Typed 1.0 "
        "or 1e-1 it is larger than the gradients and the step becomes a small SGD step: nothing is NaN, the loss "
        "falls slowly, and a reference step with the same optimizer agrees.",
        fix="Set eps back to the optimizer's default (1e-8 for Adam and AdamW).",
    ),
    RuleInfo(
        code="TRN029",
        name="grad-scaler-rebuilt",
        severity=E,
        title="A new GradScaler is made every step: its scale never calibrates",
        what="`fpdoctor watch` notes which GradScaler steps each optimizer: a new one on half of the scaled steps "
        "or more (and at least 3 times) is named with the steps, the skipped steps and the init scale each started "
        "at.",
        why="A GradScaler halves its scale after an overflow and keeps it: that is how it finds a scale the "
        "gradients fit. Made inside the step, each starts at its init scale (65536) and is thrown away, so every "
        "step whose gradients overflow there is skipped, and the scale reads 65536 on every step.",
        fix="Build the GradScaler once, before the training loop, and step every optimizer step with that one.",
    ),
    RuleInfo(
        code="TRN030",
        name="autocast-spans-steps",
        severity=E,
        title="An autocast block holds the optimizer's steps: every forward runs the weights of its first",
        what="`fpdoctor watch` probes autocast's cast cache at the training forwards of a few steps: a 1x1 tensor "
        "of its own, cast under the forward's autocast at one step and changed, is cast again at the next; where the "
        "old value comes back, the cache outlived the optimizer's step. The line that opened the region is named, "
        "and the step's forward is run again with the weights cast afresh to say what the stale casts cost. A block "
        "that ends every step is no finding.",
        why="Autocast casts each fp32 weight to fp16/bf16 once per `with torch.autocast(...)` block and reuses "
        "that copy until the outermost block exits. A block around the epoch or the training loop casts the "
        "weights at its first forward and never again: the optimizer moves the fp32 weights, the forward runs the "
        "old copies, and the loss stays where it was with nothing NaN. PyTorch's AMP notes: autocast should wrap "
        "only the forward pass and the loss.",
        fix="End the autocast block before the backward: `with torch.autocast(...):` around the forward and the "
        "loss inside the loop, then `loss.backward()` and `optimizer.step()` outside it.",
        references=("https://pytorch.org/docs/stable/amp.html#autocasting",),
    ),
    RuleInfo(
        code="TRN031",
        name="gradients-all-zero",
        severity=E,
        title="Every gradient the optimizer received was exactly 0",
        what="`fpdoctor watch` reads whether any gradient value the optimizer holds is nonzero at its steps 1, 10, "
        "100 and 1000 (under torch.distributed, after DDP's all-reduce, which the reference step cannot "
        "recompute; on one process, as the backward left them, which the reference step replayed from the model's "
        "outputs sees as zeros too): every look finding only zeros, at two looks or more, is named, with the DDP "
        "model's compressing communication hook where it has one.",
        why="A gradient of exactly 0 moves nothing: the loss stays where it was and nothing is NaN. torch's "
        "fp16_compress_hook casts each gradient bucket to float16 before the all-reduce, and float16 rounds "
        "every value under 2.98e-08 (half its smallest subnormal) to 0: a loss of 1e-8 (targets in units far "
        "larger than the model's outputs) makes gradients that small. On one process, a loss the script made 0 "
        "(a token count summed in float16 past 65504 is Inf, and the sum divided by it is 0) does the same.",
        fix="Bring the gradients into the hook's range (targets standardised, the loss in units of order 1), or "
        "register bf16_compress_hook (fp32's range; CUDA and NCCL only) or no hook; on one process, find the "
        "line of the loss that makes it 0 with `fpdoctor trace`.",
    ),
    RuleInfo(
        code="TRN028",
        name="parameters-without-gradient",
        severity=W,
        title="Parameters the optimizer holds, that require gradients, get none: that part never trains",
        what="`fpdoctor watch` and the callbacks read, at an optimizer's steps 1, 12 and 24, which of the parameters "
        "it holds that require gradients have none while others have: the largest module whose parameters had none "
        "at all three is named where the script shows the line that runs it without gradients (a `with "
        "torch.no_grad():` that holds its call, a `.detach()` of its output); an output the loss does not read (a "
        "pooler beside the hidden states) has no such line and no finding.",
        why="A forward run under no_grad, or an output detached before the loss, leaves its module's parameters "
        "without gradients: the optimizer steps the rest, the loss falls through it, nothing is NaN, and the "
        "module stays as it was built.",
        fix="Run that module's forward with gradients (no torch.no_grad() around its call, no .detach() of its "
        "output); if it is frozen on purpose, say so with module.requires_grad_(False).",
    ),
)
