"""The producer's side: ``enqueue`` with asyncpg, the SQLAlchemy helpers, the Alembic bridge.

``sqlalchemy`` and ``alembic`` need their optional extras, so this package does not import them.
"""
