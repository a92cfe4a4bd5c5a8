"""The options of ``python -m mmlora.bench serving`` (:mod:`mmlora.bench.serving`), parsed and checked
before anything is built."""

from __future__ import annotations

import argparse

from mmlora.bench import serving_tenants
from mmlora.bench.cli import check_engine_options, make_parser


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The options of ``python -m mmlora.bench serving``, checked (a ValueError names the bad one)."""
    p = make_parser("python -m mmlora.bench serving", description)
    p.add_argument(
        "--workload",
        choices=["standard", "shared-prefix", "two-tenants"],
        default="standard",
        help="shared-prefix: the prefix cache on against off (mmlora.bench.serving_prefix); two-tenants: "
        "a heavy adapter at --heavy-load x capacity and 7 light ones at capacity/10, fcfs against vtc "
        "(mmlora.bench.serving_tenants; --num-requests, --rate and --arrival do not apply)",
    )
    p.add_argument(
        "--shared-prefix",
        type=int,
        nargs=3,
        default=[1024, 64, 128],
        metavar=("SYSTEM", "USER", "OUTPUT"),
        help="shared-prefix workload: system prompt tokens per adapter, user-turn tokens in, tokens out",
    )
    serving_tenants.add_arguments(p)
    p.add_argument(
        "--prefix-workloads",
        nargs="+",
        choices=["shared-prefix", "no-sharing"],
        default=["shared-prefix", "no-sharing"],
        help="shared-prefix workload: which workloads run the cache on against off",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="shared-prefix workload: timed on/off pairs per workload, the order alternating",
    )
    p.add_argument("--model", default="dummy:mistral-7b-v0.3")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--num-adapters", type=int, nargs="+", default=[1, 8, 32, 128, 1000])
    p.add_argument("--ranks", type=int, nargs="+", default=[16], help="adapter ranks, cycled over adapters")
    p.add_argument(
        "--rank-mixes",
        type=rank_mix,
        nargs="+",
        default=None,
        help="a sweep over rank mixes, each comma-separated (e.g. 8 16 64 8,64): every --num-adapters point "
        "runs once per mix, one plot line each (overrides --ranks)",
    )
    p.add_argument(
        "--pool-rank",
        type=int,
        default=None,
        help="max_lora_rank of the engine: the rank its adapter slots hold (default: the largest rank run)",
    )
    p.add_argument(
        "--lora-page-rank",
        type=int,
        default=None,
        help="lora_page_rank of the engine: ranks per page of a slot (default: the engine's, 16 on CUDA for pool "
        "ranks of 32, 64, 128 ..., else unpaged; the pool rank: unpaged)",
    )
    p.add_argument(
        "--sweep-rounds",
        type=int,
        default=1,
        help="standard workload: run the base-only point and every mix point this many times, in turn; each "
        "ratio is against the base-only run of its own round",
    )
    p.add_argument("--popularity", choices=["uniform", "zipf", "distinct"], default="uniform")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--arrival", choices=["poisson", "all"], default="all")
    p.add_argument("--rate", type=float, default=64.0, help="requests/s for Poisson arrivals")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--input-len", type=int, nargs=2, default=[8, 512], metavar=("LO", "HI"), help="[LO, HI)")
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 512], metavar=("LO", "HI"), help="[LO, HI)")
    p.add_argument("--max-loras-per-batch", type=int, default=128)
    p.add_argument("--max-running-requests", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--lora-backend",
        default="auto",
        help="auto: the engine's choice (triton-auto on CUDA: SGMV prefill, BGMV decode; torch-gather on CPU)",
    )
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument(
        "--weight-layout",
        choices=("row-major", "column-major"),
        default="row-major",
        help="the base linears' weight layout on CUDA (the engine's weight_layout; column-major: an experiment)",
    )
    p.add_argument(
        "--disable-mixed-cuda-graph",
        action="store_true",
        help="run prefill and mixed steps eagerly (default: replayed from CUDA graphs per token bucket, "
        "mmlora.engine.mixed_graph)",
    )
    p.add_argument(  # the opt-in spelling of sessions 24-26's scripts
        "--enable-mixed-cuda-graph",
        dest="disable_mixed_cuda_graph",
        action="store_false",
        help="inverse of --disable-mixed-cuda-graph (the default)",
    )
    p.add_argument(
        "--disable-async-uploads",
        action="store_true",
        help="load adapters into slots on the main stream, the step waiting (default: beside the forwards)",
    )
    p.add_argument(
        "--overlap-schedule",
        choices=("auto", "on", "off"),
        default="auto",
        help="launch step N+1 before reading step N's tokens back (auto: on CUDA at tp-size 1)",
    )
    p.add_argument(
        "--disable-lora-overlap",
        action="store_true",
        help="run each LoRA shrink after its base GEMM on one stream (default: beside it, on a second stream)",
    )
    p.add_argument(
        "--lora-side-max-tokens",
        type=int,
        default=None,
        help="batches of at most this many tokens run each module's whole LoRA beside its base GEMM "
        "(default: the engine's lora_side_max_tokens; 0: only the shrink)",
    )
    p.add_argument(
        "--lora-stage-slots",
        type=int,
        default=None,
        help="the engine's lora_stage_slots: decode graphs of at most this many adapters take the LoRA "
        "shrink from the base GEMM (mmlora.lora.stage; 0: off; default: the engine's, auto)",
    )
    p.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel ranks (GPUs 0..N-1); the bench itself runs on rank 0",
    )
    p.add_argument("--hf-batch", type=int, default=32, help="HF + PEFT subset: requests (0 skips it)")
    p.add_argument("--hf-tokens", type=int, default=64)
    p.add_argument("--hf-adapters", type=int, default=8)
    p.add_argument(
        "--micro-batch",
        type=int,
        nargs="*",
        default=[32, 128],
        help="decode-step microbench batch sizes (the bare flag: none, skip it)",
    )
    p.add_argument("--micro-context", type=int, default=768)
    p.add_argument("--micro-rank", type=int, default=16)
    p.add_argument(
        "--micro-adapters",
        type=int,
        default=None,
        help="adapters the decode-step microbench's B requests cycle over (default: one per request); "
        "with fewer, rows share adapters, and each captured graph layout (rows / runs) is timed",
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer points and requests (fits 8 minutes on one H200)"
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; sweep points starting past 60%% of it are skipped",
    )
    p.add_argument(
        "--allow-compiles",
        action="store_true",
        help="report Triton compiles inside timed runs instead of failing on them",
    )
    p.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave start-up objects in Python's collector (the server freezes them after start-up)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapter-dir", default=None, help="where random adapters go (default: a temp folder)")
    p.add_argument("--out", default="bench-serving")
    args = p.parse_args(argv)
    if args.quick:
        args.num_adapters = [n for n in args.num_adapters if n <= 128] or args.num_adapters[:1]
        args.num_requests = min(args.num_requests, 192)
        args.time_budget = args.time_budget or 300.0
    for name in (
        "num_requests",
        "max_loras_per_batch",
        "max_running_requests",
        "hf_tokens",
        "micro_context",
        "repeats",
        "sweep_rounds",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.micro_adapters is not None and args.micro_adapters < 1:
        raise ValueError("--micro-adapters: must be >= 1")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo < hi:
            raise ValueError(f"--{name.replace('_', '-')}: need 1 <= LO < HI, got {lo} {hi}")
    args.mixes = args.rank_mixes or [list(args.ranks)]
    if any(n < 1 for n in args.num_adapters) or any(r < 1 for mix in args.mixes for r in mix):
        raise ValueError("--num-adapters, --ranks and --rank-mixes: must be >= 1")
    top = max([r for mix in args.mixes for r in mix] + ([args.micro_rank] if args.micro_batch else []))
    if args.pool_rank is not None and args.pool_rank < top:
        raise ValueError(f"--pool-rank {args.pool_rank}: must hold the largest rank run ({top})")
    if args.input_len[1] + args.output_len[1] > args.max_model_len:
        raise ValueError("--max-model-len: must cover the longest input + output")
    check_engine_options(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        lora_backend=args.lora_backend,
        lora_stage_slots=args.lora_stage_slots,
    )
    if args.workload == "two-tenants" and not (
        args.heavy_load > 0 and args.duration > 0 and args.rounds >= 1
    ):
        raise ValueError("--heavy-load and --duration: must be > 0; --rounds: must be >= 1")
    if args.workload == "shared-prefix" and (
        min(args.shared_prefix) < 1 or sum(args.shared_prefix) > args.max_model_len
    ):
        raise ValueError("--shared-prefix: each length must be >= 1 and their sum fit in --max-model-len")
    return args


def rank_mix(text: str) -> list[int]:
    try:
        return [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rank mix is comma-separated integers, got {text!r}") from None


def mix_label(mix: list[int]) -> str:
    return ",".join(map(str, mix))
