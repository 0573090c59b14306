// mask_probe.cu: writes every answer of cuflash::MaskPolicy for one AttentionParams, so that
// tests/test_mask.py can compare the C++ policy with its NumPy twin (cuflash/mask.py) exactly.
//
// One thread; p.out is an int buffer laid out as (sq = seqlen_q, sk = seqlen_k,
// nq = ceil(sq / BlockM), nk = ceil(sk / BlockN)):
//   visible(i, j)                                  sq * sk
//   key_begin(i), key_end(i)                       sq * 2
//   per Q block: kv_blocks<BlockN>, keys_of_rows   nq * 4
//   per K block: q_blocks<BlockM>, rows_of_keys    nk * 4
//   per tile: tile_needs_mask(row0, rows, key0, BlockN), then
//             tile_edges(...)'s left, right, end           nq * nk * 4
//   lane_tile(i, j): left, right, end                      sq * sk * 3
// tanh_probe_kernel: the softcap's tanh (tanh_by_exp2) of every input, for its accuracy and SASS tests.
#include "arch/arch.cuh"
#include "common/mask.cuh"

namespace masktest {

template <int BlockM, int BlockN>
__global__ void mask_probe_kernel(const cuflash::AttentionParams p) {
  using cuflash::IndexRange;
  const cuflash::MaskPolicy mask = cuflash::MaskPolicy::of(p, cuflash::BlockInfo::of(p, 0, 0));
  int* out = static_cast<int*>(p.out);
  const int sq = p.seqlen_q, sk = p.seqlen_k;
  const int nq = cuflash::ceil_div(sq, BlockM), nk = cuflash::ceil_div(sk, BlockN);
  int at = 0;
  auto put = [&](int value) { cuflash::arch::store(out + at++, value); };
  auto put_range = [&](IndexRange r) {
    put(r.begin);
    put(r.end);
  };
  for (int i = 0; i < sq; ++i)
    for (int j = 0; j < sk; ++j) put(mask.visible(i, j) ? 1 : 0);
  for (int i = 0; i < sq; ++i) put_range(IndexRange{mask.key_begin(i), mask.key_end(i)});
  for (int b = 0; b < nq; ++b) {
    const int row0 = b * BlockM, row_end = min(row0 + BlockM, sq);
    put_range(mask.kv_blocks<BlockN>(row0, row_end));
    put_range(mask.keys_of_rows(row0, row_end));
  }
  for (int b = 0; b < nk; ++b) {
    const int key0 = b * BlockN, key_end = min(key0 + BlockN, sk);
    put_range(mask.q_blocks<BlockM>(key0, key_end));
    put_range(mask.rows_of_keys(key0, key_end));
  }
  for (int a = 0; a < nq; ++a)
    for (int b = 0; b < nk; ++b) {
      const int row0 = a * BlockM, rows = min(BlockM, sq - row0), key0 = b * BlockN;
      put(mask.tile_needs_mask(row0, rows, key0, BlockN));
      const cuflash::TileEdges edges = mask.tile_edges(row0, rows, key0, BlockN);
      put(edges.left);
      put(edges.right);
      put(edges.end);
    }
  for (int i = 0; i < sq; ++i)
    for (int j = 0; j < sk; ++j) {
      const cuflash::LaneTileMask limits = mask.lane_tile(i, j);
      put(limits.left);
      put(limits.right);
      put(limits.end);
    }
}

// out[i] = tanh_by_exp2(q[i]) for i < seqlen_q (the softcap's tanh, one thread per element).
__global__ void tanh_probe_kernel(const cuflash::AttentionParams p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.seqlen_q)
    cuflash::arch::store(static_cast<float*>(p.out) + i,
                         cuflash::tanh_by_exp2(cuflash::arch::load(static_cast<const float*>(p.q) + i)));
}

}  // namespace masktest
