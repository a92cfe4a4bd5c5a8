"""Build the Ray Serve application: N engine replicas behind one adapter-routing ingress.

``python -m mmlora.serve`` calls ``build_application`` from its flags; ``serve run`` (with or without a
config file) calls ``app_builder`` with its ``key=value`` arguments, which take the same names as the
flags (``model=smollm2 num_replicas=2 lora_root=adapters``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmlora.config import (
    ENGINE_SECTIONS,
    EngineConfig,
    _f,
    add_cli_args,
    engine_config_from_cli,
    from_cli_args,
)
from mmlora.server.config import ServerConfig


@dataclass(frozen=True)
class ClusterConfig:
    num_replicas: int = _f(2, "Engine replicas (one GPU each where there are GPUs).")
    routing: str = _f("adapter", 'Replica choice: "adapter" (Ray Serve model multiplexing) or "default".')
    address: str | None = _f(None, "Ray cluster address; none starts a local Ray instance.")
    replica_num_cpus: float = _f(1.0, "CPUs reserved by each replica in Ray.")
    replica_num_gpus: float | None = _f(None, "GPUs per replica (default: 1 on a machine with GPUs, else 0).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mmlora.serve",
        description="Serve mmlora replicas on Ray Serve, routing each request to a replica holding its adapter.",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_cli_args(parser, *ENGINE_SECTIONS, ServerConfig, ClusterConfig)
    return parser


def parse_args(argv: Sequence[str] | None) -> tuple[EngineConfig, ServerConfig, ClusterConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cluster = from_cli_args(args, ClusterConfig)
        if cluster.num_replicas < 1:
            raise ValueError("num_replicas: must be >= 1")
        if cluster.routing not in ("adapter", "default"):
            raise ValueError('routing: must be "adapter" or "default"')
        return engine_config_from_cli(args), from_cli_args(args, ServerConfig), cluster
    except (ValueError, TypeError) as e:
        parser.error(str(e))
        raise


def build_application(engine: EngineConfig, server: ServerConfig, cluster: ClusterConfig) -> Any:
    """The Ray Serve application (not yet running): replicas plus the ingress."""
    from mmlora.serve.ingress import Ingress
    from mmlora.serve.replica import replica_deployment

    num_gpus = cluster.replica_num_gpus
    if num_gpus is None:
        num_gpus = 1.0 if engine.model.device in ("auto", "cuda") and _has_cuda() else 0.0
    max_adapters = engine.lora.max_loaded_loras or 1024
    replica = replica_deployment(max_adapters, cluster.num_replicas, cluster.replica_num_cpus, num_gpus)
    from ray import serve

    ingress = serve.deployment(Ingress, name="mmlora-ingress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(engine, server, server.lora_root), routing=cluster.routing)


def app_builder(args: dict[str, Any]) -> Any:
    """For ``serve run mmlora.serve.app:app_builder model=... num_replicas=2 lora_root=...``."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            if str(value).lower() == "true":
                argv.append(flag)
        else:
            argv += [flag, *str(value).split()]
    return build_application(*parse_args(argv))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
