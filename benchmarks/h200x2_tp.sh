#!/usr/bin/env bash
# Issue 18 (TP on two H200s), one call on the nvidia-h200-x2 machine: committed by issue 17, not yet run.
# Usage: bash benchmarks/h200x2_tp.sh OUT_DIR
#  1. CUDA tests at tp=2: the tiny-model tests of tests/distributed through NCCL on GPUs 0 and 1, then the
#     7B dummy presets in bf16, tp=2 against tp=1 over 16 greedy tokens.
#  2. Serving: mmlora.bench serving at --tp-size 2 (both GPUs) and at tp=1 (GPU 0), same workload.
#  3. Decode-step profile at tp=2: the all-reduce share and the LoRA kernels' share (torch.profiler).
# Decode steps replay CUDA graphs captured on both ranks (issue 17); --disable-cuda-graph would run them eagerly.
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpus.txt" 2>&1

MMLORA_TP_TEST_DEVICE=cuda timeout 300 python -m pytest -q -p no:cacheprovider tests/distributed \
  > "$out/tests_cuda.log" 2>&1
echo "tests rc=$?"

timeout 400 python - > "$out/dummy_7b_match.log" 2>&1 <<'PY'
import mmlora, torch
prompts = [[(7 * i + 3 * j) % 30000 + 10 for j in range(40 + 8 * i)] for i in range(4)]
for preset in ("mistral-7b-v0.3", "gemma2-9b"):
    outs = {}
    for tp in (1, 2):
        e = mmlora.Engine(model=f"dummy:{preset}", dtype="bfloat16", tp_size=tp, max_model_len=512)
        outs[tp] = e.generate(input_ids=prompts, return_logprob=True,
                              sampling_params={"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})
        e.shutdown(); del e; torch.cuda.empty_cache()
    for a, b in zip(outs[1], outs[2]):
        same = sum(x == y for x, y in zip(a.output_ids, b.output_ids))
        diff = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
        print(f"{preset}: {same}/16 tokens equal, first-token logprob diff {abs(a.logprobs[0] - b.logprobs[0]):.3e}, max {diff:.3e}")
PY
echo "dummy 7b rc=$?"

for tp in 2 1; do
  CUDA_VISIBLE_DEVICES=$([ $tp = 2 ] && echo 0,1 || echo 0) timeout 420 python -m mmlora.bench serving \
    --tp-size $tp --model dummy:mistral-7b-v0.3 --num-adapters 32 1000 --num-requests 192 \
    --hf-batch 0 --micro-batch --time-budget 360 --out "$out/mistral_tp$tp" > "$out/mistral_tp$tp.log" 2>&1
  echo "mistral tp=$tp rc=$?"
  CUDA_VISIBLE_DEVICES=$([ $tp = 2 ] && echo 0,1 || echo 0) timeout 300 python -m mmlora.bench serving \
    --tp-size $tp --model dummy:gemma2-9b --num-adapters 32 --num-requests 192 \
    --hf-batch 0 --micro-batch --out "$out/gemma2_tp$tp" > "$out/gemma2_tp$tp.log" 2>&1
  echo "gemma2 tp=$tp rc=$?"
done

timeout 300 python - > "$out/profile_tp2.log" 2>&1 <<'PY'
import tempfile
import mmlora, torch
from torch.profiler import ProfilerActivity, profile
from mmlora.bench.adapters import write_random_adapters
e = mmlora.Engine(model="dummy:mistral-7b-v0.3", dtype="bfloat16", tp_size=2, max_model_len=1024,
                  max_loras_per_batch=32, max_lora_rank=16)
prompts = [[(5 * i + j) % 30000 + 10 for j in range(256)] for i in range(32)]
sp = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
adapters = write_random_adapters(e.hf_config, tempfile.mkdtemp(), 32, [16], dtype=torch.bfloat16)
for a in adapters:
    e.load_lora(a["name"], a["path"])
names = [a["name"] for a in adapters]
e.generate(input_ids=prompts, lora_paths=names, sampling_params=sp)  # warm-up (Triton compiles)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # rank 0's view
    e.generate(input_ids=prompts, lora_paths=names, sampling_params=sp)
events = prof.key_averages()
def share(*words):
    t = sum(ev.self_device_time_total for ev in events if any(w in ev.key.lower() for w in words))
    return t / max(1, sum(ev.self_device_time_total for ev in events))
print(f"all-reduce share of device time: {share('allreduce', 'all_reduce', 'nccl'):.3f}")
print(f"LoRA kernels' share of device time: {share('sgmv', 'bgmv', 'lora'):.3f}")
print(events.table(sort_by="self_device_time_total", row_limit=25))
e.shutdown()
PY
echo "profile rc=$?"
