"""A 2-D mesh of ranks, data parallel x tensor parallel, and its two families of groups.

World rank w = d * N_T + t, for d in 0..N_D-1 (data-parallel index) and t in 0..N_T-1
(tensor-parallel index): the ranks of one tensor-parallel group are consecutive (on one
machine, where the links are fastest: tensor parallelism talks in every sub-block, data
parallelism once per step).

    tp group of rank w: {d * N_T + t' : t'}   (same d)  -- the model's shards
    dp group of rank w: {d' * N_T + t : d'}   (same t)  -- the same shard, other data

With pipeline stages (pp = N_P > 1) the mesh is 3-D, DP x PP x TP, tensor parallelism
still innermost: w = (d * N_P + s) * N_T + t for the stage s in 0..N_P-1, and

    pp group of rank w: {(d * N_P + s') * N_T + t : s'}  (same d, t)  -- the stages in order
    tp group: same d and s;   dp group: same s and t (the same stage's shard, other data)
"""
from __future__ import annotations

from .layout import Layout


class Mesh:
    def __init__(self, world, tp: int = 1, dp: int | None = None, pp: int = 1):
        for name, value in (("tp", tp), ("dp", dp), ("pp", pp)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if dp is None:
            if world.size % (tp * pp):
                what = f"tp={tp}" if pp == 1 else f"tp={tp} x pp={pp} = {tp * pp}"
                raise ValueError(f"the world size {world.size} is not a multiple of {what}")
            dp = world.size // (tp * pp)
        if tp * dp * pp != world.size:
            shape = f"dp={dp} x pp={pp} x tp={tp}" if pp > 1 else f"tp={tp} x dp={dp}"
            raise ValueError(f"the mesh {shape} needs {tp * dp * pp} ranks, but the world "
                             f"has {world.size}")
        world.check_same(f"tp={tp} dp={dp} pp={pp}", "the mesh layout")
        self.world, self.tp_size, self.dp_size, self.pp_size = world, tp, dp, pp
        self.tp_rank = world.rank % tp
        self.pp_rank = (world.rank // tp) % pp
        self.dp_rank = world.rank // (tp * pp)
        self.tp = world.split(color=self.dp_rank * pp + self.pp_rank, key=self.tp_rank,
                              name="tp")
        self.dp = world.split(color=self.pp_rank * tp + self.tp_rank, key=self.dp_rank,
                              name="dp")
        # the pipeline's group (stages in order) only when there is more than one stage
        self.pp = (world.split(color=self.dp_rank * tp + self.tp_rank, key=self.pp_rank,
                               name="pp") if pp > 1 else None)

    @classmethod
    def of(cls, world, layout: Layout, config=None) -> "Mesh":
        """The mesh of `layout` (dp x pp x tp) on `world`, after layout.validate(config,
        world=world.size): a refused combination or a wrong world size fails here."""
        if not isinstance(layout, Layout):
            raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
        if layout.cp is not None:
            raise ValueError("a context-parallel layout has no dp x pp x tp mesh: its group "
                             "is the world")
        layout.validate(config, world=world.size)
        return cls(world, tp=layout.tp, dp=layout.dp, pp=layout.pp or 1)

    def __repr__(self):
        if self.pp_size > 1:
            return (f"Mesh(dp={self.dp_size}, pp={self.pp_size}, tp={self.tp_size}; world "
                    f"rank {self.world.rank} = (dp {self.dp_rank}, pp {self.pp_rank}, "
                    f"tp {self.tp_rank}))")
        return (f"Mesh(tp={self.tp_size}, dp={self.dp_size}; world rank {self.world.rank} = "
                f"(dp {self.dp_rank}, tp {self.tp_rank}))")
