"""Pallas TPU kernels, each beside its pure-jnp reference (docs/internals.md, "kernels/").

``ragged_paged_attention``: one call runs the attention of every sequence of a step over the paged KV cache
and writes the step's new K/V into their pages. ``gdn``: causal conv1d + q/k L2 norm + gated delta rule,
reading and updating each sequence's conv and recurrent state slot in place. ``fp8_matmul``: the grouped
matmul over block-FP8 weights (the routed experts, and every FP8 linear layer as one group). ``dispatch``
picks the Pallas kernel or the reference per layer kind; each backend (``attention_backend``, ``gdn_backend``,
``moe_backend``) names its kernel and the layout of what it reads (``ragged_paged_attention/layout.py``,
``gdn/state_layout.py``; the MoE backend's token rows, ``MoeBackend.kernel_rows``), and the MoE backend runs
the matmuls of the model's weights, dense or FP8 (``MoeBackend.linear``, ``grouped``, ...).
Subpackages import nothing at package level so that ``model`` can import a kernel module without a cycle.
"""
