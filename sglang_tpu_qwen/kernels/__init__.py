"""Pallas TPU kernels, each beside its pure-jnp reference (docs/internals.md, "kernels/").

``ragged_paged_attention``: one call runs the attention of every sequence of a step over the paged KV cache
and writes the step's new K/V into their pages. ``gdn``: causal conv1d + q/k L2 norm + gated delta rule,
reading and updating each sequence's conv and recurrent state slot in place. ``dispatch`` picks the Pallas
kernel or the reference per layer kind; each backend (``attention_backend``, ``gdn_backend``) names its kernel
and the layout of the pools it reads (``ragged_paged_attention/layout.py``, ``gdn/state_layout.py``).
Subpackages import nothing at package level so that ``model`` can import a kernel module without a cycle.
"""
