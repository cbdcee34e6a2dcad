"""PostgreSQL: connections, the SQL files, migrations, the outbox store and the dead letters."""
