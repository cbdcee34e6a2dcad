# The notify-outbox relay: `docker build -t notify-outbox .` (docker-compose.yml builds it too).
# Configure it with NOTIFY_OUTBOX_* environment variables; the default command runs the relay.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the wheel is built from (see [tool.hatch.build] in pyproject.toml).
COPY pyproject.toml README.md ./
COPY notify_outbox ./notify_outbox
COPY sql ./sql
RUN pip install . && rm -rf /src

RUN useradd --system --uid 10001 --no-create-home notify
USER notify
WORKDIR /

CMD ["python", "-m", "notify_outbox", "run"]
