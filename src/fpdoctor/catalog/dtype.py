"""Dtype (DTY) finding codes."""

from __future__ import annotations

from fpdoctor.catalog import RuleInfo
from fpdoctor.report.model import Severity

# RuleInfo.untried: a cast at the line where an operand or module is made is the user's code to change.
_CAST = (
    "a cast where the operand or module is made, which fpdoctor names and does not make; `fpdoctor.harmonize` is "
    "the cast that can be applied and checked"
)
_MIXED = (
    "a cast of the model, which the audit names and does not make; with inputs, the audit runs the forward and "
    "reports the mismatch it causes"
)
# RuleInfo.untried: an exception in the user's forward is not a change fpdoctor can make.
_RAISED = "the forward raised at the line named: the change is to the user's code, which fpdoctor does not rewrite"

DTY_RULES: tuple[RuleInfo, ...] = (
    RuleInfo(
        code="DTY001",
        name="mixed-dtype-parameters",
        severity=Severity.WARNING,
        untried=_MIXED,
        title="Parameters and buffers of one model have different floating dtypes",
        what="Groups every floating parameter and buffer by dtype and reports the modules in the minority dtype. "
        "Normalisation layers kept in fp32 inside a half-precision model are a deliberate recipe and are not "
        "reported.",
        why="Without autocast, an op that meets fp32 and fp16 operands fails ('mat1 and mat2 must have the same "
        "dtype'); CUDA autocast hides it, CPU and Apple MPS do not.",
        fix="fpdoctor.harmonize(model, device) casts consistently (keeping deliberate fp32 exceptions), or cast the "
        "named module: model.<module>.to(<dtype>).",
    ),
    RuleInfo(
        code="DTY002",
        name="dtype-mismatch",
        severity=Severity.ERROR,
        untried=_CAST,
        title="An op received operands of different dtypes",
        what="Runs the forward under a dispatch mode that knows where every tensor came from (parameter, buffer, "
        "input, or a state tensor an op created) and explains the dtype error at the op that raised it.",
        why="The error message names two dtypes, not which module, operand or line made them differ.",
        fix="Cast the odd operand where it is created (the finding names it), or harmonize the model.",
    ),
    RuleInfo(
        code="DTY003",
        name="device-mismatch",
        severity=Severity.ERROR,
        untried=_CAST,
        title="Parameters, buffers or inputs live on different devices",
        what="Reports modules whose parameters or buffers are on another device than the rest, and explains a "
        "runtime 'Expected all tensors to be on the same device' error with each operand's origin.",
        why="The forward fails at the first op that mixes devices, often far from the module that was not moved.",
        fix="model.to(device) after every module is attached (modules created later are not moved), or move the "
        "named tensor.",
    ),
    RuleInfo(
        code="DTY004",
        name="forward-failed",
        severity=Severity.ERROR,
        untried=_RAISED,
        title="The model's forward raised an error on the example inputs",
        what="audit runs the forward on the example inputs (compare and plan do too, first, for a model whose "
        "parameters mix dtypes); an error that is not a dtype or device mismatch is reported as raised, with the "
        "module and the source line it came from, and a hint where its text names a dtype (an op without a Half "
        "kernel here, a float tensor where indices belong).",
        why="An error is never a clean bill of health: a report that tucked it away would send you looking elsewhere.",
        fix="Fix the error at the line the finding names; check the example inputs' shapes and dtypes against "
        "what the model expects.",
    ),
)
