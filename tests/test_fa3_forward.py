"""The warp-specialized Hopper forward (cuda_src/kernels/fa3_forward.cu, cuflash/kernels/families/fa3.py) on the
simulator targeting sm_90, and compiled by NVRTC for sm_90a.

* Against the float64 reference with FlashAttention's rule (test_fa2._check_forward): float16 and bfloat16, head
  dims 64, 128, 192 and 256, causal and not, seqlen pairs with ragged Q and K/V blocks (1/1, 77/200, 128/128,
  300/129: rows without a key under causal, a K/V block of one key), MHA, GQA and MQA in rotation.
* Sliding windows (both sides of the band skipped: exact traffic; rows and whole Q blocks without a key), softcap
  and ALiBi (the hooked instances), head dims 129..256, through cuflash.attention; the plain instance traps when
  launched with softcap; every instance these added in race mode and under AddressSanitizer.
* Race mode clean on one case per tile (mbarrier and named-barrier edges, wgmma in flight, async-proxy reads
  of the producer's stores), and the result bitwise equal whatever moment each wgmma lands (normal mode's landing
  seeds); global traffic byte for byte against the FA2 forward's formula for the same tiles.
* Compiled for sm_90a: HGMMA of the planned shapes (S: 64 x block_n SS, P V: 64 x d RS with V transposed),
  setmaxnreg on both roles within the block's registers at launch, no spills, no wgmma serialized by ptxas, the step's
  two commit groups and two waits.
* Every tile under AddressSanitizer (one case each); no shared-memory bank conflicts (profile mode).
* Head dims between the compiled ones (zero-filled columns, element-wise tails), exact traffic.
* Which problems the kernel serves (fa3.supports).
* The producer's copies: TMA wherever the host could make the tensor maps (every call above says which path it
  took), the load path otherwise (head dims not a multiple of 8, a base not 16-byte aligned: same results and
  traffic); planted bugs: a wrong expect_tx byte count deadlocks naming the barrier, a consumer that does not wait
  on its full barrier races the TMA write (race mode). The profile counts the TMA loads' shared writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import numpy as np
import pytest

import cuflash
from cuflash import _tolerance as tol
from cuflash import sim
from cuflash.backends.program import run_program
from cuflash.backends.simulator import SimulatorBackend
from cuflash.kernels import nvrtc, report
from cuflash._paths import CUDA_SRC
from cuflash.kernels.families import fa3
from cuflash.kernels.program import KernelInstance, Problem
from cuflash.kernels.targets import target
from cuflash.mask import Mask
from cuflash.testing import rows_without_key
from test_fa2 import _check_forward, _inputs, _launch_traffic, _problem

SM90 = target("sm_90")
SEQLENS = ((1, 1), (77, 200), (128, 128), (300, 129), (70, 700))  # the last: 6 K/V blocks, 3 rounds of the ring
HEADS = ((2, 2), (4, 2), (3, 1))  # MHA, GQA, MQA (nheads, nheads_k)


class _CopyPathSpy(SimulatorBackend):
    """The simulator backend, noting each launch's AttentionParams.tma_loads (1: the producer copies with TMA)."""

    def __init__(self):
        super().__init__()
        self.tma_loads = []

    def launch(self, plan, params, buffers):
        self.tma_loads.append(int(params["tma_loads"]))
        super().launch(plan, params, buffers)


def _run(q, k, v, causal, tma=True, kernel=None):
    """fa3's forward on the simulator; tma: whether the call must run on the TMA path (else on the load path);
    kernel: another build of the kernel (a planted bug) in place of the program's."""
    backend = _CopyPathSpy()
    problem = _problem(q, k, causal)
    out = backend.empty(q.shape, q.dtype)
    lse = backend.empty((problem.batch, problem.nheads, problem.seqlen_q), np.float32)
    program = fa3.forward_program(problem, SM90)
    if kernel is not None:
        program = dataclasses.replace(program, launches=tuple(
            dataclasses.replace(plan, kernel=KernelInstance(kernel, plan.kernel.name_expr))
            for plan in program.launches))
    with sim.targeting("sm_90"), sim.record() as records:
        run_program(backend, program, problem, 1.0 / math.sqrt(problem.headdim),
                    {"q": q, "k": k, "v": v, "out": out, "lse": lse})
    assert [r.kernel.split("<")[0] for r in records.launches] == ["cuflash::fa3_forward_kernel"]
    assert backend.tma_loads == [int(tma)]
    return out, lse, records


def _cases():
    """Every head dim, causal or not, every seqlen pair (d192 and d256, the largest tiles: every other one), the
    dtype alternating case by case and the heads in rotation."""
    cases = []
    for d in fa3.HEAD_DIMS:
        n = d // 64
        for causal in (False, True):
            for i, (seqlen_q, seqlen_k) in enumerate(SEQLENS):
                if d > 128 and (i + causal) % 2:
                    continue
                dtype = fa3.DTYPES[n % 2]
                n += 1
                nheads, nheads_k = HEADS[(i + causal) % len(HEADS)]
                shape = (1 if i % 2 else 2, seqlen_q, seqlen_k, nheads, nheads_k, d)
                cases.append(pytest.param(shape, dtype, causal,
                                          id=f"d{d}-{dtype}-{'causal' if causal else 'full'}-{seqlen_q}x{seqlen_k}"
                                             f"-h{nheads}k{nheads_k}"))
    return cases


@pytest.mark.parametrize("shape, dtype, causal", _cases())
def test_forward_matches_reference(shape, dtype, causal):
    q, k, v, _ = _inputs(shape, dtype, seed=31)
    out, lse, _ = _run(q, k, v, causal)
    _check_forward(q, k, v, out, lse, causal, None)


# Head dims between the compiled ones run on the next (64 or 128), the columns past them zero-filled: by the tensor
# map (40, 104: TMA's out-of-bounds fill), or on the load path where TMA cannot address the rows (a head dim not a
# multiple of 8: rows of 200 or 254 bytes, not whole 16 bytes): a chunk the head dim cuts (100, 127: element loads
# and stores), a single column.
@pytest.mark.parametrize("head_dim, dtype, causal, seqlens", [(40, "float16", True, (77, 200)),
                                                              (104, "bfloat16", False, (300, 129)),
                                                              (100, "bfloat16", False, (300, 129)),
                                                              (127, "bfloat16", True, (70, 700)),
                                                              (1, "float16", False, (128, 128))])
def test_head_dims_between_compiled_ones(head_dim, dtype, causal, seqlens):
    q, k, v, _ = _inputs((1, *seqlens, 4, 2, head_dim), dtype, seed=33)
    out, lse, records = _run(q, k, v, causal, tma=head_dim % 8 == 0)
    _check_forward(q, k, v, out, lse, causal, None)
    assert _launch_traffic(records) == [tuple(fa3.forward_traffic(_problem(q, k, causal), SM90))]


@pytest.mark.parametrize("head_dim, dtype, causal", [(64, "float16", True), (128, "bfloat16", True),
                                                     (128, "float16", False)])
def test_race_free_reproducible_and_on_formula(head_dim, dtype, causal):
    """Every instance's tile (d128 non-causal is FA3's 128 x 176): ragged Q and K/V blocks with GQA, two or three K/V
    blocks through the 2-stage ring (a stage refilled), both consumers, rows without a key where causal."""
    q, k, v, _ = _inputs((1, 200, 300, 4, 2, head_dim), dtype, seed=32)
    with sim.checking("race"):
        out, lse, records = _run(q, k, v, causal)
    _check_forward(q, k, v, out, lse, causal, None)
    problem = _problem(q, k, causal)
    assert _launch_traffic(records) == [tuple(fa3.forward_traffic(problem, SM90))]
    for seed in (1, 2):
        with sim.copy_landing(seed):
            again, again_lse, _ = _run(q, k, v, causal)
        assert np.array_equal(out.view(np.uint16), again.view(np.uint16))
        assert np.array_equal(lse.view(np.uint32), again_lse.view(np.uint32))


def _every_tile_under_asan():
    results = []
    for head_dim, causal in ((64, True), (128, True), (128, False)):
        q, k, v, _ = _inputs((1, 200, 300, 4, 2, head_dim), "bfloat16", seed=34)
        results.append((q, k, v, causal, *_run(q, k, v, causal)[:2]))
    return results


def test_every_tile_clean_under_asan():
    """Shared memory is allocated with exactly the planned bytes: a tile, descriptor or mbarrier past the layout, or
    a global access past a ragged block, is reported."""
    for q, k, v, causal, out, lse in sim.run_in_asan_subprocess(_every_tile_under_asan, timeout=600):
        _check_forward(q, k, v, out, lse, causal, None)


def test_no_bank_conflicts():
    """The producer's TMA loads (one per 64-column panel: a 128-byte swizzled line a wavefront) or, on the load path,
    its 16-byte stores (8 lanes a line), the epilogue's 4-byte pairs (8 rows, each at its own chunk position) and
    16-byte reads, and the consumers' wgmma operand reads (Q and K of S = Q K^T, V of P V: a core matrix a
    wavefront), at their ideal wavefront counts on both head dims' tiles; every wgmma read counted."""
    for head_dim, causal in ((64, True), (128, False), (60, True)):
        tma = head_dim % 8 == 0
        q, k, v, _ = _inputs((1, 200, 300, 2, 2, head_dim), "float16", seed=23)
        with sim.checking("profile"):
            _, _, records = _run(q, k, v, causal, tma=tma)
        (launch,) = records.launches
        assert {site.kind for site in launch.shared_access_sites} == ({"store", "load", "tma.load", "wgmma.read"}
                                                                      if tma else {"store", "load", "wgmma.read"})
        for site in launch.shared_access_sites:
            assert site.excess == 0, (launch.kernel, site)
        traits = fa3.forward_traits(_problem(q, k, causal), SM90)
        policy = _problem(q, k, causal).mask_policy
        blocks = [policy.kv_blocks(traits.block_n, row0, min(row0 + traits.block_m, 200))
                  for row0 in range(0, 200, traits.block_m)]
        # Per consumer and visited K/V block: S's d / 16 wgmma read Q (64 x 16: 16 wavefronts) and K (n x 16: n / 4),
        # P V's n / 16 read V (d x 16: d / 4); two heads.
        d, n = traits.head_dim, traits.block_n
        per_block = d // 16 * (16 + n // 4) + n // 16 * (d // 4)
        visits = sum(max(b.end - b.begin, 0) for b in blocks) * traits.consumers * 2
        assert sum(s.ideal for s in launch.shared_access_sites if s.kind == "wgmma.read") == visits * per_block
        if tma:  # every copy counted: Q once and K and V per visible K/V block, per (head, Q block)
            tiles = sum(1 + 2 * (b.end - b.begin) for b in blocks if b.end > b.begin)  # per head
            (tma_site,) = [site for site in launch.shared_access_sites if site.kind == "tma.load"]
            assert tma_site.instructions == 2 * tiles * (traits.head_dim // 64), tma_site


# Windows (block skipping on both sides of the band: the traffic formula visits only the band's K/V blocks), softcap
# and ALiBi (the hooked instances), head dims 129..256 (the d192 and d256 tiles), through cuflash.attention on the
# simulator targeting sm_90: ragged blocks, seqlen_q != seqlen_k both ways, MHA/GQA/MQA, rows (and whole Q blocks)
# that see no key, both slope layouts, both dtypes in rotation.
OPTION_CASES = {
    "window-rows-without-key": ((2, 300, 129, 4, 2, 64), "float16", dict(window_size=(3, 2))),
    "window-causal": ((1, 77, 200, 3, 1, 128), "bfloat16", dict(window_size=(21, -1), causal=True)),
    "window-left-only": ((1, 70, 700, 2, 2, 100), "float16", dict(window_size=(0, -1))),
    "window-right-only": ((2, 200, 300, 4, 2, 128), "bfloat16", dict(window_size=(-1, 9))),
    "softcap": ((1, 77, 200, 4, 2, 128), "float16", dict(softcap=2.5)),
    "alibi-per-batch": ((2, 128, 300, 3, 1, 64), "bfloat16", dict(alibi=(2, 3))),
    "window-softcap-alibi-causal": ((1, 300, 129, 4, 2, 120), "bfloat16",
                                    dict(window_size=(30, 5), causal=True, softcap=4.0, alibi=(4,))),
    "d256-window": ((1, 200, 300, 2, 1, 256), "float16", dict(window_size=(40, 24))),
    "d192-softcap-alibi": ((1, 130, 77, 2, 2, 192), "bfloat16", dict(softcap=6.0, alibi=(2,))),
    "d160-causal": ((2, 77, 200, 4, 2, 160), "bfloat16", dict(causal=True)),
    "d200-alibi-window": ((1, 200, 130, 3, 1, 200), "float16", dict(alibi=(1, 3), window_size=(50, 10))),
    # Rows of 340 bytes: the load path, whose K/V tile (112 x 192: 2688 chunks) ends in half a round of
    # fa3::kLoadsInFlight chunks per thread.
    "d170-causal-load-path": ((1, 77, 250, 2, 1, 170), "float16", dict(causal=True)),
}


def _options(options, seed):
    options = dict(options)
    slopes_shape = options.pop("alibi", None)
    if slopes_shape is not None:
        options["alibi_slopes"] = np.random.default_rng(seed).uniform(0.02, 0.6, slopes_shape).astype(np.float32)
    return options


def _attention(q, k, v, options):
    """cuflash.attention's forward on the simulator targeting sm_90: one launch, the Hopper kernel's."""
    with sim.targeting("sm_90"), sim.record() as records:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    (launch,) = records.launches
    assert launch.kernel.startswith("cuflash::fa3_forward_kernel<"), launch.kernel
    hooked = "softcap" in options or "alibi_slopes" in options
    assert launch.kernel.endswith(", true>") == hooked, launch.kernel
    return out, lse, records


def _check_options(q, k, v, out, lse, options):
    ref = tol.forward_references(q, k, v, **options)
    tol.check_close("out", out, ref.out, ref.out_lowp, tol.FORWARD_FACTOR)
    tol.check_close("lse", lse, ref.lse, ref.lse_lowp, tol.FORWARD_FACTOR)
    empty = rows_without_key(q.shape[1], k.shape[1], options.get("causal", False), options.get("window_size", (-1, -1)))
    assert np.all(out[:, empty].astype(np.float32) == 0) and np.all(lse[:, :, empty] == -np.inf)
    return empty


def _options_problem(q, k, options):
    window = options.get("window_size", (-1, -1))
    return Problem(dtype=np.dtype(q.dtype).name, batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1],
                   nheads=q.shape[2], nheads_k=k.shape[2], headdim=q.shape[3],
                   mask=Mask.of(options.get("causal", False), window))


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_windows_softcap_alibi_and_large_head_dims_match_reference(case):
    shape, dtype, options = OPTION_CASES[case]
    q, k, v, _ = _inputs(shape, dtype, seed=len(case))
    options = _options(options, seed=len(case))
    out, lse, records = _attention(q, k, v, options)
    empty = _check_options(q, k, v, out, lse, options)
    if case == "window-rows-without-key":
        assert empty.sum() > 128  # a whole Q block (64 rows a consumer) sees no key, and rows of a mixed one
    if "softcap" not in options and "alibi_slopes" not in options:
        assert _launch_traffic(records) == [tuple(fa3.forward_traffic(_options_problem(q, k, options), SM90))]


def test_plain_instance_traps_on_softcap():
    """An instance without the hook would drop softcap (or ALiBi) silently: launched with one it traps."""
    q, k, v, _ = _inputs((1, 70, 90, 2, 2, 64), "float16", seed=37)
    plain = _problem(q, k, False)
    capped = dataclasses.replace(plain, softcap=3.0)
    backend = SimulatorBackend()
    arrays = {"q": q, "k": k, "v": v, "out": backend.empty(q.shape, q.dtype),
              "lse": backend.empty((1, 2, 70), np.float32)}
    with sim.targeting("sm_90"), pytest.raises(sim.KernelError, match="fa3_forward_kernel"):
        run_program(backend, fa3.forward_program(plain, SM90), capped, 0.125, arrays)
    with sim.targeting("sm_90"):
        run_program(backend, fa3.forward_program(capped, SM90), capped, 0.125, arrays)


# One case per instance these options added: d192 and d256 plain, the hooked d64 (128 x 128), d128, d192 and d256.
NEW_INSTANCE_CASES = ("d160-causal", "d256-window", "alibi-per-batch", "window-softcap-alibi-causal",
                      "d192-softcap-alibi", "d200-alibi-window")


def _new_instance_runs(mode=None):
    """Each NEW_INSTANCE_CASES case at 100 x 170 (two or three K/V blocks through the ring, ragged ones)."""
    results = []
    for case in NEW_INSTANCE_CASES:
        shape, dtype, options = OPTION_CASES[case]
        q, k, v, _ = _inputs((shape[0], 100, 170, *shape[3:]), dtype, seed=36)
        options = _options(options, seed=36)
        with sim.checking(mode) if mode else contextlib.nullcontext():
            out, lse, records = _attention(q, k, v, options)
        results.append((q, k, v, options, out, lse, records.launches[0].kernel))
    return results


def test_new_instances_race_free_and_clean_under_asan():
    """The instances the options added in race mode (mbarrier and named-barrier edges, wgmma in flight, async-proxy
    reads), then under AddressSanitizer (shared memory allocated with exactly the planned bytes)."""
    added = (fa3.FORWARD_CHOICES[192][0], fa3.FORWARD_CHOICES[256][0],
             *(fa3.HOOKED_CHOICES[d] for d in (64, 128, 192, 256)))
    for runs in (_new_instance_runs("race"), sim.run_in_asan_subprocess(_new_instance_runs, timeout=600)):
        launched = set()
        for q, k, v, options, out, lse, kernel in runs:
            _check_options(q, k, v, out, lse, options)
            launched.add(kernel.split(",", 1)[1])  # the tile, whatever the dtype
        assert launched == {t.instance("float16").name_expr.split(",", 1)[1] for t in added}


def test_serves_only_its_problems():
    def problem(**kw):
        fields = dict(dtype="float16", batch=1, seqlen_q=100, seqlen_k=100, nheads=4, nheads_k=2, headdim=128)
        return Problem(**{**fields, **kw})

    assert fa3.supports(problem(), SM90) and fa3.supports(problem(mask=Mask.causal(), dtype="bfloat16"), SM90)
    assert fa3.supports(problem(headdim=64), target("sm_90a")) and fa3.supports(problem(headdim=96), SM90)
    for served in (problem(headdim=160), problem(headdim=256, mask=Mask(window_left=8, window_right=0)),
                   problem(softcap=5.0), problem(alibi="heads", mask=Mask.causal()), problem(headdim_v=64),
                   problem(headdim=64, headdim_v=256), problem(sinks=True)):
        assert fa3.supports(served, SM90), served
    for other in (problem(headdim=257), problem(dtype="float32"), problem(dropout_p=0.1),
                  problem(headdim=64, headdim_v=257), problem(softcap=5.0, dropout_p=0.1)):
        assert not fa3.supports(other, SM90)
    assert not fa3.supports(problem(), target("sm_80"))
    with pytest.raises(ValueError):
        fa3.forward_program(problem(headdim=257), SM90)
    # The tiles: windows take the masked one, softcap and ALiBi its hooked instance, head dims 129..192 the d192
    # one, 193..256 the d256 one.
    assert fa3.forward_traits(problem(mask=Mask(8, 3)), SM90) == fa3.FORWARD_CHOICES[128][0]
    assert fa3.forward_traits(problem(softcap=5.0), SM90) == fa3.HOOKED_CHOICES[128]
    assert fa3.forward_traits(problem(headdim=129), SM90).head_dim == 192
    assert fa3.forward_traits(problem(headdim=193), SM90).head_dim == 256
    assert fa3.forward_traits(problem(headdim=64, headdim_v=193), SM90).head_dim == 256  # v's, the larger


# What ptxas gives every instance (NVRTC 13.5, sm_90a): at most the launch count of __launch_bounds__(threads, 1), no
# spills.
def _launch_registers(threads):
    return 65536 // threads // 8 * 8


def test_compiles_for_sm90a_with_hgmma_and_no_spills():
    compiled = nvrtc.compile_many(fa3.instances(), ["sm_90a"], jobs=1, return_errors=True)
    for result in compiled:
        assert not isinstance(result, nvrtc.CompileError), str(result)
        name = result.instance.name_expr
        traits = fa3.traits_of(result.instance)
        res = result.resources
        assert res.registers <= _launch_registers(traits.threads), (name, res)
        assert res.spill_store_bytes == res.spill_load_bytes == 0, (name, res)
        assert traits.smem_bytes <= SM90.smem_per_block_bytes
        sass = nvrtc.dump_sass(result)
        assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra"
        bf16 = r"\.BF16" if "bfloat16" in name else ""
        # S = Q K^T: both operands from descriptors; O += P V: P from registers, V N-major (.tnspB).
        assert re.search(rf"\bHGMMA\.64x{traits.block_n}x16\.F32{bf16} R\d+, gdesc\[UR\d+\]", sass), name
        assert re.search(rf"\bHGMMA\.64x{traits.v_head_dim}x16\.F32{bf16} R\d+, R\d+, gdesc\[UR\d+\]\.tnspB", sass), name
        # setmaxnreg: the producer gives registers back, the consumers take them, within the block's launch
        # allocation (ptxas's count x threads: setmaxnreg.inc draws on nothing else).
        (consumer,) = {int(n, 16) for n in re.findall(r"\bUSETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d+, (0x[0-9a-f]+)\b", sass)}
        (producer,) = {int(n, 16) for n in re.findall(r"\bUSETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)\b", sass)}
        assert producer <= 40 and consumer > res.registers, name
        roles = {"producer": {"warpgroups": 1, "registers": producer},
                 "consumer": {"warpgroups": traits.consumers, "registers": consumer}}
        assert not report.roles_exceed_launch_allocation(roles, res.registers, traits.threads), (name, roles, res)
        # ptxas neither serialized the wgmma (C7519) nor inserted waits of its own (C7517).
        assert "C7519" not in result.log and "C7517" not in result.log, result.log
        # Intra-warpgroup overlap, as issued: each step (the steady loop's and the masked loop's) issues the next S
        # (SS) and this P V (RS, V transposed) back to back, then waits leaving one group (P V) in flight, then waits
        # for it. (What ptxas schedules between the two waits: test_loop_census's overlap test.)
        steps = re.findall(r"HGMMA\.64x\d+x16[^;]*gdesc\[UR\d+\], R\d+, gsb0 ;.*?"
                           r"HGMMA\.64x\d+x16[^;]*\.tnspB, R\d+, gsb0 ;.*?"
                           r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1 ;.*?WARPGROUP\.DEPBAR\.LE gsb0, 0x0 ;", sass, re.S)
        assert len(steps) == 2, name


# ---- the producer's TMA copies ---------------------------------------------------------------------------------


def _planted(tmp_path, old, new):
    """fa3_forward.cu with `old` replaced by `new` (a planted bug), as a kernel source of its own."""
    text = (CUDA_SRC / fa3.SOURCE).read_text()
    assert text.count(old) == 1, old
    path = tmp_path / "fa3_forward_planted.cu"
    path.write_text(text.replace(old, new))
    return str(path)


# d64's tile (192 x 128, 2 stages): Q's 24 KB, then K's and V's 2 x 16 KB, then the mbarriers: q_full, full_k[2] ...
_D64_FULL_K = 192 * 64 * 2 + 4 * 128 * 64 * 2 + 8


def test_planted_wrong_expect_tx_deadlocks_naming_the_barrier(tmp_path):
    """The producer expects 16 bytes more for K than its copies bring: full_k's phase never completes, and the
    consumers' wait on it is reported as a deadlock naming the barrier, its phase and the missing bytes."""
    kernel = _planted(tmp_path, "        if (leader)\n          fa3::produce_tile_tma<KVTile>(k_tile(stage)",
                      "        if (leader) arch::mbarrier_expect_tx(full_k + stage, 16);  // planted\n"
                      "        if (leader)\n          fa3::produce_tile_tma<KVTile>(k_tile(stage)")
    q, k, v, _ = _inputs((1, 70, 200, 2, 2, 64), "float16", seed=35)
    with pytest.raises(sim.KernelError, match=rf"(?s)deadlock: .*fa3_forward_planted\.cu:\d+.* for parity 0 of the "
                                              rf"mbarrier at shared byte offset {_D64_FULL_K} .*tx-count of 16 bytes"):
        _run(q, k, v, False, kernel=kernel)


def test_planted_read_before_the_wait_is_a_race(tmp_path):
    """The consumers issue S = Q K^T on the first K/V block without waiting on its full barrier: their wgmma reads
    the K tile (shared byte 24576 on) that the producer's TMA load writes, unordered with it (no wait observed the
    phase that load completes): a race-mode error."""
    kernel = _planted(tmp_path, "    arch::mbarrier_wait(full_k, 0);\n    arch::wgmma_fence();\n    issue_s(0);",
                      "    arch::wgmma_fence();  // planted: no wait on full_k\n    issue_s(0);")
    q, k, v, _ = _inputs((1, 70, 200, 2, 2, 64), "float16", seed=35)
    with sim.checking("race"), pytest.raises(sim.KernelError, match=r"data race on shared memory byte offset 24576: "
                                                                    r".*thread \(0,0,0\) wrote it with no "
                                                                    r"__syncthreads\(\) in between, nor an mbarrier"):
        _run(q, k, v, False, kernel=kernel)


def test_an_address_tma_cannot_take_runs_on_the_load_path():
    """A tensor map needs a 16-byte aligned base: q 8 bytes past one runs that call on the load path (the maps are
    made per call), with the same results and traffic as an aligned call on the TMA path."""
    q, k, v, _ = _inputs((1, 77, 200, 4, 2, 64), "bfloat16", seed=36)
    raw = np.empty(q.size + 8, q.dtype)
    skew = (-raw.ctypes.data // 2 + 4) % 8  # q's base 8 bytes past a 16-byte boundary
    shifted = raw[skew: skew + q.size].reshape(q.shape)
    shifted[...] = q
    assert shifted.ctypes.data % 16 == 8
    out, lse, records = _run(shifted, k, v, True, tma=False)
    _check_forward(q, k, v, out, lse, True, None)
    aligned_out, aligned_lse, aligned_records = _run(q, k, v, True)
    assert np.array_equal(out.view(np.uint16), aligned_out.view(np.uint16))
    assert _launch_traffic(records) == _launch_traffic(aligned_records)


def test_tensor_maps_made_per_call_from_the_signature():
    """PreparedProgram's TmaMaps: everything but the addresses checked and encoded once per signature; a call lays
    the TMA block (tma_loads, then q's, k's and v's maps) over the params with each twin's address patched in; the
    same addresses again give the same block without re-encoding; arrays TMA cannot take give none."""
    from cuflash.backends.program import TmaMaps, element_strides, row_extents
    from cuflash.kernels import params, tensor_map

    q, k, v, _ = _inputs((2, 77, 200, 4, 2, 64), "float16", seed=37)
    problem = _problem(q, k, False)
    boxes = fa3.forward_program(problem, SM90).tma_boxes
    strides = {name: element_strides(x) for name, x in (("q", q), ("k", k), ("v", v))}
    extents = {name: row_extents(x) for name, x in (("q", q), ("k", k), ("v", v))}
    maps = TmaMaps(boxes, problem, strides, extents)
    assert maps.usable and maps.tensors == ("q", "k", "v")
    addresses = (0x10000, 0x20010, 0x30020)
    offset, block = maps.block(addresses, by_driver=False)
    assert offset == params.PARAMS_DTYPE.fields["tma_loads"][1]
    packed = np.frombuffer(bytes(offset) + block, params.PARAMS_DTYPE)[0]
    assert packed["tma_loads"] == 1
    for (name, array), address, rows in zip((("q", q), ("k", k), ("v", v)), addresses, (192, 128, 128)):
        batch_stride, row_stride, head_stride = strides[name]
        # (head dim, rows, heads, batch), innermost first; byte strides of rows, heads, batches; box 64 x rows.
        want = tensor_map.encode_tiled(tensor_map.FLOAT16, 4, address, [64, array.shape[1], array.shape[2], 2],
                                       [2 * row_stride, 2 * head_stride, 2 * batch_stride], [64, rows, 1, 1],
                                       swizzle=tensor_map.SWIZZLE_128B)
        assert packed["tma"][name].tobytes() == want, name
    assert maps.block(addresses, by_driver=False)[1] is block  # the same arrays: the block made last time
    assert maps.block((0x10008, *addresses[1:]), by_driver=False) is None  # a base TMA cannot take
    odd = dict(strides, k=(strides["k"][0], strides["k"][1] + 4, strides["k"][2]))  # k's rows 8 bytes off 16
    assert not TmaMaps(boxes, problem, odd, extents).usable
