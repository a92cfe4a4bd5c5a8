"""One GPU, issue 17: mmlora's ``all_reduce`` through NCCL, eager (the bounded wait) and captured in a CUDA
graph (enqueued only), then replayed with new inputs. No second GPU is lent, so the process group has one
rank and the TP group is marked parallel so that the collective is issued (one term: the sum is the input).
It checks that the capture path neither hangs nor fails on this torch and NCCL, and that replays see new
inputs. Usage: python benchmarks/scripts/nccl_graph_smoke.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmlora.distributed import state


def main() -> None:
    device = torch.device("cuda:0")
    port = state.free_port()
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device
    )
    state._GROUP = state.TPGroup(0, 2, 30.0)  # a parallel group for the helpers; NCCL's world is 1
    x = torch.arange(8, device=device, dtype=torch.float32)
    state.all_reduce(x)
    torch.cuda.synchronize()
    assert torch.equal(x, torch.arange(8, device=device, dtype=torch.float32)), x
    print("eager all_reduce (bounded wait): ok")

    static = torch.zeros(8, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            state.all_reduce(static * 2)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static * 2
        state.all_reduce(out)
        out = out + 1
    for value in (1.0, 3.0, -2.5):
        static.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, 2 * value + 1)), (value, out)
    print("all_reduce captured in a CUDA graph, 3 replays: ok")
    state.all_reduce(x)  # an eager collective after the replays still completes
    torch.cuda.synchronize()
    print("eager all_reduce after replays: ok")
    state.shutdown_tp()


if __name__ == "__main__":
    main()
