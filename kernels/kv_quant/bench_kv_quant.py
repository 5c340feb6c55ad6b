"""Time InQuant's Triton kernels against the PyTorch references (needs CUDA for timings).

Run: ``.venv/bin/python kernels/kv_quant/bench_kv_quant.py [--tokens 4096]``. Without a GPU it
runs a tiny interpreted correctness check instead and says that no timing was possible.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    from llmkit.kernels import kv_quant as kq
    from llmkit.serving.kv_cache.inquant import estimate_descriptor

    cuda = torch.cuda.is_available()
    H, D, G = (args.heads, args.head_dim, args.group) if cuda else (2, 16, 8)
    T = args.tokens if cuda else 16
    dev = "cuda" if cuda else "cpu"
    x = torch.randn(1, H, T, D, device=dev)
    x[..., 3] *= 30
    d = estimate_descriptor(x, n_outliers=4)
    role, partner = kq.role_maps(d.outlier_ids.to(dev), d.donor_ids.to(dev), D)
    groups = x.view(1, H, T // G, G, D).transpose(1, 2).reshape(T // G, H, G, D)
    ref = kq.quantize_pack_ref(groups, role, partner)
    tri = kq.quantize_pack_triton(groups, role, partner)
    same = all(torch.equal(a, b) for a, b in zip(ref, tri))
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "quant_bit_exact": same}
    if cuda:
        def timed(f, n=50):
            f()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                f()
            e.record()
            torch.cuda.synchronize()
            return s.elapsed_time(e) / n

        out["quant_ms_ref"] = timed(lambda: kq.quantize_pack_ref(groups, role, partner))
        out["quant_ms_triton"] = timed(lambda: kq.quantize_pack_triton(groups, role, partner))
        p, sc, z = tri
        packed = p.view(T // G, H, G, D // 2).transpose(0, 1).reshape(1, H, T, D // 2)
        sc, z = sc.transpose(0, 1)[None], z.transpose(0, 1)[None]
        lens = [G] * (T // G)
        out["dequant_ms_ref"] = timed(lambda: kq.dequant_unpack_ref(packed, sc, z, lens, d.outlier_ids, d.donor_ids))
        out["dequant_ms_triton"] = timed(lambda: kq.dequant_unpack_triton(packed, sc, z, lens, d.outlier_ids,
                                                                         d.donor_ids))
    else:
        print("no CUDA device: correctness only, no timings", file=sys.stderr)
    print(json.dumps(out))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
