"""``python -m mmlora.serve``: start (or join) Ray, deploy the replicas and the ingress, serve until stopped."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence

logger = logging.getLogger("mmlora.serve")


def main(argv: Sequence[str] | None = None) -> int:
    from mmlora.serve.app import build_application, parse_args

    engine, server, cluster = parse_args(argv)
    from mmlora.preflight import check_engine_config, exit_on_config_error

    exit_on_config_error(check_engine_config, engine)  # before Ray starts replicas that load weights
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import ray
        from ray import serve
    except ImportError:
        logger.error("Ray Serve is not installed: pip install 'mmlora[ray]'")
        return 2
    ray.init(address=cluster.address, include_dashboard=False)  # address None: a local Ray instance
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(build_application(engine, server, cluster), name="mmlora", route_prefix="/")
    logger.info(
        "serving %s on %d replica(s) at http://%s:%d (routing: %s)",
        engine.model.model,
        cluster.num_replicas,
        server.host,
        server.port,
        cluster.routing,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
