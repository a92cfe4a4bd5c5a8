"""Fused ops (:mod:`mmlora.layers.fused_ops`): the Triton kernels against a float64 oracle and against the
torch reference (the models' arithmetic before the kernels), plus the dispatch and the module wiring.

On CPU the kernels run under TRITON_INTERPRET=1 (called directly, not through the CPU dispatch) at tiny
odd shapes. The interpreter casts fp32 -> bf16 by truncation where a GPU rounds to nearest, so bf16 is
checked to within an ulp of the reference there; fp16 and fp32 rotary must match bit for bit. The
``gpu`` cases run at Llama-7B shapes, inside a CUDA graph too, and require bit-exact bf16 rotary.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first triton import of the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from mmlora.layers import fused_ops as F  # noqa: E402
from mmlora.layers import rotary_ops as R  # noqa: E402
from mmlora.layers.norms import RMSNorm  # noqa: E402
from mmlora.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Spacing of the dtype's floats relative to a value (an upper bound on one rounding, either mode).
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed), dtype=torch.float64) * scale).to(dtype).to(DEV)


def assert_within(out: torch.Tensor, exact: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """Every element of ``out`` within ``tol`` (elementwise) of ``exact``."""
    err = (out.double() - exact.double()).abs()
    bad = err > tol
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off, worst {float((err - tol).max()):.3g} past tol"
    )


# ---- RMSNorm ----------------------------------------------------------------------------------------


def norm_oracle(s: torch.Tensor, w: torch.Tensor, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 RMSNorm of the (already residual-added) rows s: (exact, elementwise tolerance)."""
    sd = s.double()
    xn = sd / torch.sqrt(sd.pow(2).mean(-1, keepdim=True) + EPS)
    exact = xn * (offset + w.double())
    # Llama rounds xn, then the product (2 roundings); Gemma only the product. fp32 statistics add a little.
    roundings = 1 if offset else 2
    tol = (roundings * ULP[s.dtype] + 4e-6) * exact.abs() + 1e-6
    return exact, tol


def check_norm(x, w, offset, residual, out, ref) -> None:  # noqa: ANN001
    y, s = out if residual is not None else (out, x)
    if residual is not None:
        exact_s = x.double() + residual.double()
        assert_within(s, exact_s, ULP[x.dtype] * exact_s.abs(), "s = x + residual")
        y_ref, s_ref = ref
        assert_within(s, s_ref, ULP[x.dtype] * s_ref.double().abs(), "s vs torch")
    else:
        y_ref = ref
    assert y.dtype == y_ref.dtype and y.shape == x.shape
    exact, tol = norm_oracle(s, w, offset)
    assert_within(y, exact, tol, "y vs fp64")
    # Each side is within ~2 roundings of exact (3 under the interpreter's truncating bf16 casts).
    assert_within(y, y_ref, (4 * ULP[y.dtype] + 4e-6) * y_ref.double().abs() + 1e-6, "y vs torch")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("T,hidden,block", [(1, 96, None), (7, 200, None), (7, 200, 64)])
def test_rms_norm_kernel(dtype, offset, with_residual, T, hidden, block) -> None:  # noqa: ANN001
    x = randn(T, hidden, dtype=dtype, seed=1, scale=3.0)
    w = randn(hidden, dtype=dtype, seed=2, scale=0.5)
    residual = randn(T, hidden, dtype=dtype, seed=3) if with_residual else None
    out = F.rms_norm_triton(x, w, EPS, offset, residual, block=block)
    check_norm(x, w, offset, residual, out, F.rms_norm_ref(x, w, EPS, offset, residual))


def test_rms_norm_kernel_fp32_weight_promotes() -> None:
    """Llama with an fp32 weight on bf16 activations: torch promotes the product to fp32; so does the kernel."""
    x = randn(3, 96, dtype=torch.bfloat16, seed=4)
    w = randn(96, dtype=torch.float32, seed=5)
    out = F.rms_norm_triton(x, w, EPS)
    ref = F.rms_norm_ref(x, w, EPS)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=2 * ULP[torch.bfloat16])


def test_rms_norm_kernel_3d_and_strided_rows() -> None:
    base = randn(2, 3, 128, dtype=torch.float16, seed=6)
    x = base[..., :96]  # rows with a stride of 128
    w = randn(96, dtype=torch.float16, seed=7)
    r = randn(2, 3, 96, dtype=torch.float16, seed=8)
    y, s = F.rms_norm_triton(x, w, EPS, 0.0, r)
    y_ref, s_ref = F.rms_norm_ref(x, w, EPS, 0.0, r)
    assert y.shape == s.shape == x.shape
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-3, rtol=2 * ULP[torch.float16])


# ---- gated activations ------------------------------------------------------------------------------


def act_oracle(gate: torch.Tensor, act: str) -> torch.Tensor:
    g = gate.double()
    if act == "silu":
        return g / (1 + torch.exp(-g))
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


ACTS = {
    "silu": (F.silu_and_mul_triton, F.silu_and_mul_ref),
    "gelu": (F.gelu_tanh_and_mul_triton, F.gelu_tanh_and_mul_ref),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(large) = inf
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("T,inter,block", [(1, 96, None), (7, 200, None), (7, 200, 64)])
def test_act_and_mul_kernel(dtype, act, T, inter, block, monkeypatch) -> None:  # noqa: ANN001
    if block:
        monkeypatch.setitem(F.TUNING, "act_block", block)
    gate_up = randn(T, 2 * inter, dtype=dtype, seed=10, scale=4.0)
    triton_fn, ref_fn = ACTS[act]
    out = triton_fn(gate_up)
    ref = ref_fn(gate_up)
    assert out.shape == ref.shape == (T, inter) and out.dtype == dtype
    check_act(gate_up, act, out, ref)


def check_act(gate_up: torch.Tensor, act: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    inter = gate_up.shape[-1] // 2
    up = gate_up[:, inter:].double()
    exact = act_oracle(gate_up[:, :inter], act) * up
    # act rounded, then the product rounded; fp32 exp adds a little. Near 0, act's rounding step (fp16
    # subnormals) is absolute and scaled by |up|.
    atol = 1e-6 * (1 + up.abs())
    assert_within(out, exact, (2 * ULP[out.dtype] + 2e-5) * exact.abs() + atol, f"{act} vs fp64")
    assert_within(out, ref, (2 * ULP[out.dtype] + 2e-5) * ref.double().abs() + atol, f"{act} vs torch")


# ---- rotary -----------------------------------------------------------------------------------------


def packed_qk(T: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype, seed: int):  # noqa: ANN201
    """q [T, Hq, D] and k [T, Hkv, D] as non-contiguous views of a packed qkv output, and cos/sin [T, D]."""
    qkv = randn(T, (Hq + 2 * Hkv) * D, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    angles = torch.rand(T, D // 2, generator=gen(seed + 1), dtype=torch.float64) * 100
    emb = torch.cat((angles, angles), dim=-1)
    return q.view(T, Hq, D), k.view(T, Hkv, D), emb.cos().to(dtype).to(DEV), emb.sin().to(dtype).to(DEV)


def rotary_oracle(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 rotary of x [T, H, D]: (exact, tolerance of two rounded products and a rounded sum)."""
    xd, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
    rot = R.rotate_half(xd)
    exact = xd * c + rot * s
    tol = 2 * ULP[x.dtype] * ((xd * c).abs() + (rot * s).abs()) + 1e-12
    return exact, tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T,Hq,Hkv,tile", [(1, 4, 2, None), (7, 3, 1, None), (7, 6, 2, 64)])
def test_rotary_kernel(dtype, D, T, Hq, Hkv, tile, monkeypatch) -> None:  # noqa: ANN001
    if tile:  # several head blocks per q and k
        monkeypatch.setitem(R.TUNING, "rope_tile", tile)
    q, k, cos, sin = packed_qk(T, Hq, Hkv, D, dtype, seed=20)
    assert T == 1 or q.stride(0) == k.stride(0) == (Hq + 2 * Hkv) * D  # views into the packed rows
    qo, ko = R.apply_rotary_triton(q, k, cos, sin)
    q_ref, k_ref = R.apply_rotary_ref(q, k, cos, sin)
    for name, out, ref, x in (("q", qo, q_ref, q), ("k", ko, k_ref, k)):
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
        exact, tol = rotary_oracle(x, cos, sin)
        assert_within(out, exact, tol, f"{name} vs fp64")
        if dtype == torch.bfloat16 and INTERPRETED:
            assert_within(out, ref, tol, f"{name} vs torch")  # the interpreter truncates to bf16
        else:
            assert torch.equal(out, ref), f"{name}: not bit-identical to torch ({dtype})"


# ---- dispatch, checks, modules ----------------------------------------------------------------------


def test_dispatch_on_cpu_is_the_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch references, bit for bit; silu_and_mul takes the C kernel where built (fp32 within a few ulp
    of torch's: another expf; bf16 bit for bit, tested with the kernel) and the reference when they are off."""
    from mmlora.backends import cpu_kernels

    x, r = torch.randn(5, 96), torch.randn(5, 96)
    w = torch.randn(96)
    for offset in (0.0, 1.0):
        assert torch.equal(F.rms_norm(x, w, EPS, offset), F.rms_norm_ref(x, w, EPS, offset))
        for a, b in zip(F.rms_norm(x, w, EPS, offset, r), F.rms_norm_ref(x, w, EPS, offset, r)):
            assert torch.equal(a, b)
    gu = torch.randn(5, 192)
    torch.testing.assert_close(F.silu_and_mul(gu), F.silu_and_mul_ref(gu), atol=1e-6, rtol=4e-6)
    monkeypatch.setattr(cpu_kernels, "ENABLED", False)
    assert torch.equal(F.silu_and_mul(gu), F.silu_and_mul_ref(gu))
    assert torch.equal(F.gelu_tanh_and_mul(gu), F.gelu_tanh_and_mul_ref(gu))


def test_bad_arguments_raise_value_errors() -> None:
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(ValueError, match="weight shape"):
        F.rms_norm(x, torch.randn(7), EPS)
    with pytest.raises(ValueError, match="residual"):
        F.rms_norm(x, w, EPS, residual=torch.randn(3, 9))
    with pytest.raises(ValueError, match="residual"):
        F.rms_norm(x, w, EPS, residual=torch.randn(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        F.rms_norm_triton(x.double(), w.double(), EPS)
    with pytest.raises(ValueError, match="even"):
        F.silu_and_mul(torch.randn(3, 7))
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    cs = torch.randn(2, 8)
    with pytest.raises(ValueError, match="cos shape"):
        R.apply_rotary(q, k, torch.randn(2, 6), cs)
    with pytest.raises(ValueError, match="one dtype"):
        R.apply_rotary(q, k, cs, cs.half())
    with pytest.raises(ValueError, match="one T and D"):
        R.apply_rotary(q, torch.randn(3, 2, 8), cs, cs)


def test_rmsnorm_module_fused_residual() -> None:
    norm = RMSNorm(96, EPS, offset=1.0)
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(4, 96, dtype=torch.bfloat16), torch.randn(4, 96, dtype=torch.bfloat16)
    y, s = norm(x, r)
    assert torch.equal(s, r + x)
    assert torch.equal(y, norm(r + x))


def test_rotary_gathers_once_per_positions_tensor() -> None:
    rope = RotaryEmbedding(16, 64, RopeConfig(theta=10000.0))
    pos = torch.tensor([0, 5, 63])
    c1, s1 = rope.cos_sin(pos, torch.float32)
    c2, s2 = rope.cos_sin(pos, torch.float32)
    assert c1 is c2 and s1 is s2  # later layers of the same forward reuse the gather
    c3, _ = rope.cos_sin(pos.clone(), torch.float32)  # a new forward's positions: gathered again
    assert c3 is not c1 and torch.equal(c3, c1)
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    qo, ko = rope(pos, q, k)
    assert torch.equal(qo, q * c1[:, None] + R.rotate_half(q) * s1[:, None])
    assert torch.equal(ko, k * c1[:, None] + R.rotate_half(k) * s1[:, None])


def test_llama_layers_share_one_rotary() -> None:
    from mmlora.models.arch_config import ArchConfig
    from mmlora.models.llama import LlamaModel

    cfg = SimpleNamespace(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=EPS, rope_theta=10000.0,
    )  # fmt: skip
    model = LlamaModel(ArchConfig.from_hf(cfg))
    rotaries = {id(layer.self_attn.rotary) for layer in model.layers}
    assert len(rotaries) == 1


# ---- CUDA, real shapes ------------------------------------------------------------------------------


def _dev(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).mul_(scale).to(dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [32, 128])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_gpu_rms_norm_7b(dtype, T, offset) -> None:  # noqa: ANN001
    x, r = _dev(T, 4096, dtype=dtype, seed=1, scale=3.0), _dev(T, 4096, dtype=dtype, seed=2)
    w = _dev(4096, dtype=dtype, seed=3, scale=0.5)
    y, s = F.rms_norm(x, w, EPS, offset, r)
    y_ref, s_ref = F.rms_norm_ref(x, w, EPS, offset, r)
    assert torch.equal(s, s_ref)
    check_norm(x, w, offset, r, (y, s), (y_ref, s_ref))
    if dtype != torch.float32:  # only fp32 reduction-order differences may flip a rounding
        assert (y != y_ref).float().mean().item() < 0.01
    check_norm(x, w, offset, None, F.rms_norm(x, w, EPS, offset), F.rms_norm_ref(x, w, EPS, offset))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [32, 128])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gpu_act_and_mul_7b(dtype, T, act) -> None:  # noqa: ANN001
    gate_up = _dev(T, 2 * 14336, dtype=dtype, seed=4, scale=3.0)
    fn = F.silu_and_mul if act == "silu" else F.gelu_tanh_and_mul
    out, ref = fn(gate_up), ACTS[act][1](gate_up)
    check_act(gate_up, act, out, ref)
    if dtype != torch.float32:
        # torch's GELU forms 1 + tanh(z) in fp32, which cancels for gate < -2 (relative error up to ~1e-5
        # there); ours uses 0.5 (1 + tanh z) = sigmoid(2z), which does not. Both are within the fp64
        # bounds above, but a few % of fp16/bf16 GELU outputs round to the neighbouring value (measured on
        # CPU: 3.4% in fp16); SiLU has no such step and matches torch almost everywhere.
        limit = 0.01 if act == "silu" else 0.08
        assert (out != ref).float().mean().item() < limit


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [32, 128])
def test_gpu_rotary_7b_bit_exact(dtype, T) -> None:  # noqa: ANN001
    qkv = _dev(T, (32 + 2 * 8) * 128, dtype=dtype, seed=5)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k = q.view(T, 32, 128), k.view(T, 8, 128)
    rope = RotaryEmbedding(128, 8192, RopeConfig(theta=500000.0))
    cos, sin = rope.cos_sin(torch.randint(0, 8192, (T,), device="cuda"), dtype)
    for out, ref in zip(R.apply_rotary(q, k, cos, sin), R.apply_rotary_ref(q, k, cos, sin)):
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=2 * ULP[dtype])
        else:
            assert torch.equal(out, ref)


@gpu
def test_gpu_ops_in_cuda_graph() -> None:
    """Captured once, replayed on new inputs: the outputs follow the inputs (no shape- or data-dependent
    host work baked into the graph)."""
    dtype, T = torch.bfloat16, 24
    x, r, w = (
        _dev(T, 4096, dtype=dtype, seed=6),
        _dev(T, 4096, dtype=dtype, seed=7),
        _dev(4096, dtype=dtype, seed=8),
    )
    gate_up = _dev(T, 2 * 1024, dtype=dtype, seed=9)
    q = _dev(T, 32, 128, dtype=dtype, seed=10)
    k = _dev(T, 8, 128, dtype=dtype, seed=11)
    cos, sin = _dev(T, 128, dtype=dtype, seed=12), _dev(T, 128, dtype=dtype, seed=13)

    def step():  # noqa: ANN202
        return (*F.rms_norm(x, w, EPS, 1.0, r), F.silu_and_mul(gate_up), *R.apply_rotary(q, k, cos, sin))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for i, t in enumerate((x, r, gate_up, q, k, cos, sin)):
        t.copy_(_dev(*t.shape, dtype=dtype, seed=100 + i))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, step()):
        assert torch.equal(got, want)
