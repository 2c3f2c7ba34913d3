"""`meshserve webhooks` (also `python -m meshserve.service.webhooks`): a deliverer alone, until SIGINT/SIGTERM.

    meshserve webhooks [--redis-url URL] [--metrics-port N]

For deployments that run the API with `MESHSERVE_WEBHOOK_DELIVER_IN_API=false`, or want deliveries to go on while
the API is down. Every other setting comes from the `MESHSERVE_*` environment, like the API's. Any number may run
beside the API's own deliverers. On SIGTERM it stops claiming and lets the POSTs in flight finish (each bounded
by `webhook_timeout_s`); a deliverer killed outright loses nothing (service/webhooks/queue.py). Imports no JAX.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal


def add_webhooks_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "webhooks", help="deliver webhooks and expire deadlines (beside or instead of the API's)"
    )
    _arguments(p)
    p.set_defaults(func=run_webhooks)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url", default=None, help="default: $MESHSERVE_REDIS_URL or redis://127.0.0.1:6379/0"
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: none)"
    )


def run_webhooks(args: argparse.Namespace) -> int:
    from meshserve.service.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(redis_url=args.redis_url) if args.redis_url else Settings()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    asyncio.run(_serve(settings))
    return 0


async def _serve(settings) -> None:
    from meshserve.service.store import Store
    from meshserve.service.webhooks.deliverer import Deliverer

    store = Store(settings)
    deliverer = Deliverer(store, settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, deliverer.stop)
    logging.getLogger(__name__).info("webhooks: delivering (prefix %r)", settings.key_prefix)
    try:
        await deliverer.run()
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.service.webhooks", description=__doc__)
    _arguments(parser)
    return run_webhooks(parser.parse_args(argv))
