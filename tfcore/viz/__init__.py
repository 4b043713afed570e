"""Figures drawn from runs: each picture is computed from what the code does, never by hand.

viz sits above parallel and train in the layering (it imports them, never the reverse), and
imports matplotlib only inside its drawing functions, so tfcore does not need matplotlib. No
module of tfcore outside viz imports matplotlib.

    loss        a run's loss curves from its log.jsonl: read_log, moving_average,
                plot_run (python -m tfcore.plot is its command line)
    moe         a mixture of experts (chapter 24): routing_data / draw_routing,
                draw_dispatch (tokens to experts, the [N_E, C] buffer and what drops),
                send_matrix_data / draw_send_matrix (the expert-parallel all-to-all),
                draw_expert_load (each expert's share of the assignments per step)
    parallel    the parallel layouts, one `*_data` function (runs the real thing on
                simulated ranks, returns plain numbers the chapters assert on) beside
                each `draw_*` function (draws those numbers on a matplotlib Axes):
                ring_all_reduce_states / draw_ring_states   the ring all-reduce, per step
                linear_shard_layout / draw_linear_shards    column/row-parallel shards
                draw_fg_block                               where f and g sit in a block
                mesh_groups / draw_mesh                     the DP x TP mesh
                zero1_layout / draw_zero1                   ZeRO-1's optimizer shards
                ring_rotation_data / draw_ring_rotation,
                draw_causal_tiles                           ring attention's K/V rotation
                                                            and its causal score tiles
                draw_timeline                               a measured pipeline timeline
                mesh3d_coords / draw_mesh3d                 the DP x PP x TP mesh
                RANK_COLOURS, STATE_COLOURS                 the colours every figure shares
"""
