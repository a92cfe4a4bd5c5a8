"""One-off GPU sweep of launch heuristics (not committed): times shrink and expand separately."""
import itertools, json, os
import torch
from mmlora.backends import triton_bgmv as bg, triton_sgmv as sg
from mmlora.backends.triton_common import ShrinkJob
from mmlora.bench.kernels import _Point, _time_calls, _copy_bandwidth
dev = torch.device("cuda")
bw = _copy_bandwidth(dev)
print(f"copy {bw:.0f} GB/s", flush=True)
res = []
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
    t_b, _ = _time_calls([lambda k=k: ex(k, sh(k)) for k in range(len(p.infos))], dev)
    return t_s * 1e6, t_e * 1e6, t_b * 1e6
cases = [("qkv", 4096, (4096, 1024, 1024)), ("down", 14336, (4096,)), ("gate_up", 4096, (14336, 14336))]
for (proj, in_f, widths), T in itertools.product(cases, (1, 32, 256)):
    p = pt(proj, in_f, widths, T, "decode", "distinct")
    for ps, msk, st in itertools.product((False, True), (16, 64), (8192, 4096)):
        if T == 1 and (msk, st) != (16, 8192):
            continue
        bg.TUNING.update(expand_per_slice=ps, max_split_k=msk, shrink_tile=st)
        s_, e_, b_ = timeit(p, bg)
        gb = p.bytes / b_ / 1e3
        res.append(dict(k="bgmv", proj=proj, T=T, ps=ps, msk=msk, st=st, shrink=s_, expand=e_, both=b_, frac=gb / bw))
        print(f"bgmv {proj:7} T={T:4} per_slice={ps:d} max_split={msk:2} st={st:5}: shrink {s_:6.1f} expand {e_:6.1f} both {b_:6.1f} us  {100*gb/bw:4.0f}%", flush=True)
    del p
bg.TUNING.update(expand_per_slice=True, max_split_k=16, shrink_tile=8192)
for (proj, in_f, widths), T in itertools.product(cases, (512, 4096)):
    p = pt(proj, in_f, widths, T, "prefill", "uniform")
    g = torch.randn(sum(widths), in_f, device=dev, dtype=torch.bfloat16)
    tg, _ = _time_calls([lambda: torch.nn.functional.linear(p.x, g)], dev)
    for eo, (bm, bn) in itertools.product((False, True), ((32, 128), (64, 128), (64, 256), (32, 256))):
        sg.TUNING.update(block_m=bm, block_n=bn, early_out=eo)
        s_, e_, b_ = timeit(p, sg)
        res.append(dict(k="sgmv", proj=proj, T=T, bm=bm, bn=bn, eo=eo, shrink=s_, expand=e_, both=b_, gemm=tg * 1e6))
        print(f"sgmv {proj:7} T={T:4} early={eo:d} bm={bm:3} bn={bn:3}: shrink {s_:6.1f} expand {e_:6.1f} both {b_:6.1f} us gemm {tg*1e6:6.1f} ratio {b_/(tg*1e6):.3f}", flush=True)
    del p
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "tune.json"), "w"), indent=1)
