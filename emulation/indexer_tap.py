"""Record a server's first long prefill top-k calls of the DSA indexer (validation only).

Both servers of the b12x serving comparison record: stock vLLM's DeepGEMM path (the inputs of
``fp8_fp4_mqa_logits``, then what ``top_k_per_row_prefill`` chose) and the overlay's b12x path
(``b12x_indexer.prefill_topk``'s inputs and output). The first such call of a request is layer
0, whose inputs are the same in both servers; its chosen positions can then be compared row by
row and explained with the reference logits (``dsa_image.validation.b12x_serving``).

A call is recorded when some row sees more keys than it selects (otherwise the selection is
every key), outside CUDA graph capture, up to ``DSA_INDEXER_TAP_CALLS`` (default 4) per process,
as ``TAP_DIR/<kind>-<pid>-<n>.pt``: q and keys as raw bytes, weights, scales, ks, ke, and the
positions chosen per row, relative to the row's ks, as vLLM's top-k buffer holds them.
"""

from __future__ import annotations

import os

CALLS = int(os.environ.get("DSA_INDEXER_TAP_CALLS", "4"))
SPARSE_ATTN_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
B12X_INDEXER = "vllm.v1.attention.backends.mla.b12x_indexer"


def with_taps(patches: dict, tap_dir: str) -> dict:
    """``patches`` plus this module's, composed where both patch one module."""
    os.makedirs(tap_dir, exist_ok=True)
    tap = _Recorder(tap_dir)
    taps = {SPARSE_ATTN_INDEXER: tap.deepgemm, B12X_INDEXER: tap.b12x}
    combined = dict(patches)
    for name, patch in taps.items():
        earlier = combined.get(name)
        combined[name] = patch if earlier is None else _both(earlier, patch)
    return combined


def _both(first, second):
    def patch(module) -> None:
        first(module)
        second(module)

    return patch


class _Recorder:
    def __init__(self, tap_dir: str):
        self.tap_dir = tap_dir
        self.saved = 0
        self.pending: dict | None = None

    def deepgemm(self, module) -> None:
        logits_fn, ops = module.fp8_fp4_mqa_logits, module.ops
        topk_fn = ops.top_k_per_row_prefill

        # After ke, vLLM 0.24.0 passes clean_logits=, 0.33.0 the chunk's max_seqlen_k.
        def logits(q, kv, weights, ks, ke, *rest, **options):
            self.pending = dict(q=q[0], weights=weights, k_quant=kv[0], k_scale=kv[1], ks=ks, ke=ke)
            return logits_fn(q, kv, weights, ks, ke, *rest, **options)

        def topk(logits_, ks, ke, indices, num_rows, stride0, stride1, k):
            topk_fn(logits_, ks, ke, indices, num_rows, stride0, stride1, k)
            if self.pending is not None:
                self.record("deepgemm", self.pending, indices, k)
            self.pending = None

        module.fp8_fp4_mqa_logits = logits
        ops.top_k_per_row_prefill = topk

    def b12x(self, module) -> None:
        prefill_topk = module.prefill_topk

        def tapped(q, weights, k_quant, k_scale, ks, ke, topk_tokens, out):
            prefill_topk(q, weights, k_quant, k_scale, ks, ke, topk_tokens, out)
            inputs = dict(q=q, weights=weights, k_quant=k_quant, k_scale=k_scale, ks=ks, ke=ke)
            self.record("b12x", inputs, out, topk_tokens)

        module.prefill_topk = tapped

    def record(self, kind: str, inputs: dict, chosen, k: int) -> None:
        import torch

        if self.saved >= CALLS or torch.cuda.is_current_stream_capturing():
            return
        if int((inputs["ke"] - inputs["ks"]).max()) <= k:
            return
        doc = {name: _host(t) for name, t in inputs.items()}
        doc.update(kind=kind, topk=int(k), chosen=chosen[: inputs["ks"].shape[0], :k].cpu().clone())
        torch.save(doc, os.path.join(self.tap_dir, f"{kind}-{os.getpid()}-{self.saved:02d}.pt"))
        self.saved += 1


def _host(tensor):
    import torch

    if tensor.dtype == torch.float8_e4m3fn:
        tensor = tensor.view(torch.uint8)
    return tensor.detach().cpu().clone()
