// dropout.cuh: which attention probabilities dropout keeps. The one place a kernel learns it.
//
// Rule: the keep mask is a pure function of (seed, batch, head, row i, key j), independent of tiles, warps,
// variant, algorithm and backend, so every kernel (and the NumPy twin, cuflash/dropout.py) drops the same
// elements bitwise. With Philox4x32-10 (Salmon et al., SC'11; the counter-based generator cuRAND and FA2 use):
//     words  = Philox4x32_10(counter = (j >> 1, i & ~8, head, batch), key = (seed mod 2^32, seed >> 32))
//     word   = words[2 * ((i >> 3) & 1) + (j & 1)]
//     keep   = word >= threshold,  threshold = floor(dropout_p * 2^32) (packed by Python)
// so P(drop) = threshold / 2^32, within 2^-32 of dropout_p. One Philox call covers rows {i, i ^ 8} x keys {j, j ^ 1}:
// exactly the four elements an m16n8 accumulator fragment gives one lane (rows g and g + 8, keys 2t and 2t + 1):
// the tensor-core kernels get all four from one evaluation (keep_bits); the SIMT ones call keep per element.
// Kept probabilities are scaled by 1 / (1 - dropout_p) (AttentionParams::dropout_rescale); the lse is not
// changed by dropout (it normalizes the softmax before anything is dropped).
//
// batch, head, i and j are global: a call that holds only a shard of the batch or of the heads (a device's part of
// a call partitioned under sharded jit) adds the global index of its first batch and first head, and a call on a
// block of the sequence (a step of ring attention) the global index of its first query row and first key, so
// every shard drops exactly the elements the whole call drops. The row offset is a multiple of 16 and the key
// offset even (ring attention checks it), so the four elements of one Philox evaluation stay together.
//
// One call may hold several calls' batches, each with its own seed (JAX's vmap folds its mapped elements into the
// batch axis): with dropout_batches_per_seed = n > 0, global batch b uses the seed of row b / n of the seed buffer
// and Philox batch b % n, exactly what the mapped element's own call would use.
//
// Traffic: with dropout every thread also reads the seed buffer's first 24 bytes, and its seed row (once per kernel in
// the SIMT kernels, once per K/V block in the tensor-core forward and per Q block and strip in its backward: L1 hits
// on a GPU, kept out of registers there because those kernels run at the register limit). The kernels' traffic
// formulas are for attention without dropout.
//
// The seed is a side input (AttentionParams::dropout_seed: rows of eight 32-bit words in a float32-typed buffer:
// the seed, low word first, then, in the first row only, the call's first global batch, head, query row and key, 0
// unless the call is part of a larger one; the rest unused) rather than scalars so that JAX can pass a traced seed
// drawn from a PRNG key, and a shard's offsets from its mesh position, under jit.
#pragma once

#include "arch/arch.cuh"
#include "common/attention_params.cuh"

namespace cuflash {

// Philox4x32 with 10 rounds, bit-exact to Random123's philox4x32_10 (known-answer vectors in the tests).
__device__ __forceinline__ void philox4x32_10(unsigned (&ctr)[4], unsigned key0, unsigned key1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key0 += 0x9E3779B9u;
      key1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = static_cast<unsigned long long>(0xD2511F53u) * ctr[0];
    const unsigned long long p1 = static_cast<unsigned long long>(0xCD9E8D57u) * ctr[2];
    const unsigned hi0 = static_cast<unsigned>(p0 >> 32), lo0 = static_cast<unsigned>(p0);
    const unsigned hi1 = static_cast<unsigned>(p1 >> 32), lo1 = static_cast<unsigned>(p1);
    ctr[0] = hi1 ^ ctr[1] ^ key0;
    ctr[1] = lo1;
    ctr[2] = hi0 ^ ctr[3] ^ key1;
    ctr[3] = lo0;
  }
}

// Words per row of the seed buffer (AttentionParams::dropout_seed; cuflash/dropout.py's SEED_ROW_WORDS).
constexpr int kSeedRowWords = 8;

struct Dropout {
  // Values, not a reference to the kernel's parameters: a reference held here made nvcc copy the whole
  // AttentionParams to local memory (a 424-byte stack frame in the tensor-core forward).
  unsigned seed0;
  unsigned seed1;
  unsigned threshold;  // AttentionParams::dropout_threshold; 0: off
  float rescale;       // AttentionParams::dropout_rescale: 1 / (1 - dropout_p), 1 when off
  int batch;
  int head;
  int first_row;  // the call's first global query row and first key (ring attention's blocks; else 0)
  int first_key;

  // batch is the call's sequence index (for varlen too), head its query head; the seed buffer's words 2 and 3
  // make them global, and dropout_batches_per_seed picks the seed row of the global batch.
  __device__ __forceinline__ static Dropout of(const AttentionParams& p, int batch, int head) {
    if (p.dropout_threshold == 0u) return Dropout{0u, 0u, 0u, 1.f, batch, head, 0, 0};
    const unsigned* words = reinterpret_cast<const unsigned*>(p.dropout_seed);
    int global_batch = batch + static_cast<int>(arch::load(words + 2));
    const unsigned* seed = words;
    if (p.dropout_batches_per_seed > 0) {
      const int row = global_batch / p.dropout_batches_per_seed;
      global_batch -= row * p.dropout_batches_per_seed;
      seed += kSeedRowWords * row;
    }
    return Dropout{arch::load(seed),
                   arch::load(seed + 1),
                   p.dropout_threshold,
                   p.dropout_rescale,
                   global_batch,
                   head + static_cast<int>(arch::load(words + 3)),
                   static_cast<int>(arch::load(words + 4)),
                   static_cast<int>(arch::load(words + 5))};
  }

  // Block-uniform: kernels skip the element work when dropout is off.
  __device__ __forceinline__ bool active() const { return threshold != 0u; }

  // Keep bits of the four elements rows {row, row + 8} x keys {key, key + 1} (the call's rows and keys; row with
  // bit 3 clear, key even): bit 2 h + e is element (row + 8 h, key + e). One Philox evaluation; the tensor-core
  // kernels call this once per accumulator fragment (rows g and g + 8, keys 2t and 2t + 1 of an n8 tile).
  __device__ __forceinline__ unsigned keep_bits(int row, int key) const {
    unsigned words[4] = {static_cast<unsigned>(key + first_key) >> 1, static_cast<unsigned>(row + first_row),
                         static_cast<unsigned>(head), static_cast<unsigned>(batch)};
    philox4x32_10(words, seed0, seed1);
    return (words[0] >= threshold ? 1u : 0u) | (words[1] >= threshold ? 2u : 0u) |
           (words[2] >= threshold ? 4u : 0u) | (words[3] >= threshold ? 8u : 0u);
  }

  __device__ __forceinline__ bool keep(int row, int key) const {
    return (keep_bits(row & ~8, key & ~1) >> (2 * ((row >> 3) & 1) + (key & 1))) & 1u;
  }

  // The mask that zeroes the dropped halves of a packed pair of 16-bit values (low half: bit 0 of `pair_bits`).
  __device__ __forceinline__ static unsigned half_mask(unsigned pair_bits) {
    return ((pair_bits & 1u) ? 0x0000FFFFu : 0u) | ((pair_bits & 2u) ? 0xFFFF0000u : 0u);
  }

  // The backward's factor for element (row, key): the forward multiplied P by it (keep / (1 - dropout_p)), so dV
  // takes P times it and dP = dO V^T, the gradient of the dropped P, times it is the gradient of P. 1 when off.
  __device__ __forceinline__ float factor(int row, int key) const {
    return !active() ? 1.f : keep(row, key) ? rescale : 0.f;
  }
};

}  // namespace cuflash
