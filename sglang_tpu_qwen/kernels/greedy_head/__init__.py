"""Greedy ids straight from the hidden states in one Pallas TPU kernel (kernel.py): the greedy sampling program's
and the MTP drafts' lm_head product and argmax, without writing the ``[N, V]`` logits (--sampling-backend)."""
