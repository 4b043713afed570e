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

Expert parallelism (ep = N_E_P, an MoE model's) shards the experts over blocks of N_E_P
consecutive ranks of a dp group (N_E_P divides N_D): the ep group of rank w holds the dp
indices d' with d' // N_E_P = d // N_E_P, and the edp group, the ranks holding the same
experts, those with d' % N_E_P = d % N_E_P. It adds no ranks to the world.

With a ring (cp = N_C, context parallelism) the mesh is 4-D, DP x PP x CP x TP:
w = ((d * N_P + s) * N_C + c) * N_T + t. The cp group (same d, s, t) holds the chunks of one
sequence; the data group (same s and t: dp x cp) is the group whose gradients are summed
and over which ZeRO shards, since the ranks of a ring, like data-parallel replicas, hold the
same parameters and compute gradients from different tokens. Without a ring the data
group is the dp group.
"""
from __future__ import annotations

from .layout import Layout


class Mesh:
    def __init__(self, world, tp: int = 1, dp: int | None = None, pp: int = 1,
                 cp: int | None = None, ep: int = 1):
        for name, value in (("tp", tp), ("dp", dp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        ring, cp = cp is not None, cp or 1
        inner = tp * pp * cp
        if dp is None:
            if world.size % inner:
                what = f"tp={tp}" + (f" x pp={pp}" if pp > 1 else "") + (
                    f" x cp={cp}" if ring else "")
                what += "" if inner == tp else f" = {inner}"
                raise ValueError(f"the world size {world.size} is not a multiple of {what}")
            dp = world.size // inner
        if inner * dp != world.size:
            shape = f"dp={dp} x pp={pp} x tp={tp}" if pp > 1 else f"tp={tp} x dp={dp}"
            if cp > 1:
                shape += f" x cp={cp}"
            raise ValueError(f"the mesh {shape} needs {inner * dp} ranks, but the world "
                             f"has {world.size}")
        world.check_same(f"tp={tp} dp={dp} pp={pp} cp={cp}", "the mesh layout")
        self.world, self.tp_size, self.dp_size, self.pp_size = world, tp, dp, pp
        self.cp_size = cp
        w = world.rank
        self.tp_rank = w % tp
        self.cp_rank = (w // tp) % cp
        self.pp_rank = (w // (tp * cp)) % pp
        self.dp_rank = w // (tp * cp * pp)
        d, s, c, t = self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank
        self.tp = world.split(color=(d * pp + s) * cp + c, key=t, name="tp")
        self.dp = world.split(color=(s * cp + c) * tp + t, key=d, name="dp")
        # the pipeline's group (stages in order) only when there is more than one stage
        self.pp = (world.split(color=(d * cp + c) * tp + t, key=s, name="pp")
                   if pp > 1 else None)
        # the ring and the data group (dp x cp) only with a ring
        self.cp = (world.split(color=(d * pp + s) * tp + t, key=c, name="cp")
                   if ring else None)
        self.data = (world.split(color=s * tp + t, key=d * cp + c, name="data")
                     if ring else self.dp)
        # expert parallelism: blocks of ep consecutive dp ranks share out the experts; the
        # ranks at the same place of each block (edp) hold the same experts
        if self.dp_size % ep:
            raise ValueError(f"the expert-parallel degree ep = {ep} must divide the "
                             f"data-parallel degree dp = {self.dp_size}: the experts are "
                             "sharded over blocks of data-parallel ranks")
        self.ep_size = ep
        self.ep = self.dp.split(color=d // ep, key=d, name="ep") if ep > 1 else None
        self.edp = self.dp.split(color=d % ep, key=d, name="edp") if ep > 1 else self.dp

    @classmethod
    def of(cls, world, layout: Layout, config=None) -> "Mesh":
        """The mesh of `layout` (dp x pp x tp) on `world`, after layout.validate(config,
        world=world.size): a refused combination or a wrong world size fails here."""
        if not isinstance(layout, Layout):
            raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
        layout.validate(config, world=world.size)
        return cls(world, tp=layout.tp, dp=layout.dp, pp=layout.pp or 1, cp=layout.cp,
                   ep=layout.ep)

    def __repr__(self):
        if self.pp_size > 1:
            return (f"Mesh(dp={self.dp_size}, pp={self.pp_size}, tp={self.tp_size}; world "
                    f"rank {self.world.rank} = (dp {self.dp_rank}, pp {self.pp_rank}, "
                    f"tp {self.tp_rank}))")
        if self.cp_size > 1:
            return (f"Mesh(dp={self.dp_size}, cp={self.cp_size}, tp={self.tp_size}; world "
                    f"rank {self.world.rank} = (dp {self.dp_rank}, cp {self.cp_rank}, "
                    f"tp {self.tp_rank}))")
        return (f"Mesh(tp={self.tp_size}, dp={self.dp_size}; world rank {self.world.rank} = "
                f"(dp {self.dp_rank}, tp {self.tp_rank}))")
