"""The mask policy: one rule, one C++ home (cuda_src/common/mask.cuh), one NumPy twin (cuflash/mask.py).

* The twin's every answer equals a brute-force reading of the rule, for causal, full and windowed masks,
  seqlen_q above, below and equal to seqlen_k, and rows that see no key; with chunks (chunked attention) its row-level
  answers do, and its chunk segments, each run as a sequence of its own with the window alone, rebuild the mask.
* The C++ policy equals the twin on every method, launched on the simulator (tests/kernels/mask_probe.cu).
* No other file decides visibility: the arithmetic of the rule appears only in those two files.
* The softcap's tanh (mask.cuh's tanh_by_exp2): within a few float32 ulps of 1 of tanh and exactly +-1 where tanh
  rounds to it, infinities included (simulator); compiled, one ex2 and one approximate reciprocal, no IEEE division
  range check or slow-path call (SASS, sm_80 and sm_90).
"""

from __future__ import annotations

import io
import itertools
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest

from cuflash import sim
from cuflash.kernels import nvrtc
from cuflash.kernels.params import pack_params
from cuflash.kernels.program import KernelInstance, Problem
from cuflash.mask import IndexRange, Mask, MaskPolicy

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "kernels" / "mask_probe.cu"
BLOCK_M, BLOCK_N = 4, 3

WINDOWS = [(-1, -1), (-1, 0), (2, 1), (0, 0), (3, -1), (0, 5), (-1, 2)]
SEQLENS = [(1, 1), (7, 7), (5, 11), (11, 5), (9, 1), (1, 9), (0, 4), (4, 0)]
# Every window meets every seqlen pair: 56 cases for the twin; the C++ comparison takes them in rotation.
CASES = list(itertools.product(SEQLENS, WINDOWS))


def brute(sq, sk, left, right, chunk=0):
    """The rule of mask.cuh's opening comment (and of cuflash/mask.py's chunks), element by element."""
    off = sk - sq
    return np.array([[(left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
                      and (chunk == 0 or (i + off) // chunk == j // chunk) for j in range(sk)]
                     for i in range(sq)], dtype=bool).reshape(sq, sk)


# Chunks: narrower than a block of either side (BLOCK_M 4, BLOCK_N 3), between, and wider than every sequence.
CHUNKS = [1, 2, 5, 16]


@pytest.mark.parametrize("seqlens, window, chunk", list(itertools.product(SEQLENS, WINDOWS, CHUNKS)))
def test_chunked_policy_and_its_segments_match_the_rule(seqlens, window, chunk):
    """Row-level answers under chunks, and the chunk segments (chunked attention as virtual batches): the rows and
    the keys tiled in order, and each segment, run as a sequence of its own with the window alone (aligned to its
    own lengths), seeing exactly what its rows see under the chunked mask."""
    (sq, sk), (left, right) = seqlens, window
    policy = Mask(left, right, chunk).policy(sq, sk)
    truth = brute(sq, sk, left, right, chunk)
    assert np.array_equal(policy.matrix(), truth)
    assert np.array_equal(policy.rows_without_key(), ~truth.any(axis=1) if sq else np.zeros(0, bool))
    rebuilt = np.zeros((sq, sk), bool)
    row = key = 0
    for rows, keys in policy.chunk_segments():
        assert (rows.begin, keys.begin) == (row, key) and not (rows.empty and keys.empty)
        row, key = rows.end, keys.end
        assert len(keys) <= chunk
        rebuilt[rows.begin:rows.end, keys.begin:keys.end] = Mask(left, right).policy(len(rows), len(keys)).matrix()
    assert (row, key) == (sq, sk)
    assert np.array_equal(rebuilt, truth)


def hull(indices) -> IndexRange:
    indices = list(indices)
    return IndexRange(min(indices), max(indices) + 1) if indices else IndexRange(0, 0)


def ceil_div(a, b):
    return -(-a // b)


@pytest.mark.parametrize("seqlens, window", CASES)
def test_numpy_twin_matches_the_rule_element_by_element(seqlens, window):
    (sq, sk), (left, right) = seqlens, window
    policy = Mask(left, right).policy(sq, sk)
    truth = brute(sq, sk, left, right)
    assert np.array_equal(policy.matrix(), truth)
    assert np.array_equal(policy.rows_without_key(), ~truth.any(axis=1) if sq else np.zeros(0, bool))
    for r0 in range(sq):
        for r1 in range(r0 + 1, sq + 1):
            assert policy.keys_of_rows(r0, r1) == hull(np.nonzero(truth[r0:r1].any(axis=0))[0]), (r0, r1)
    for k0 in range(sk):
        for k1 in range(k0 + 1, sk + 1):
            assert policy.rows_of_keys(k0, k1) == hull(np.nonzero(truth[:, k0:k1].any(axis=1))[0]), (k0, k1)
    for qb in range(ceil_div(sq, BLOCK_M)):
        rows = slice(qb * BLOCK_M, min(sq, (qb + 1) * BLOCK_M))
        blocks = hull(j // BLOCK_N for j in np.nonzero(truth[rows].any(axis=0))[0])
        got = policy.kv_blocks(BLOCK_N, rows.start, rows.stop)
        assert (got if not got.empty else IndexRange(0, 0)) == blocks
        for kb in range(ceil_div(sk, BLOCK_N)):
            tile = np.zeros((rows.stop - rows.start, BLOCK_N), bool)
            keys = truth[rows, kb * BLOCK_N:(kb + 1) * BLOCK_N]
            tile[:, :keys.shape[1]] = keys
            assert policy.tile_needs_mask(rows.start, rows.stop - rows.start, kb * BLOCK_N, BLOCK_N) == \
                (not tile.all()), (qb, kb)
            # Each edge the tile does not cross holds for all its scores (rows below seqlen_q, keys anywhere).
            edges = policy.tile_edges(rows.start, rows.stop - rows.start, kb * BLOCK_N, BLOCK_N)
            r, k = np.arange(rows.start, rows.stop)[:, None], kb * BLOCK_N + np.arange(BLOCK_N)[None, :]
            assert edges.left or left < 0 or (k >= policy.diagonal(r) - left).all(), (qb, kb)
            assert edges.right or right < 0 or (k <= policy.diagonal(r) + right).all(), (qb, kb)
            assert edges.end or (k < sk).all(), (qb, kb)
    # The lane form: from any (row, key), the limits give visible(row + dr, key + dc) for offsets either side.
    for row in range(-2, sq + 2):
        for key in range(-1, sk + 2):
            dr, dc = np.arange(-3, 6)[:, None], np.arange(-3, 7)[None, :]
            rr, kk = np.broadcast_arrays(row + dr, key + dc)
            inside = (rr >= 0) & (rr < sq) & (kk >= 0) & (kk < sk)
            truth_at = np.zeros(inside.shape, bool)
            truth_at[inside] = truth[rr[inside], kk[inside]]
            got = policy.visible_from(policy.lane_tile(row, key), dr, dc)
            assert np.array_equal(got[inside], truth_at[inside]), (row, key)
            assert not got[(kk >= sk) & (rr >= 0) & (rr < sq)].any(), (row, key)
    for kb in range(ceil_div(sk, BLOCK_N)):
        keys = slice(kb * BLOCK_N, min(sk, (kb + 1) * BLOCK_N))
        blocks = hull(i // BLOCK_M for i in np.nonzero(truth[:, keys].any(axis=1))[0])
        got = policy.q_blocks(BLOCK_M, keys.start, keys.stop)
        assert (got if not got.empty else IndexRange(0, 0)) == blocks


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_rows_chunk_is_the_one_row_segment_of_chunk_segments(chunk):
    """The KV-cache form of chunk_segments (first key of the rows' chunk, whether all rows lie in it), for every
    key count and row count, against the segments themselves."""
    for seqlen_q in range(0, 6):
        keys = np.arange(0, 30)
        first, single = MaskPolicy.rows_chunk(chunk, seqlen_q, keys)
        for n, got_first, got_single in zip(keys, first, single):
            with_rows = [(r, k) for r, k in Mask(-1, 0, chunk).policy(seqlen_q, int(n)).chunk_segments()
                         if not r.empty]
            assert got_single == (len(with_rows) <= 1), (seqlen_q, n)
            if with_rows and got_single and n > 0:
                assert with_rows[0][0] == IndexRange(0, seqlen_q) and with_rows[0][1].begin == got_first, (seqlen_q, n)


def test_mask_description_validates_and_names_causal():
    assert Mask.causal() == Mask(-1, 0) and Mask.causal().is_causal and not Mask().is_causal
    assert Mask.causal(False) == Mask() and Mask().is_full
    for bad in (-2, 1.5, True, "3"):
        with pytest.raises(ValueError, match="Mask.window_left must be an int >= -1"):
            Mask(bad, 0)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="Mask.chunk must be an int >= 0"):
            Mask(-1, 0, bad)
    assert Mask.of(True, (-1, -1), 8) == Mask(-1, 0, 8) and Mask(-1, 0, 8).window == Mask(-1, 0)
    assert not Mask(-1, 0, 8).is_causal and not Mask(-1, -1, 8).is_full and not Mask(-1, 0, 8).last_row_sees_every_key
    # The kernels take no chunks: a Problem carrying some is refused (cuflash/chunks.py runs them as sequences).
    with pytest.raises(ValueError, match="Problem.mask must have no chunks"):
        Problem("float16", 1, 8, 8, 1, 1, 16, mask=Mask(-1, 0, 4))
    with pytest.raises(TypeError, match="Problem.mask must be a cuflash.mask.Mask"):
        Problem("float32", 1, 2, 2, 1, 1, 8, mask=True)
    assert Problem("float32", 1, 3, 5, 1, 1, 8, mask=Mask(2, 1)).mask_policy == MaskPolicy(3, 5, 2, 1)


def _probe(sq, sk, left, right) -> np.ndarray:
    nq, nk = ceil_div(sq, BLOCK_M), ceil_div(sk, BLOCK_N)
    out = np.full(sq * sk + 2 * sq + 4 * nq + 4 * nk + 4 * nq * nk + 3 * sq * sk, -99, dtype=np.int32)
    problem = Problem("float32", 1, sq, sk, 1, 1, 8, mask=Mask(left, right))
    params = pack_params(problem, softmax_scale=1.0, pointers={"out": out.ctypes.data}, strides={})
    kernel = KernelInstance(str(PROBE), f"masktest::mask_probe_kernel<{BLOCK_M}, {BLOCK_N}>")
    sim.launch(kernel, (1, 1, 1), (1, 1, 1), 0, params, [out])
    return out


@pytest.mark.parametrize("seqlens, window", [(s, WINDOWS[i % len(WINDOWS)]) for i, s in enumerate(SEQLENS)]
                         + [((6, 13), w) for w in WINDOWS])
def test_cpp_policy_equals_the_numpy_twin(seqlens, window):
    (sq, sk), (left, right) = seqlens, window
    got = _probe(sq, sk, left, right)
    policy = MaskPolicy(sq, sk, left, right)
    rows = np.arange(sq)
    expected = [policy.matrix().astype(np.int32).ravel(),
                np.stack([policy.key_begin(rows), policy.key_end(rows)], axis=1).ravel()]
    for qb in range(ceil_div(sq, BLOCK_M)):
        r0, r1 = qb * BLOCK_M, min(sq, (qb + 1) * BLOCK_M)
        expected.append([*policy.kv_blocks(BLOCK_N, r0, r1), *policy.keys_of_rows(r0, r1)])
    for kb in range(ceil_div(sk, BLOCK_N)):
        k0, k1 = kb * BLOCK_N, min(sk, (kb + 1) * BLOCK_N)
        expected.append([*policy.q_blocks(BLOCK_M, k0, k1), *policy.rows_of_keys(k0, k1)])
    for qb in range(ceil_div(sq, BLOCK_M)):
        for kb in range(ceil_div(sk, BLOCK_N)):
            r0 = qb * BLOCK_M
            expected.append([int(policy.tile_needs_mask(r0, min(BLOCK_M, sq - r0), kb * BLOCK_N, BLOCK_N)),
                             *map(int, policy.tile_edges(r0, min(BLOCK_M, sq - r0), kb * BLOCK_N, BLOCK_N))])
    expected.append([policy.lane_tile(i, j) for i in range(sq) for j in range(sk)])
    expected = np.concatenate([np.asarray(e, dtype=np.int32).ravel() for e in expected])
    np.testing.assert_array_equal(got, expected)


# The rule's arithmetic: the diagonal offset seqlen_k - seqlen_q in any spelling, and the old causal flag.
_VISIBILITY = re.compile(r"seqlen_k\s*-\s*(p\.|problem\.|self\.)?seqlen_q|\bsk\s*-\s*sq\b|is_causal\b|"
                         r"window_(left|right)\s*[-+<>]")
_HOMES = {"cuda_src/common/mask.cuh", "cuflash/mask.py"}
# Not cuflash deciding anything: the benchmark's CuPy peer is attention as a CuPy user writes it.
_PEER_CODE = {"cuflash/benchmarks/peers.py"}
# jax.nn.dot_product_attention's signature names its flag is_causal; the drop-in keeps the name (and only the name:
# its band goes through Mask.top_left).
_SIGNATURE_NAMES = {"cuflash/jax/_dot_product.py": re.compile(r"\bis_causal\b")}


def _code_lines(path: Path):
    """(line number, code) with comments and string literals (docstrings included) removed."""
    text = path.read_text()
    if path.suffix != ".py":
        text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
        for number, line in enumerate(text.splitlines(), 1):
            yield number, line.split("//")[0]
        return
    lines = [list(line) for line in text.splitlines()]
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            (row0, col0), (row1, col1) = token.start, token.end
            for row in range(row0, row1 + 1):
                line = lines[row - 1]
                start, end = (col0 if row == row0 else 0), (col1 if row == row1 else len(line))
                line[start:end] = " " * (end - start)
    yield from ((number, "".join(chars)) for number, chars in enumerate(lines, 1))


def test_visibility_is_decided_only_in_mask_cuh_and_its_twin():
    offenders = []
    for path in sorted([*REPO.glob("cuda_src/**/*"), *REPO.glob("cuflash/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if not path.is_file() or rel in _HOMES | _PEER_CODE or path.suffix not in {".py", ".cu", ".cuh", ".h", ".cpp"}:
            continue
        for number, code in _code_lines(path):
            if rel in _SIGNATURE_NAMES:
                code = _SIGNATURE_NAMES[rel].sub("causal_flag", code)
            if _VISIBILITY.search(code):
                offenders.append(f"{rel}:{number}: {code.strip()}")
    assert not offenders, "visibility decided outside mask.cuh / cuflash/mask.py:\n" + "\n".join(offenders)


def test_the_single_home_check_catches_a_planted_rule(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""j <= i + seqlen_k - seqlen_q in a docstring is fine."""\nlast = row + sk - sq  # not\n'
                       'x = "seqlen_k - seqlen_q"\noff = problem.seqlen_k - problem.seqlen_q\n')
    assert [n for n, code in _code_lines(planted) if _VISIBILITY.search(code)] == [2, 4]
    cpp = tmp_path / "planted.cu"
    cpp.write_text("// p.seqlen_k - p.seqlen_q in a comment\nint off = p.seqlen_k - p.seqlen_q;\n")
    assert [n for n, code in _code_lines(cpp) if _VISIBILITY.search(code)] == [2]


def _tanh_probe(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.full_like(x, np.nan)
    problem = Problem("float32", 1, x.size, 1, 1, 1, 8)
    params = pack_params(problem, softmax_scale=1.0, pointers={"q": x.ctypes.data, "out": out.ctypes.data}, strides={})
    kernel = KernelInstance(str(PROBE), "masktest::tanh_probe_kernel")
    sim.launch(kernel, (-(-x.size // 128), 1, 1), (128, 1, 1), 0, params, [x, out])
    return out


def test_softcap_tanh_is_within_a_few_ulps_of_one_and_saturates():
    # 2^126 < e^(2x) + 1 < 2^128 for x in (43.67, 44.36): __fdividef's range that gives 0, so t = 1 there.
    special = [0.0, 1e-8, -1e-8, 0.5, 9.1, 20.0, 43.7, 44.0, 88.0, 1e4, np.inf]
    x = np.concatenate([np.linspace(-60.0, 60.0, 4001), special, np.negative(special)]).astype(np.float32)
    got = _tanh_probe(x)
    expected = np.tanh(x.astype(np.float64))
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - expected)) <= 4 * 2.0**-23
    saturated = np.abs(x) >= 9.1  # float32 tanh is +-1 from about 9.01 on
    np.testing.assert_array_equal(got[saturated], np.sign(x[saturated]))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_softcap_tanh_compiles_to_ex2_and_an_approximate_reciprocal(arch):
    compiled = nvrtc.compile_instance(KernelInstance(str(PROBE), "masktest::tanh_probe_kernel"), arch)
    sass = nvrtc.dump_sass(compiled)
    assert sass is not None, "cuobjdump/nvdisasm missing: install the test extra (nvidia-cuda-cuobjdump, -nvdisasm)"
    assert re.search(r"\bMUFU\.EX2\b", sass) and re.search(r"\bMUFU\.RCP\b", sass), sass[:4000]
    # An IEEE float division shows as FCHK (its range check) and a CALL to its slow path.
    assert not re.search(r"\b(FCHK|CALL)\b", sass), sass[:4000]
