"""aiohttp: an order service that writes each order and its event in one transaction
(asyncpg), with the relay running inside the app's ``cleanup_ctx``.

Run it with ``python -m examples.aiohttp`` (see ``docs/embedding-frameworks.md``).
"""
