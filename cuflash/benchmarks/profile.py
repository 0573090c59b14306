"""``profile --out DIR``: where each kernel spends shared-memory wavefronts, and what it costs statically.

Two kinds of counts, never times:

* the simulator's profile mode (cuda_src/arch/sim/sim_profile.cpp) over one
  forward and one backward per algorithm and head dim: per shared-memory access
  site, the warp instructions, the wavefronts they took (Nsight Compute's unit)
  and the wavefronts they would take without bank conflicts;
* the compile report (NVRTC, per arch) of exactly the kernels those calls launched:
  registers, spills, shared memory, resident blocks per SM, HMMA.

Writes profile.json (one record per (algorithm, shape, direction, kernel) with its
sites, and the report rows) and profile.png (wavefronts per kernel, ideal beside
actual).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def simulator_profile(algorithms, *, seqlen: int, headdims, dtype: str = "float16", causal: bool = False):
    """Profile-mode records per launch, and the KernelInstances the calls launched."""
    import cuflash
    from cuflash import sim
    from cuflash.kernels import plans
    from cuflash.kernels.program import Problem
    from cuflash.mask import Mask
    from cuflash.testing import numpy_dtype

    target = sim.current_target()
    records, instances = [], {}
    for algorithm in algorithms:
        for headdim in headdims:
            rng = np.random.default_rng(0)
            q, k, v, dout = (rng.standard_normal((1, seqlen, 2, headdim)).astype(numpy_dtype(dtype)) for _ in range(4))
            problem = Problem(dtype, 1, seqlen, seqlen, 2, 2, headdim, mask=Mask.causal(causal))
            for program in (plans.forward_program(algorithm, problem, target),
                            plans.backward_program(algorithm, problem, target)):
                for plan in program.launches:
                    instances[plan.kernel.name_expr] = plan.kernel
            with sim.checking("profile"):
                with sim.record() as fwd:
                    out, lse = cuflash.attention(q, k, v, causal=causal, algorithm=algorithm, return_lse=True)
                with sim.record() as bwd:
                    cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, algorithm=algorithm)
            for direction, rec in (("forward", fwd), ("backward", bwd)):
                for launch in rec.launches:
                    sites = [{"site": s.site, "kind": s.kind, "bytes": s.bytes, "instructions": s.instructions,
                              "wavefronts": s.wavefronts, "ideal": s.ideal, "excess": s.excess}
                             for s in launch.shared_access_sites]
                    records.append({
                        "algorithm": algorithm, "direction": direction, "kernel": launch.kernel, "batch": 1,
                        "nheads": 2, "seqlen": seqlen, "headdim": headdim, "causal": causal, "dtype": dtype,
                        "grid": list(launch.grid), "block": list(launch.block),
                        "shared_wavefronts": sum(s["wavefronts"] for s in sites),
                        "shared_ideal_wavefronts": sum(s["ideal"] for s in sites),
                        "sites": sites,
                    })
    return records, list(instances.values())


def compile_report(instances, arches) -> list[dict]:
    from cuflash.kernels.report import build_report

    rows, errors = build_report(arches, instances=instances)
    if errors:
        raise RuntimeError("compile report failed: " + "; ".join(str(e) for e in errors))
    return [row.as_json() for row in rows]


def plot_profile(records, path: Path, title: str) -> Path:
    from .plots import _pyplot, save

    plt = _pyplot()
    labels = [f"{r['algorithm']} d{r['headdim']} {'fwd' if r['direction'] == 'forward' else 'bwd'} "
              f"{r['kernel'].split('<')[0].split('::')[-1]}" for r in records]
    actual = [r["shared_wavefronts"] for r in records]
    ideal = [r["shared_ideal_wavefronts"] for r in records]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(records) + 1.5))
    ys = np.arange(len(records))
    ax.barh(ys + 0.2, actual, height=0.4, label="wavefronts (simulator count)")
    ax.barh(ys - 0.2, ideal, height=0.4, label="without bank conflicts")
    ax.set_yticks(ys, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("shared-memory wavefronts")
    ax.set_title(title)
    ax.legend(fontsize=7)
    save(plt, fig, path)
    return Path(path)


def write_outputs(out_dir, *, arches, seqlen: int, headdims, algorithms=None, dtype: str = "float16") -> list[Path]:
    from cuflash.kernels.catalog import algorithms as all_algorithms

    algorithms = algorithms or all_algorithms()
    records, instances = simulator_profile(algorithms, seqlen=seqlen, headdims=headdims, dtype=dtype)
    report = compile_report(instances, arches)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "profile.json", out_dir / "profile.png"
    json_path.write_text(json.dumps({"what": "simulator counts and compile-report figures, not times",
                                     "launches": records, "compile_report": report}, indent=1))
    plot_profile(records, png_path, f"Shared-memory wavefronts per kernel, {dtype}, seqlen {seqlen} "
                                    "(simulator profile mode, counts)")
    return [json_path, png_path]
