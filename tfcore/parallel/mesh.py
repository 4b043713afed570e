"""A 2-D mesh of ranks, data parallel x tensor parallel, and its two families of groups.

World rank w = d * N_T + t, for d in 0..N_D-1 (data-parallel index) and t in 0..N_T-1
(tensor-parallel index): the ranks of one tensor-parallel group are consecutive (on one
machine, where the links are fastest: tensor parallelism talks in every sub-block, data
parallelism once per step).

    tp group of rank w: {d * N_T + t' : t'}   (same d)  -- the model's shards
    dp group of rank w: {d' * N_T + t : d'}   (same t)  -- the same shard, other data
"""
from __future__ import annotations


class Mesh:
    def __init__(self, world, tp: int = 1, dp: int | None = None):
        for name, value in (("tp", tp), ("dp", dp)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if dp is None:
            if world.size % tp:
                raise ValueError(f"the world size {world.size} is not a multiple of tp={tp}")
            dp = world.size // tp
        if tp * dp != world.size:
            raise ValueError(f"the mesh tp={tp} x dp={dp} needs {tp * dp} ranks, but the world "
                             f"has {world.size}")
        world.check_same(f"tp={tp} dp={dp}", "the mesh layout")
        self.world, self.tp_size, self.dp_size = world, tp, dp
        self.tp_rank, self.dp_rank = world.rank % tp, world.rank // tp
        self.tp = world.split(color=self.dp_rank, key=self.tp_rank, name="tp")
        self.dp = world.split(color=self.tp_rank, key=self.dp_rank, name="dp")

    def __repr__(self):
        return (f"Mesh(tp={self.tp_size}, dp={self.dp_size}; world rank {self.world.rank} = "
                f"(dp {self.dp_rank}, tp {self.tp_rank}))")
