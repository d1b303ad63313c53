"""Device-mesh parallelism: data-parallel attention, expert-parallel MoE, collectives, multi-host init.

Entry points: :func:`mesh.make_layout` (mesh + axis roles), :mod:`sharding` (PartitionSpec table),
:func:`sharded_forward.make_sharded_forward` (a ``forward_step`` over the mesh).
"""
