"""Launch plans: the one place that picks a variant of an algorithm and asks it for a Program.

A plan depends on the problem (shapes, dtype, flags) and the target (arch and its shared-memory
limit); every backend runs the Program it gets (cuflash.backends.program.run_program).
"""

from __future__ import annotations

from . import catalog
from .program import Problem, Program
from .targets import Target


def variant_for(algorithm: str, problem: Problem, target: Target) -> catalog.Variant:
    """The first variant of ``algorithm`` that serves this problem on this target."""
    for variant in catalog.variants(algorithm):
        if variant.serves(problem, target):
            return variant
    catalog.check_options(algorithm, problem)  # an option no variant has: named, with the algorithms that have it
    raise ValueError(f"no variant of {algorithm} serves {problem.dtype} on {target.arch}")


def forward_program(algorithm: str, problem: Problem, target: Target) -> Program:
    return variant_for(algorithm, problem, target).module.forward_program(problem, target)


def backward_program(algorithm: str, problem: Problem, target: Target) -> Program:
    return variant_for(algorithm, problem, target).module.backward_program(problem, target)
