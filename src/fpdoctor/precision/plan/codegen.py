"""The code a plan hands over: plain torch, to paste into the user's own code.

It puts the model in the candidate's dtype, casts the model's floating inputs to that dtype at
its boundary (so the inputs the user already has, fp32 ones included, are taken), and runs each
kept module in fp32 behind two hooks: floating inputs to fp32 on the way in, outputs back to the
model's dtype on the way out (or left in fp32 where their range needs it). It does what
`apply_plan` does, without depending on fpdoctor.
"""

from __future__ import annotations

from fpdoctor.precision.names import PRECISIONS

_CAST = '''
def cast_floating(value, dtype):
    """value with every floating tensor in it (nested tuples, lists, dicts) cast to dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        cast = value.copy()  # keeps the type (OrderedDict, a model-output class)
        for key, v in value.items():
            cast[key] = cast_floating(v, dtype)
        return cast
    return value
'''

_KEEP = '''
def keep_in_fp32(model, name, module, back_to):
    """module (an fp32 copy of model's `name`) computes in its place in fp32; its outputs go back to
    back_to (None: they stay fp32)."""
    module.float()
    module.register_forward_pre_hook(
        lambda m, args, kwargs: (cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)),
        with_kwargs=True,
    )
    if back_to is not None:
        module.register_forward_hook(lambda m, args, output: cast_floating(output, back_to))
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
'''


def plan_code(candidate: str, keep: list[str], fp32_outputs: list[str]) -> str:
    """Pasteable code applying a keep-in-fp32 plan to `model` (fp16, bf16, fp16-accumulate)."""
    precision = PRECISIONS[candidate]
    dtype = f"torch.{precision.dtype}"
    lines = (["import copy", ""] if keep else []) + ["import torch", ""]
    if precision.accumulate:
        lines += [
            "# cuBLAS: no fp16 reductions in fp16 GEMMs; the modules kept below accumulate in fp32 with any kernel",
            "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False",
        ]
    lines += _CAST.splitlines() + (["", "", *_KEEP.splitlines()[1:]] if keep else []) + ["", ""]
    if keep:  # copies made before the cast, as the plan checked them: fp32 weights of their own, so that a
        # weight tied to a module left in the dtype (an embedding's, under the output layer) stays with it
        names = ", ".join(repr(n) for n in keep)
        lines += [f"fp32_modules = {{name: copy.deepcopy(model.get_submodule(name)) for name in ({names},)}}"]
    lines += [
        f"model.to({dtype})",
        f"# the model takes the inputs you have: floating ones are cast to {dtype} on the way in",
        "model.register_forward_pre_hook(",
        f"    lambda m, args, kwargs: (cast_floating(args, {dtype}), cast_floating(kwargs, {dtype})), with_kwargs=True",
        ")",
    ]
    for name in keep:
        if name in fp32_outputs:
            lines.append(
                f"keep_in_fp32(model, {name!r}, fp32_modules[{name!r}], back_to=None)  # its outputs stay fp32"
            )
        else:
            lines.append(f"keep_in_fp32(model, {name!r}, fp32_modules[{name!r}], back_to={dtype})")
    return "\n".join(lines) + "\n"


def fp8_code(candidate: str, keep: list[str]) -> str:
    names = "{" + ", ".join(repr(n) for n in keep) + "}" if keep else "set()"  # `{}` is an empty dict
    return (
        f"# {candidate} ran in fpdoctor's own fp8 Linear layers; keep these modules in high\n"
        f"# precision in your fp8 recipe, e.g. torchao's module_filter_fn:\nKEEP_HIGH_PRECISION = {names}\n"
        "def module_filter_fn(module, fqn):  # called with each Linear's own name: a kept container keeps its Linears\n"
        "    return not any(fqn == k or fqn.startswith(k + '.') for k in KEEP_HIGH_PRECISION)\n"
    )
