"""Launch plans: the one place that picks a variant of an algorithm and asks it for a Program.

A plan depends on the problem (shapes, dtype, flags), the direction (forward or backward: a variant may have only
one, or refuse a problem in one direction only) and the target (arch and its shared-memory limit); every backend runs
the Program it gets (cuflash.backends.program.run_program). ``explain`` says which variant runs and why the earlier
ones do not.
"""

from __future__ import annotations

from . import catalog
from .program import Problem, Program
from .targets import Target


def variant_for(algorithm: str, problem: Problem, target: Target, direction: str = "forward") -> catalog.Variant:
    """The first variant of ``algorithm`` that serves this problem's ``direction`` on this target."""
    for variant in catalog.variants(algorithm):
        if variant.serves(problem, target, direction):
            return variant
    catalog.check_options(algorithm, problem)  # an option no variant has: named, with the algorithms that have it
    raise ValueError(f"no variant of {algorithm} serves {problem.dtype} on {target.arch}")


def explain(algorithm: str, problem: Problem, target: Target, direction: str = "forward") -> str:
    """Which variant runs ``problem``'s ``direction`` on ``target``, its kernels, and why each variant tried before
    it does not serve (one line each)."""
    lines = []
    for variant in catalog.variants(algorithm):
        refusal = variant.refusal(problem, target, direction)
        if refusal is not None:
            lines.append(f"  not {variant.name}: {refusal}")
            continue
        program = getattr(variant.module, f"{direction}_program")(problem, target)
        kernels = ", ".join(dict.fromkeys(launch.kernel.name_expr for launch in program.launches))
        why = f" ({variant.why})" if variant.why else ""
        return "\n".join([f"{algorithm} {direction} on {target.arch}: {variant.name}{why}: {kernels}", *lines])
    return "\n".join([f"{algorithm} {direction} on {target.arch}: no variant serves it", *lines])


def forward_program(algorithm: str, problem: Problem, target: Target) -> Program:
    return variant_for(algorithm, problem, target, "forward").module.forward_program(problem, target)


def backward_program(algorithm: str, problem: Problem, target: Target) -> Program:
    if problem.num_splits != 1:  # a forward's choice, which a caller's backward drops (the gradients need no split)
        raise ValueError(f"Problem.num_splits is the forward's (split-KV): a backward's is 1, got {problem.num_splits}")
    return variant_for(algorithm, problem, target, "backward").module.backward_program(problem, target)
