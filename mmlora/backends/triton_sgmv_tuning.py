"""The SGMV backend's launch heuristics (:mod:`mmlora.backends.triton_sgmv` re-exports ``TUNING``): read at
every launch, so a benchmark can sweep them; each with the measurement that chose it."""

#: Launch heuristics (read at every launch, so a benchmark can sweep them): the largest token tile of
#: shrink and of expand, expand's column tile, warps per program (expand: ``run_expand_warps`` for
#: 16-token tiles, i.e. batches whose segments are decode runs), the most splits of in_features, and how
#: many programs per SM shrink aims for. Chosen on an H200 (bf16, rank 16, Mistral-7B shapes,
#: ``benchmarks/scripts/lora_tuning_sweep.py``, 2026-12-02, in ``benchmarks/results/``): shrink at 32
#: tokens and 2 waves made a 4096-token prefill over 8 adapters 0.885x as long (411 -> 364 us summed
#: over the four projections) and a mixed step 0.935x; 2 warps for 16-token expand tiles made decode
#: graphs' runs 0.94-0.99x then (4 since 2026-12-05, see below); 64-token and 512-column expand tiles
#: were no faster.
TUNING = {
    "shrink_block_m": 32,
    "block_m": 32,
    "block_n": 256,
    "shrink_warps": 4,
    "expand_warps": 4,
    # 4 warps for 16-token expand tiles (decode runs): H200, decode runs of rank-16 adapters at serving's
    # composition (B=72 on 24 and 6 adapters, B=128 and 256 on 32) and rank-64 adapters in the paged pool,
    # benchmarks/scripts/decode_lora_anatomy.py, 2026-12-05, two rounds in each of two calls: 0.92-0.98x
    # the time of 2 warps at every point (B=72 on 24 adapters 54.6 -> 52.9 us, rank 64 120.0 -> 111.0);
    # 8 warps 0.91-1.08x. (2 was chosen on 2026-12-02, when a program took one column tile.)
    "run_expand_warps": 4,
    # Ranks per step of the expand's loop, capped by the batch's rank bucket (a power of two >= 16):
    # ``run_expand_rank_step`` for 16-token tiles (decode runs), ``expand_rank_step`` for the rest. Loads
    # stop at the slot's rank either way, so a step reads no more bytes, in fewer dependent steps. H200,
    # rank-64 pool (benchmarks/scripts/decode_lora_anatomy.py, 2026-12-03, two rounds; 16 before): decode
    # runs B=128 321 -> 206 us with 32 (234 with 64), mixed step 1632 -> 904 us with 64 (1071 with 32),
    # 4096-token prefill 1237 -> 702 us with 64. A decode-run step of 64 (which lets the column-tile groups
    # apply in a rank-64 bucket) was slower on an H100 (session 39, g/): all modules' LoRA per layer at B=72
    # on 24 adapters 129.2 -> 133.6 us for rank 64 and 93.1 -> 101.6 us for {8, 64}; at B=128 on 32,
    # 166.3 -> 166.5 and 120.0 -> 126.6 us.
    "expand_rank_step": 64,
    "run_expand_rank_step": 32,
    "max_split_k": 16,
    "waves": 2,
    # Shrinks over 16-token tiles (decode runs, as decode graphs replay them): in_features per step of
    # the loop, and waves aimed for; None: as above (128; ``waves``). Not yet swept on a GPU: session 8's
    # one-knob sweep (waves 1-16 for all shrinks) had the runs layout 80.7-90.8 us with waves=4 best and
    # never varied the step, and decode runs take about 2.6x their bytes floor (session 17), down's shrink
    # 13 us against about 4.
    "run_shrink_block_k": None,
    "run_waves": None,
    # ... and the most in_features one of their splits covers (None: no cap; splits stay within
    # ``max_split_k``). The waves rule gives every module of a step the same split count, so each program of
    # down's shrink (14,336 in_features) streams 3.5x the serial loop of the others' (4,096): at serving's
    # decode runs (B=72 on 24 adapters, 36 graph segments: 8 splits) that shrink took 9.3 us against 4.4-6.2
    # for the other three, for about 3 us of bytes (H200, session 27 c2). 512 would split down's 16 ways (at
    # most 16 of h's planes, all summed in one round with ``run_expand_h_unroll`` 16) and leave the others at
    # 8. H100 (session 31, decode graphs B=72 and 128 on 24 adapters, two rounds): 0.97-1.02x the replay,
    # within the card's 6-9% drift between rounds, other tokens (another order of sums); so off.
    "run_shrink_k_per_split": None,
    # ... and the software pipeline's depth of their in_features loop (None: Triton's default): few programs
    # each stream a long loop there, so loads in flight per program bound the bandwidth.
    "run_shrink_stages": None,
    # Expands over 16-token tiles load their out tile and scaling before the rank loop (EARLY_OUT), in
    # flight with the B tile: a small expand is a chain of dependent loads (segment, slot, rank, B, h, out)
    # and takes about 5 us whatever its bytes (o's: 5.0 us for 6 MB, session 17). Off: not yet timed.
    "run_expand_early_out": False,
    # Expands over 16-token tiles with column tiles grouped by this many per program (None or 1: one tile
    # a program), where the batch's rank bucket fits one ``run_expand_rank_step``: h and the scaling are
    # loaded once and B / out streamed through a loop ``run_expand_group_stages`` deep. H200, decode runs
    # of rank-16 adapters in the default pool (benchmarks/scripts/decode_lora_anatomy.py, 2026-12-03, two
    # rounds, four cases): groups of 2 0.93-0.97x as long as none (B=128 on 31 runs 65.5 -> 63.2 us, B=256
    # on 128 runs 91.3 -> 84.9 us), 4 1.0-1.08x (gate_up's expand faster, o's and down's slower: fewer
    # programs), 8 and 16 1.13-1.8x; in serving (32 adapters, two rounds) the decode graphs' GPU span
    # 4.98 -> 4.88 s against base-only's 3.9 s.
    "run_expand_group": 2,
    "run_expand_group_stages": 2,
    # ... or, where set (and ``run_expand_group`` > 1), per launch the largest group of 4, 2 and 1 whose launch
    # still has this many programs: the wide gate_up (28,672 columns) in bigger groups, the narrow o and down
    # in smaller, and smaller ones as the batch's segment entries fall. One group for every module lost
    # somewhere: at 1, gate_up's expand ran 1.2-1.3x as long; at 4, o's, down's and qkv's 1.2-1.35x (H100,
    # session 34 c1, decode runs at B=72 on 24 adapters and B=128 on 32, segment entries B // 2). 1000 gives
    # each kernel its best group at both points: gate_up 4, qkv 1 at B=72 and 2 at B=128, o and down 1. With
    # 800 (the same but qkv 2 at B=72) the LoRA kernels took 0.95-0.96x the time of groups of 2 at both points,
    # both rounds; with 1000, real decode graphs 0.986-0.997x at B=72 and 0.977-1.0004x at B=128 (two
    # rounds each, same bits), and in issue 13's serving run the decode graphs' GPU span 0.98-1.0x (H100,
    # session 34 c2; benchmarks/results/h100-2026-12-05-session34).
    "run_expand_group_programs": 1000,
    # ... and such a program loads its first tile's B before it waits for the shrink (as an ungrouped
    # program does; PDL) and its out tile right after, both before h, not after h's loads. Timed only with
    # the other three opt-ins (H100, session 31: all four 0.97-1.04x the replay, no win); so off.
    "run_expand_group_b_first": False,
    # Expands over 16-token tiles sum up to this many of the shrink's split-K planes of h with unrolled
    # loads, all in flight together (None: a loop that waits for each plane before it loads the next). A
    # decode run's shrink makes about 8 planes (serving's B=72 on 24 adapters); ptxas unrolls the loop by
    # four, so its expand still waits for about five dependent rounds of L2 reads before its dot product
    # (SASS, benchmarks/results/cpu-2026-12-05-session28). The fused activation has summed its planes
    # unrolled since 2026-12-04. Same sums in the same order. H100 (session 31, decode graphs B=72 and 128
    # on 24 adapters, two rounds): 0.97-1.02x the replay, within the card's 6-9% drift between rounds, same
    # bits; no win in both rounds at both batches, so off. Not yet timed on the H200.
    "run_expand_h_unroll": None,
    # Batches of at least this many tokens run the shrink on the side stream beside the base GEMM
    # (``splits_work``); None: never. H200, prefill forwards of 1024-2048 tokens over 32 rank-16 adapters
    # (benchmarks/scripts/lora_prefill_side_ab.py, 2026-12-03, three rounds): 1.00-1.03x the GPU time of
    # one stream at 512, same bits; so off.
    "side_min_tokens": None,
    # The expand as a programmatic dependent launch of its shrink (Hopper+). H200, decode graphs on 32
    # rank-16 adapters (benchmarks/scripts/lora_pdl_ab.py, 2026-12-03, two rounds): B=64 and 128 (SGMV
    # runs) 0.95-0.97x the replay time, B=32 (BGMV, side-stream split: unchanged) 0.99-1.0x; same tokens.
    "pdl": True,
    # ... and the shrink of ``add_lora_after_base`` a dependent of the base GEMM (needs ``pdl``; not with
    # ``run_expand_early_out``). H100 (session 31, decode graphs on 24 adapters, two rounds): B=128
    # 1.03-1.08x the replay (slower), B=72 0.96-1.0x; same bits. Off. Not yet timed on the H200.
    "shrink_pdl": False,
    # gate_up's expand deferred into the gated activation (``defer_lora``: one read of gate_up's output
    # and no write, one launch fewer; :mod:`mmlora.backends.triton_sgmv_act`). False: the plain expand.
    "act_expand": True,
    # The kernels that read a module's output after its expand (RoPE after qkv's, the add + RMSNorm after o's
    # and down's, the gated activation after gate_up's) as programmatic dependent launches (Hopper+): each
    # expand lets the next kernel launch at its start (``gdc_launch_dependents``), and that kernel waits for
    # it (``gdc_wait``) before it reads anything, so its launch and ramp overlap the expand's last wave
    # instead of following it. Read by :mod:`mmlora.layers.fused_ops` and :mod:`mmlora.layers.rotary_ops`
    # for every launch of those ops. H100, session 35 (benchmarks/results/h100-2026-12-05-session35): real
    # decode graphs 0.980-0.998x at B=72 and B=128 in both rounds, tokens and logprobs bit-equal; issue
    # 13's serving ratios 0.005-0.008 higher. Not yet timed on an H200.
    "expand_dependents": True,
}
