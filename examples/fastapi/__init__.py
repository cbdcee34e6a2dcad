"""FastAPI: an order service that writes each order and its event in one transaction
(SQLAlchemy ``AsyncSession``), with the relay running inside the app's lifespan.

Run it with ``python -m examples.fastapi`` (see ``docs/embedding-frameworks.md``).
"""
