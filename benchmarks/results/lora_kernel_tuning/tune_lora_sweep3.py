"""Sweep 3 (one-off): bgmv expand warps/tile, shrink splits; sgmv expand column tile/warps."""
import itertools, json, os
import torch
from mmlora.backends import triton_bgmv as bg, triton_sgmv as sg
from mmlora.backends.triton_common import ShrinkJob
from mmlora.bench.kernels import _Point, _time_calls, _copy_bandwidth
dev = torch.device("cuda")
bw = _copy_bandwidth(dev)
print(f"copy {bw:.0f} GB/s", flush=True)
def pt(proj, in_f, widths, T, phase, pop, rank=16):
    return _Point(proj, in_f, widths, rank, phase, T, pop, torch.bfloat16, dev, 512, 0)
def timeit(p, mod):
    n = len(p.offsets) - 1; R = p.B.shape[2]
    if mod is bg:
        sh = lambda k: bg._shrink_partials(ShrinkJob(p.x, p.A, p.infos[k], n, R, True, None), zero=False)
        ex = lambda k, h: bg._expand(h, p.B, p.scalings, p.infos[k], p.out, p.offsets, R, p.x.dtype)
    else:
        sh = lambda k: sg._shrink_planes(ShrinkJob(p.x, p.A, p.infos[k], n, R, True, None))
        ex = lambda k, h: sg._expand_planes(h, p.B, p.scalings, p.infos[k], p.out, p.offsets, R)
    hs = [sh(k) for k in range(len(p.infos))]
    t_s, _ = _time_calls([lambda k=k: sh(k) for k in range(len(p.infos))], dev)
    t_e, _ = _time_calls([lambda k=k: ex(k, hs[k]) for k in range(len(p.infos))], dev)
    return t_s * 1e6, t_e * 1e6
cases = [("qkv", 4096, (4096, 1024, 1024)), ("down", 14336, (4096,)), ("gate_up", 4096, (14336, 14336))]
for (proj, in_f, widths), T in itertools.product(cases, (32, 256)):
    p = pt(proj, in_f, widths, T, "decode", "distinct")
    for ew, et, waves, msk in ((4, 4096, 4, 16), (2, 4096, 4, 16), (2, 2048, 4, 16), (4, 2048, 4, 16), (1, 1024, 4, 16), (4, 4096, 16, 32), (4, 4096, 16, 64)):
        bg.TUNING.update(expand_warps=ew, expand_tile=et, waves=waves, max_split_k=msk)
        s_, e_ = timeit(p, bg)
        print(f"bgmv {proj:7} T={T:4} ew={ew} et={et:4} waves={waves:2} msk={msk:2}: shrink {s_:6.1f} expand {e_:6.1f} sum {s_+e_:6.1f} us", flush=True)
    del p
bg.TUNING.update(expand_warps=4, expand_tile=4096, waves=4, max_split_k=16)
for (proj, in_f, widths), T in itertools.product(cases, (512, 4096)):
    p = pt(proj, in_f, widths, T, "prefill", "uniform")
    for bm, bn, w in ((32, 256, 4), (32, 512, 4), (32, 512, 8), (16, 256, 4), (16, 512, 4), (64, 512, 8)):
        sg.TUNING.update(block_m=bm, block_n=bn, expand_warps=w)
        s_, e_ = timeit(p, sg)
        print(f"sgmv {proj:7} T={T:4} bm={bm:3} bn={bn:3} w={w}: shrink {s_:6.1f} expand {e_:6.1f} sum {s_+e_:6.1f} us", flush=True)
    del p
