"""Flex attention: attention with a user's mask_mod, reading only the blocks it leaves visible.

``create_block_mask`` turns a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` into a ``BlockMask``, the per-block lists
the kernels visit (cuflash.flex.block_mask).
"""

from .block_mask import BlockMask, TileLists, TileVisits, create_block_mask

__all__ = ["BlockMask", "TileLists", "TileVisits", "create_block_mask"]
