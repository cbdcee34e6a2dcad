"""``python -m examples.aiohttp [--host 127.0.0.1] [--port 8080] [--topic orders]``

Serves the order service with aiohttp. Settings come from ``NOTIFY_OUTBOX_DSN`` and
``NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS`` (``eval "$(make -s stack-up)"`` sets both for a
local stack). The topic must exist (or the broker must create topics)::

    curl -X POST localhost:8080/orders -H 'content-type: application/json' \\
         -d '{"customer": "ada", "total_cents": 1250}'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from aiohttp import web

from examples.aiohttp.app import create_app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.aiohttp", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--topic", default="orders", help="where order events go")
    args = parser.parse_args(argv)
    web.run_app(create_app(topic=args.topic), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
