"""Prefill/decode disaggregation: one server prefills, another decodes, the request's state moves between.

For Qwen3.5 a request's state is the KV of its prompt in the attention layers' pages AND the conv window
and recurrent state of every Gated DeltaNet layer (the request's GDN slot). Moving only the KV decodes
garbage; this package moves both, so a disaggregated deployment gives the same tokens as one server.

Protocol (SGLang's shape; docs/internals.md, "disagg/"): the router sends the same request body to a prefill
server and a decode server, with `bootstrap_host`, `bootstrap_port` and `bootstrap_room` injected.

- The prefill server (`--disaggregation-mode prefill`) runs the prompt with its own radix cache, samples
  the first token, and puts the request's state into its outbox under the room: the prompt's KV,
  token-major (so a decode server with another page size re-pages it), streamed one prefill chunk at a
  time while the prompt is still being prefilled, then the GDN state of the request's slot and the first
  token (+ its logprobs). It then frees the pages and the slot as for any finished request (the prompt's
  pages go to its radix tree). It listens on `--disaggregation-bootstrap-port` (bootstrap_server.py).
- The decode server (`--disaggregation-mode decode`) does not prefill such a request: a receiver
  connects to bootstrap_host:bootstrap_port, asks for the room, and collects the state in host memory
  (receiver.py); then the scheduler gives the request pages (its own page size) and a GDN slot, writes
  KV and GDN state into its device cache, and decodes it as a running request (decode.py).
- Header first (wire.py): protocol version, model fingerprint, dtypes and per-layer shapes, token count,
  a hash of the prompt ids. A mismatch fails the request with a message naming both sides; nothing is
  misread.

Rooms: one transfer per sequence. A request with one room and k sequences (a batch of prompts and/or
`n` > 1 samples, prompt-major) uses rooms room, room + 1, ..., room + k - 1, as SGLang does for a scalar
room; a list of rooms gives one room per sequence when its length is k, or one per prompt (sample j of
prompt p then uses rooms[p] + j) when its length is the number of prompts. smg sends a list of n rooms
for a chat request with n > 1, which the first rule covers.

Failures: a request the prefill server rejects (bad input, too long) posts an error to its room; the
decode server fails the waiting request with the same status and message. A decode that stops waiting
(client abort or disconnect) cancels the room, which aborts the prefill if it is still running and drops
the state otherwise. State nobody fetches is dropped after `--disaggregation-timeout` seconds; a decode
whose prefill server goes away (connection closed) fails the request at once.

Backends: `tcp` (across processes and hosts; bulk bytes leave the device through host memory) and
`inprocess` (`--disaggregation-mode colocated-split`: a prefill engine and a decode engine on two
device groups of one process; arrays move with `jax.device_put`, colocated.py).
"""

from sglang_tpu_qwen.utils.errors import TransferError

__all__ = ["TransferError"]
