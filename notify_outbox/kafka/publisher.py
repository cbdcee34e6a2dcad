"""Publishing claimed rows to Kafka.

``Publisher`` is the port the relay's logic talks to; ``KafkaPublisher`` implements it with an
idempotent aiokafka producer (acks=all). A batch is pipelined: every ``send()`` is queued
first, then all acknowledgements are awaited together under one deadline, because aiokafka
with idempotence never expires a batch on its own and would wait forever for a dead broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import anyio
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka import errors as kafka_errors
from aiokafka.abc import AbstractTokenProvider
from aiokafka.conn import create_conn
from aiokafka.helpers import create_ssl_context
from aiokafka.partitioner import murmur2
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from notify_outbox.core.backoff import Backoff
from notify_outbox.core.errors import ConfigurationError
from notify_outbox.core.message import SCHEMA_REGISTRY, KafkaMessage, PublishResult
from notify_outbox.core.outbox import OutboxRow
from notify_outbox.core.settings import OutboxSettings
from notify_outbox.core.tracing import record_send_spans

from .records import RowRejected, _record, to_message
from .registry import RegistryClient, RegistryError, RegistryRefused, RowEncoder, SchemaMismatch

__all__ = [
    "KafkaMessage",
    "KafkaPublisher",
    "NotEncoded",
    "Partitions",
    "PublishResult",
    "Publisher",
    "RowRejected",
    "TokenProvider",
    "load_token_provider",
    "missing_topics",
    "to_message",
]

log = logging.getLogger("notify_outbox.publisher")

# Errors about one message that will not go away by retrying the batch at once; the row is
# retried with backoff and dead-lettered after max_attempts.
_ROW_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidTopicError,
    kafka_errors.CorruptRecordException,
    kafka_errors.UnsupportedForMessageFormatError,
)


# The idempotent producer's session is broken, not a row: after a batch expired while its
# partition had no leader (a broker restart), aiokafka has used up sequence numbers it never
# sent, and the broker refuses every later batch of that partition. Only a new producer
# (a new producer id) recovers; the rows stay pending and are sent again by it.
_SESSION_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.OutOfOrderSequenceNumber,
    kafka_errors.UnknownProducerId,
    kafka_errors.InvalidProducerEpoch,
    kafka_errors.ProducerFenced,
)


# What a broker answers for a batch over the topic's max.message.bytes.
_TOO_LARGE: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
)


# What a broker, then aiokafka after its retries, answers for a topic deleted under the relay.
_TOPIC_GONE_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.UnknownTopicOrPartitionError,
    kafka_errors.NotLeaderForPartitionError,
)


def _topic_gone(producer: AIOKafkaProducer, topic: str, error: BaseException) -> bool:
    """Whether ``error`` says ``topic`` no longer exists: an error of a missing partition
    while the producer's metadata (refreshed by aiokafka on that error) no longer lists the
    topic. A leader change of a topic that exists is not that: it stays an outage."""
    return (
        isinstance(error, _TOPIC_GONE_ERRORS)
        and producer.client.cluster.partitions_for_topic(topic) is None
    )


# What a failed batch is reported to: its error, its (topic, partition), its number of
# records, and whether the report comes from inside aiokafka's handling of the broker's answer
# (True, ``_on_failure``) or from a done-callback one loop turn later.
_OnAck = Callable[[BaseException, tuple[str, int], int, bool], None]


class _Abandoned(kafka_errors.KafkaError):  # type: ignore[misc]  # aiokafka has no type hints
    """What the records an abandoned producer still held fail with: they were never sent."""


class _Dropped(_Abandoned):
    """What a partition's queued batches fail with when a batch before them was refused as
    too large (``_skip_partition``): never sent, and the producer goes on."""


# While acks are awaited (the claim's transaction is open), Kafka is asked this often whether it
# is still there; when it is not, the batch gives up at once rather than hold its row locks and
# an xid (which holds back vacuum cluster-wide) for the whole send deadline.
_PROBE_EVERY = 0.5
_PROBE_TIMEOUT = 1.0
# A topic refused as unknown while still listed: metadata looks before calling it an outage.
_TOPIC_RECHECKS = 3
_TOPIC_RECHECK_GAP = 0.1
# How often an unavailable Kafka is asked whether it is back: a refused connection costs
# nothing, and delivery should resume well within a second of the broker's return.
_RECOVERY_FIRST = 0.02
_RECOVERY_CAP = 0.2


async def missing_topics(producer: AIOKafkaProducer, topics: set[str]) -> dict[str, str]:
    """Topics whose rows cannot go, with the reason: Kafka says they do not exist, or
    will not even describe them to this relay's principal (no DESCRIBE: the metadata
    answer is TOPIC_AUTHORIZATION_FAILED). Raises TimeoutError or KafkaError when Kafka
    cannot be asked, so that a broker outage is never mistaken for a missing topic."""
    client = producer.client
    unknown = {t for t in topics if client.cluster.partitions_for_topic(t) is None}
    if not unknown:
        return {}
    for topic in unknown:
        client.add_topic(topic)
    # aiokafka hands back the metadata request already in flight, if there is one, and it
    # may have gone out before these topics were added: what its answer lacks is asked
    # for once more before it counts as missing (seen: a new topic's rows failed once).
    for _ in range(2):
        if not await client.force_metadata_update():
            raise kafka_errors.KafkaConnectionError("metadata request failed")
        unknown = {t for t in unknown if client.cluster.partitions_for_topic(t) is None}
        if not unknown:
            break
    denied = client.cluster.unauthorized_topics
    return {
        topic: (
            f"not authorized to describe topic {topic!r} (TopicAuthorizationFailedError): "
            "grant the relay's principal DESCRIBE and WRITE on it"
            if topic in denied
            else f"topic {topic!r} does not exist in Kafka"
        )
        for topic in unknown
    }


class Publisher(Protocol):
    """What the relay needs from Kafka (a port, so tests can use a fake)."""

    @property
    def available(self) -> bool:
        """False while Kafka is known to be unavailable: claim nothing until
        ``wait_available`` returns."""
        ...

    async def publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        """Send rows in order and wait for their acks, within the send deadline."""
        ...

    async def wait_available(self) -> None:
        """Return once Kafka answers again and no earlier send is still in flight."""
        ...

    async def check(self) -> bool:
        """Ask Kafka whether it still answers (a relay with nothing to send would otherwise
        learn of an outage only at its next publish). False: it counts as unavailable, as
        after a failed publish, until ``wait_available`` returns."""
        ...


def _is_row_error(error: BaseException) -> bool:
    return isinstance(error, _ROW_ERRORS)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".rstrip(": ")


# OpenSSL's verify codes for a certificate that does not name the host connected to.
_NAME_MISMATCH = (62, 64)  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH


def _settings_problem(error: BaseException, settings: OutboxSettings, host: str) -> str | None:
    """What a broker's refusal says about the relay's settings, in words that name the
    setting to check; None for an error that is no such refusal (a broker down, say)."""
    if isinstance(error, kafka_errors.SaslAuthenticationFailed):
        if settings.kafka_sasl_mechanism == "OAUTHBEARER":
            return (
                "Kafka refused the relay's OAUTHBEARER token (authentication failed): check "
                f"what the token provider returns ({_describe(error)})"
            )
        return (
            f"Kafka refused the relay's credentials (SASL {settings.kafka_sasl_mechanism} "
            f"authentication failed for user {settings.kafka_sasl_username!r}): check "
            f"NOTIFY_OUTBOX_KAFKA_SASL_USERNAME and NOTIFY_OUTBOX_KAFKA_SASL_PASSWORD "
            f"({_describe(error)})"
        )
    if isinstance(error, kafka_errors.UnsupportedSaslMechanismError):
        return (
            f"Kafka does not enable SASL mechanism {settings.kafka_sasl_mechanism} for this "
            f"listener (authentication): check NOTIFY_OUTBOX_KAFKA_SASL_MECHANISM "
            f"({_describe(error)})"
        )
    if isinstance(error, ssl.SSLCertVerificationError):
        if error.verify_code in _NAME_MISMATCH:
            return (
                f"Kafka TLS hostname check failed: the broker's certificate does not name {host!r} "
                f"({error.verify_message}): connect through a name the certificate carries "
                "(NOTIFY_OUTBOX_KAFKA_BOOTSTRAP_SERVERS)"
            )
        cafile = settings.kafka_ssl_cafile or "the system's trust store"
        return (
            f"Kafka TLS certificate verification failed: the broker's certificate is not trusted "
            f"by the CA in {cafile} ({error.verify_message}): check "
            "NOTIFY_OUTBOX_KAFKA_SSL_CAFILE"
        )
    return None


#: An OAUTHBEARER token source: no argument, the token (or an awaitable of it).
TokenProvider = Callable[[], "str | Awaitable[str]"]


class _Tokens(AbstractTokenProvider):  # type: ignore[misc]  # aiokafka has no type hints
    """aiokafka's token provider around a plain function."""

    def __init__(self, get: TokenProvider, where: str) -> None:
        self._get = get
        self._where = where

    async def token(self) -> str:
        value = self._get()
        if inspect.isawaitable(value):
            value = await value
        if not isinstance(value, str) or not value:
            # Never the value itself: it may be a token.
            raise ConfigurationError(
                f"the OAUTHBEARER token provider {self._where} returned "
                f"{type(value).__name__}, not a token string"
            )
        return value


def load_token_provider(path: str) -> TokenProvider:
    """The function a ``package.module:function`` path names (the
    ``kafka_sasl_oauth_token_provider`` setting); a ConfigurationError when there is none."""
    module, _, name = path.partition(":")
    variable = "NOTIFY_OUTBOX_KAFKA_SASL_OAUTH_TOKEN_PROVIDER"
    if not module or not name:
        raise ConfigurationError(f"{variable}: {path!r} is not `package.module:function`")
    try:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        raise ConfigurationError(f"{variable}: cannot load {path!r}: {_describe(e)}") from None
    if not callable(target):
        raise ConfigurationError(f"{variable}: {path!r} is not callable")
    return cast(TokenProvider, target)


class KafkaPublisher:
    """``Publisher`` on one idempotent aiokafka producer, shared by all workers of a relay.

    ``token_provider``: OAUTHBEARER's token source, given in code (else the
    ``kafka_sasl_oauth_token_provider`` setting names one)."""

    def __init__(
        self, settings: OutboxSettings, *, token_provider: TokenProvider | None = None
    ) -> None:
        self._settings = settings
        self._tokens: _Tokens | None = None
        if settings.kafka_sasl_mechanism == "OAUTHBEARER":
            path = settings.kafka_sasl_oauth_token_provider
            if token_provider is not None:
                self._tokens = _Tokens(token_provider, repr(token_provider))
            elif path:
                self._tokens = _Tokens(load_token_provider(path), path)
            else:
                raise ConfigurationError(
                    "NOTIFY_OUTBOX_KAFKA_SASL_OAUTH_TOKEN_PROVIDER (or a kafka_token_provider "
                    "given to the Relay) is required with NOTIFY_OUTBOX_KAFKA_SASL_MECHANISM="
                    "OAUTHBEARER"
                )
        self._producer: AIOKafkaProducer | None = None
        # Acks of batches whose deadline passed: they may still complete when Kafka returns.
        self._outstanding: set[asyncio.Future[Any]] = set()
        self._broken = False  # the producer's idempotent session is unusable: replace it
        self._down: str | None = None  # why Kafka is unavailable, while it is
        self._recovery_lock = asyncio.Lock()
        self._partitions = Partitions()
        # Per topic, the largest batch to send it, once it refused a larger one (its
        # max.message.bytes is below kafka_batch_size): Kafka refuses a whole batch whose
        # size is over the topic's limit, however small its records.
        self._batch_limits: dict[str, int] = {}
        #: Encodes the governed topics' events (schema_registry_url), else None.
        self.encoder = _row_encoder(settings)
        self._registry_down = False  # _down is the Schema Registry's outage, not Kafka's

    @property
    def available(self) -> bool:
        return self._down is None and not self._broken

    @property
    def connected(self) -> bool:
        """Whether a producer was started (``start`` returned) and not stopped since."""
        return self._producer is not None

    def _ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of the settings; a ConfigurationError naming the file that does
        not load (a wrong key password surfaces here, as OpenSSL's bare "PEM lib")."""
        s = self._settings
        if s.kafka_security_protocol not in ("SSL", "SASL_SSL"):
            return None
        try:
            context: ssl.SSLContext = create_ssl_context(
                cafile=str(s.kafka_ssl_cafile) if s.kafka_ssl_cafile else None,
                certfile=str(s.kafka_ssl_certfile) if s.kafka_ssl_certfile else None,
                keyfile=str(s.kafka_ssl_keyfile) if s.kafka_ssl_keyfile else None,
                password=s.kafka_ssl_password.get_secret_value() if s.kafka_ssl_password else None,
            )
            return context
        except (ssl.SSLError, OSError) as e:
            files = ", ".join(
                f"{name} {path}"
                for name, path in (
                    ("CA file", s.kafka_ssl_cafile),
                    ("client certificate", s.kafka_ssl_certfile),
                    ("client key", s.kafka_ssl_keyfile),
                )
                if path
            )
            hint = (
                "; is NOTIFY_OUTBOX_KAFKA_SSL_PASSWORD the client key's password?"
                if s.kafka_ssl_keyfile and isinstance(e, ssl.SSLError)
                else ""
            )
            message = f"Kafka TLS settings do not load ({files}): {_describe(e)}{hint}"
            log.error("%s", message)
            raise ConfigurationError(message) from None

    def connection_options(self) -> dict[str, Any]:
        """How to reach and authenticate with the brokers (aiokafka's keywords): the
        producer's, the probe's that finds why a start failed, and the exactly-once mode's
        clients'."""
        s = self._settings
        return {
            "client_id": s.kafka_client_id,
            "request_timeout_ms": s.kafka_request_timeout_ms,
            "security_protocol": s.kafka_security_protocol,
            "sasl_mechanism": s.kafka_sasl_mechanism or "PLAIN",
            "sasl_plain_username": s.kafka_sasl_username,
            "sasl_plain_password": (
                s.kafka_sasl_password.get_secret_value() if s.kafka_sasl_password else None
            ),
            "sasl_oauth_token_provider": self._tokens,
            "ssl_context": self._ssl_context(),
        }

    def _make_producer(self) -> AIOKafkaProducer:
        s = self._settings
        return AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap_servers.split(","),
            acks="all",
            enable_idempotence=True,
            linger_ms=s.kafka_linger_ms,
            max_batch_size=min(s.kafka_batch_size, s.kafka_max_request_size),
            max_request_size=s.kafka_max_request_size,
            compression_type=s.kafka_compression_type,
            **self.connection_options(),
        )

    async def _diagnose(self) -> str | None:
        """Why the brokers refuse this relay, when the reason is its settings (credentials,
        the CA, the broker's name): aiokafka's start only says "Unable to bootstrap" and logs
        the cause itself. One connection to each bootstrap server, with the producer's
        options; None when none refused for such a reason (down, or not reachable)."""
        options = self.connection_options()
        for server in self._settings.kafka_bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                # Short: a refusal of the settings comes at once, and a broker that does not
                # answer (frozen) must not hold up the next attempt to connect.
                with anyio.fail_after(_PROBE_TIMEOUT):
                    conn = await create_conn(host.strip("[]"), int(port), **options)
            except (kafka_errors.KafkaError, OSError, TimeoutError, ValueError) as e:
                problem = _settings_problem(e, self._settings, host)
                if problem is not None:
                    return problem
                continue
            conn.close()
        return None

    async def start(self, *, fatal: bool = False) -> None:
        """Connect to Kafka, retrying with backoff until it answers (a relay started before
        its broker waits instead of crashing).

        When the brokers answer but refuse the relay's settings (wrong credentials, a broker
        certificate the CA does not sign or that names another host), the warning says so;
        with ``fatal`` (a relay's first start), it raises ConfigurationError instead of
        retrying. A client key or CA file that does not load always raises it."""
        s = self._settings
        backoff = Backoff(s.reconnect_min_delay, s.reconnect_max_delay)
        while True:
            producer = self._make_producer()
            try:
                with anyio.fail_after(s.kafka_send_timeout):
                    await producer.start()
            except (kafka_errors.KafkaError, TimeoutError, OSError) as e:
                with anyio.move_on_after(s.kafka_send_timeout, shield=True):
                    await producer.stop()
                delay = backoff.next_delay()
                # A relay started before its broker waits quietly: the first failure and one
                # in 64 as warnings, every attempt at DEBUG.
                loud = backoff.failures % 64 == 1
                problem = await self._diagnose() if fatal or loud else None
                if problem is not None and fatal:
                    log.error("%s", problem)
                    raise ConfigurationError(problem) from None
                log.log(
                    logging.WARNING if loud else logging.DEBUG,
                    "Kafka not reachable yet (%s); retrying every %.1fs or so",
                    problem or _describe(e),
                    backoff.cap,
                )
                await anyio.sleep(delay)
                continue
            except BaseException:
                # Cancelled while connecting (the relay stopped before Kafka answered): close
                # what the attempt opened, or the producer is collected unclosed.
                with anyio.move_on_after(s.kafka_send_timeout, shield=True):
                    await producer.stop()
                raise
            self._producer = producer
            await self._probe_registry(fatal=fatal)
            return

    async def _probe_registry(self, *, fatal: bool) -> None:
        """At start: a registry that refuses the relay (credentials, TLS) is a setting to
        fix (with ``fatal``, ConfigurationError); one that does not answer yet only delays
        the governed topics' rows, which wait for it."""
        if self.encoder is None:
            return
        try:
            await self.encoder.client.probe()
        except RegistryRefused as e:
            if fatal:
                log.error("%s", e)
                raise
            log.warning("%s", e)
        except RegistryError as e:
            log.warning("%s; rows of its topics wait for it", e)

    async def stop(self, grace: float) -> bool:
        """Flush and stop the producer within ``grace`` seconds; False if it was abandoned.

        Cancelling the caller (an abort during a graceful stop) abandons it at once."""
        producer, self._producer = self._producer, None
        if self.encoder is not None:
            await self.encoder.client.aclose()
        if producer is None:
            return True
        stopped = False
        try:
            with anyio.move_on_after(grace):
                await producer.stop()
                stopped = True
        finally:
            if not stopped:
                _abandon(producer)
        if not stopped:
            log.error("Kafka producer did not stop within %.1fs; abandoning it", grace)
        return stopped

    @property
    def producer(self) -> AIOKafkaProducer:
        """The running producer."""
        if self._producer is None:
            raise RuntimeError("KafkaPublisher is not started")
        return self._producer

    async def _missing_topics(self, topics: set[str]) -> dict[str, str]:
        return await missing_topics(self.producer, topics)

    async def _reachable(self, topics: Iterable[str] = ()) -> bool:
        """Whether Kafka answers a metadata request within ``_PROBE_TIMEOUT`` and every
        partition of ``topics`` (those that exist) has a leader to take writes."""
        client = self.producer.client
        with anyio.move_on_after(_PROBE_TIMEOUT):
            try:
                if not await client.force_metadata_update():
                    return False
            except (kafka_errors.KafkaError, OSError):
                return False
            for topic in topics:
                for partition in client.cluster.partitions_for_topic(topic) or ():
                    leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
                    if leader is None or leader < 0:
                        return False
            return True
        return False

    async def _await_acks(self, futures: Iterable[asyncio.Future[Any]], topics: set[str]) -> bool:
        """Wait for ``futures``; False as soon as a probe finds Kafka unavailable."""
        pending = {f for f in futures if not f.done()}
        while pending:
            _, pending = await asyncio.wait(pending, timeout=_PROBE_EVERY)
            if pending and not await self._reachable(topics):
                return False
        return True

    async def publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        started = time.time_ns()
        result = await self._publish(rows)
        record_send_spans(rows, result, started)  # OpenTelemetry, if on (tracing.py)
        return result

    async def _publish(self, rows: Sequence[OutboxRow]) -> PublishResult:
        """Send ``rows`` in waves and classify the acks. A wave holds at most one topic per
        key: Kafka keeps order only within a partition, so a key's row for another topic
        waits for the next wave, sent once the acks of this one are in (and not at all if
        the key's earlier row failed). Almost every batch is one wave."""
        result = PublishResult()
        if not self.available:
            result.unavailable = self._down or "the Kafka producer must be replaced"
            if self._registry_down:
                result.dependency = SCHEMA_REGISTRY
            return result
        if self.encoder is not None and not await self._schemas_ready(rows, result):
            return result
        # One producer for the whole claim: records of one key must not be split between an
        # abandoned producer (which sends nothing more) and its replacement.
        producer = self.producer
        on_ack = self._watch(producer)
        self._partitions.next_publish()
        blocked: set[str] = set()  # keys with a failed row: their later rows wait
        unknown_topic: list[tuple[_Sent, BaseException]] = []  # see _recheck_topics
        topics = {r.topic for r in rows}
        unsettled: list[_Sent] = []  # sent, acks not classified yet
        # asyncio's timeout, not anyio's cancel scope: entering one of those cost 40 µs of a
        # quiet relay's ~250 µs from the claim's rows to the hand-over (the producer is
        # asyncio's anyway).
        deadline = asyncio.timeout(self._settings.kafka_send_timeout)
        try:
            async with deadline:
                try:
                    missing = await self._missing_topics(topics)
                except (kafka_errors.KafkaError, OSError) as e:
                    result.unavailable = f"Kafka metadata unavailable: {_describe(e)}"
                todo: Sequence[OutboxRow] = rows
                while todo and result.unavailable is None:
                    # One topic, the common case: the whole claim is one wave (blocked keys
                    # are skipped while the wave is built).
                    wave, todo = (todo, ()) if len(topics) == 1 else _next_wave(todo, blocked)
                    # Filled as batches are handed over: a timeout that cuts the wave short
                    # must still find every batch sent, to park its ack (_classify).
                    unsettled = []
                    await self._send_wave(
                        producer, on_ack, wave, missing, blocked, result, unsettled
                    )
                    if unsettled:
                        result.handed_at = time.monotonic_ns()
                    if result.unavailable is None and not await self._await_acks(
                        [b.future for b in unsettled], topics
                    ):
                        result.unavailable = "Kafka stopped answering"
                    if result.unavailable is None:
                        self._classify(producer, unsettled, result, blocked, unknown_topic)
                        unsettled = []
        except TimeoutError:
            if not deadline.expired():
                raise  # not the deadline's: a socket's, say
        if deadline.expired() and result.unavailable is None:
            result.unavailable = (
                f"Kafka did not acknowledge within {self._settings.kafka_send_timeout}s"
            )
        self._classify(producer, unsettled, result, blocked, unknown_topic)
        if unknown_topic:
            await self._recheck_topics(producer, unknown_topic, result, blocked)
        if result.unavailable is not None and self._down is None:
            self._down = result.unavailable
        return result

    async def _schemas_ready(self, rows: Sequence[OutboxRow], result: PublishResult) -> bool:
        """Load the schemas the rows need; False (an outage: the rows wait, no attempt
        counted) when one was never loaded and the registry does not answer."""
        assert self.encoder is not None
        try:
            await self.encoder.prepare(rows)
        except RegistryError as e:
            result.unavailable = self._down = str(e)
            result.dependency = SCHEMA_REGISTRY
            self._registry_down = True
            return False
        return True

    async def probe_registry(self) -> None:
        """For a relay that runs its own producers (exactly-once): check the Schema Registry
        as ``start()`` does. Raises RegistryRefused when it refuses the relay."""
        await self._probe_registry(fatal=True)

    async def encode_governed(
        self, row: OutboxRow, key: bytes | None, value: bytes | None
    ) -> tuple[bytes | None, bytes | None]:
        """A row's key and value as its topic's Schema Registry schemas encode them (as they
        are when no registry governs the topic), for a relay that builds its own records;
        call ``encoder.prepare(rows)`` first. Raises ``NotEncoded`` as the batch path fails
        such a row."""
        encoder = self.encoder
        if encoder is None or not encoder.governs(row.topic):
            return key, value
        try:
            return encoder.encode(row, key, value)
        except (RegistryError, ValueError) as error:
            return await self._encode_again(row, key, value, error)

    async def _encode_again(
        self, row: OutboxRow, key: bytes | None, value: bytes | None, error: Exception
    ) -> tuple[bytes | None, bytes | None]:
        """What a governed row whose encoding raised ``error`` becomes: encoded after all
        (a mismatch against a schema since replaced), or ``NotEncoded``: the row fails now
        (its subject has no schema yet) or for good (it does not match the schema)."""
        assert self.encoder is not None
        try:
            if isinstance(error, SchemaMismatch):
                # The producer may have registered a newer version: re-read, then decide.
                return await self.encoder.encode_rechecked(row, key, value)
            raise error
        except RegistryError as e:  # before ValueError: RegistryRefused is one
            raise NotEncoded(f"schema: {e}", permanent=False) from None
        except ValueError as e:
            # A mismatch, a schema this library cannot encode, a payload that is not JSON.
            raise NotEncoded(f"schema: {e}", permanent=True) from None

    async def _send_wave(
        self,
        producer: AIOKafkaProducer,
        on_ack: _OnAck,
        wave: Sequence[OutboxRow],
        missing: dict[str, str],
        blocked: set[str],
        result: PublishResult,
        sent: list[_Sent],
    ) -> None:
        """Map a wave's rows to records in batches per partition (``_batch_wave``), then hand
        the batches to the producer (``_hand_over``), adding each to ``sent``."""
        batches = await self._batch_wave(producer, wave, missing, blocked, result)
        if batches:
            await self._hand_over(producer, on_ack, batches, result, sent)

    async def _batch_wave(
        self,
        producer: AIOKafkaProducer,
        wave: Sequence[OutboxRow],
        missing: dict[str, str],
        blocked: set[str],
        result: PublishResult,
    ) -> dict[tuple[str, int], list[_Batch]]:
        """Map a wave's rows to records and append them to batches per partition, in row
        order (so a key's rows keep theirs). A row that cannot be sent fails here and holds
        back its key's later rows. Once per event: nothing is called per row that the common
        row does not need."""
        debezium = self._settings.header_style == "debezium"
        encoder = self.encoder
        # Below this many bytes of key, value and header text, a record cannot exceed the
        # request size: the exact estimate is only worth its cost above it.
        surely_fits = self._settings.kafka_max_request_size // 2 - 1024
        choose = self._partitions.choose
        batches: dict[tuple[str, int], list[_Batch]] = {}
        # Per topic, each key's partition's batches: one dict look-up per row once the key
        # was seen (a claim holds many rows of few keys, or of one topic).
        chains: dict[str, dict[bytes | None, list[_Batch]]] = {}
        last_topic: str | None = None
        chain_of: dict[bytes | None, list[_Batch]] = {}
        limit: int | None = None
        governed = False  # the topic's events are encoded by the Schema Registry's schemas
        for row in wave:
            key = row.key
            if key is not None and key in blocked:
                continue
            try:
                kb, value, headers = _record(row, debezium)
            except RowRejected as e:
                # Before the topic's check: a row that can never be sent goes at its first
                # attempt, whatever its topic.
                _fail(result, blocked, row, f"malformed event: {e}", permanent=True)
                continue
            topic = row.topic
            if topic in missing:
                _fail(result, blocked, row, missing[topic])
                continue
            if topic != last_topic:
                last_topic, chain_of = topic, chains.setdefault(topic, {})
                limit = self._batch_limits.get(topic)
                governed = encoder is not None and encoder.governs(topic)
            if governed:
                assert encoder is not None
                try:
                    kb, value = encoder.encode(row, kb, value)
                except (RegistryError, ValueError) as error:
                    try:
                        kb, value = await self._encode_again(row, kb, value, error)
                    except NotEncoded as e:
                        _fail(result, blocked, row, e.reason, permanent=e.permanent)
                        continue
            # Bytes of key and value, and at most 4 per character of the header texts (UTF-8).
            bound = (len(value) if value is not None else 0) + (len(kb) if kb is not None else 0)
            for text in (row.headers, row.event_type, row.aggregate_type, row.aggregate_id):
                if text is not None:
                    bound += 4 * len(text)
            if bound >= surely_fits and (too_large := self._too_large(kb, value, headers)):
                _fail(result, blocked, row, too_large)
                continue
            chain = chain_of.get(kb)
            if chain is None:
                partition = choose(producer, topic, kb)
                if partition is None:
                    _fail(result, blocked, row, f"topic {topic!r} does not exist in Kafka")
                    continue
                tp = (topic, partition)
                chain = batches.get(tp)
                if chain is None:
                    chain = batches[tp] = [_Batch(producer.create_batch())]
                chain_of[kb] = chain
            batch = chain[-1]
            if (
                limit is not None
                and batch.rows
                and batch.builder.size()
                + DefaultRecordBatchBuilder.estimate_size_in_bytes(kb, value, headers)
                > limit
            ):
                batch = _Batch(producer.create_batch())
                chain.append(batch)
            if batch.builder.append(timestamp=None, key=kb, value=value, headers=headers) is None:
                # Full: the row starts the partition's next batch (an empty batch takes
                # any record; the size was checked above).
                batch = _Batch(producer.create_batch())
                chain.append(batch)
                batch.builder.append(timestamp=None, key=kb, value=value, headers=headers)
            batch.rows.append(row)
        return batches

    def _too_large(
        self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes | None]]
    ) -> str | None:
        """Why a record cannot be sent at all (over the producer's request size), or None."""
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)
        if size <= self._settings.kafka_max_request_size:
            return None
        return _describe(
            kafka_errors.MessageSizeTooLargeError(
                f"The message is {size} bytes when serialized which is larger than "
                "the maximum request size you have configured with the "
                "max_request_size configuration"
            )
        )

    async def _hand_over(
        self,
        producer: AIOKafkaProducer,
        on_ack: _OnAck,
        batches: dict[tuple[str, int], list[_Batch]],
        result: PublishResult,
        sent: list[_Sent],
    ) -> None:
        """Hand the batches to the producer, the partitions side by side, each partition's
        in order; what was not handed over stays pending (Kafka unavailable)."""
        errors: list[kafka_errors.KafkaError] = []

        async def submit(tp: tuple[str, int], chain: list[_Batch]) -> None:
            # A partition's next batch waits until the producer took the one before (and,
            # idempotent, until its ack came): the partitions go side by side.
            for batch in chain:
                while not errors:
                    try:
                        sent.append(await _submit(producer, batch, tp, on_ack))
                        break
                    except _Dropped:
                        return  # the partition's batch before it was refused: stays pending
                    except kafka_errors.KafkaTimeoutError as e:
                        # aiokafka's send_batch gives up early while other claims queue
                        # batches for the same partition (aiokafka 0.14 takes the time
                        # waited so far off its timeout again at every turn): a false
                        # timeout, unless Kafka stopped answering.
                        if not await self._reachable([tp[0]]):
                            errors.append(e)
                    except kafka_errors.KafkaError as e:
                        errors.append(e)

        if len(batches) == 1:
            await submit(*next(iter(batches.items())))
        else:
            await asyncio.gather(*(submit(tp, chain) for tp, chain in batches.items()))
        # An abandoned producer's records go with the next one.
        if errors and not isinstance(errors[0], _Abandoned):
            result.unavailable = _describe(errors[0])

    def _classify(
        self,
        producer: AIOKafkaProducer,
        sent: Sequence[_Sent],
        result: PublishResult,
        blocked: set[str],
        unknown_topic: list[tuple[_Sent, BaseException]],
    ) -> None:
        """Sort the rows of sent batches by their batch's ack: delivered, failed (retry with
        backoff), or Kafka unavailable. A batch whose ack is still out is parked: nobody
        waits for it any more, but it may still complete when Kafka returns. A batch refused
        for an unknown topic that the producer's metadata still lists goes to
        ``unknown_topic`` (its keys blocked), for ``_recheck_topics`` to settle."""
        for batch in sent:
            fut = batch.future
            if not fut.done():
                self._outstanding.add(fut)
                fut.add_done_callback(self._outstanding.discard)
                # Read its error when it comes, or asyncio logs "exception was never
                # retrieved" for it.
                fut.add_done_callback(_retrieve)
                continue
            error = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
            if error is None:
                result.delivered.extend([r.id for r in batch.rows])
            elif isinstance(error, _Abandoned):
                pass  # never sent: stays pending, no attempt counted
            elif isinstance(error, _SESSION_ERRORS):
                self._broken = True
                if result.unavailable is None:
                    result.unavailable = f"Kafka producer session broken: {_describe(error)}"
            elif _topic_gone(producer, batch.topic, error):
                # Deleted while its rows were on their way: theirs, not Kafka's, failure.
                for row in batch.rows:
                    _fail(result, blocked, row, f"topic {batch.topic!r} does not exist in Kafka")
            elif isinstance(error, _TOO_LARGE) and len(batch.rows) > 1:
                # The batch was too large for the topic, not its rows: they stay pending,
                # with no attempt counted, and go again in smaller batches.
                self._lower_batch_limit(batch, error)
            elif isinstance(error, kafka_errors.UnknownTopicOrPartitionError):
                unknown_topic.append((batch, error))
                blocked.update(r.key for r in batch.rows if r.key is not None)
            elif _is_row_error(error) or (
                isinstance(error, kafka_errors.KafkaError) and not error.retriable
            ):
                for row in batch.rows:
                    _fail(result, blocked, row, _describe(error))
            elif result.unavailable is None:
                result.unavailable = _describe(error)

    async def _recheck_topics(
        self,
        producer: AIOKafkaProducer,
        unknown_topic: list[tuple[_Sent, BaseException]],
        result: PublishResult,
        blocked: set[str],
    ) -> None:
        """A batch refused for an unknown topic while the producer's metadata still listed
        it: either the topic was deleted and the answer came before the metadata learnt it
        (seen on a loaded host: a spurious outage), or a partition is moving (an outage).
        Asks for the metadata again, up to ``_TOPIC_RECHECKS`` times ``_TOPIC_RECHECK_GAP``
        apart while a refused topic is still listed (on a loaded host the broker answering the
        metadata request may not have learnt of the deletion yet either: a spurious outage in
        CI): the rows of a topic that is gone fail as missing, the rest make it an outage."""
        for attempt in range(_TOPIC_RECHECKS):
            if attempt:
                await anyio.sleep(_TOPIC_RECHECK_GAP)
            with contextlib.suppress(kafka_errors.KafkaError, OSError, TimeoutError):
                with anyio.fail_after(_PROBE_TIMEOUT):
                    await producer.client.force_metadata_update()
            if all(_topic_gone(producer, batch.topic, e) for batch, e in unknown_topic):
                break
        for batch, error in unknown_topic:
            if _topic_gone(producer, batch.topic, error):
                for row in batch.rows:
                    _fail(result, blocked, row, f"topic {batch.topic!r} does not exist in Kafka")
            elif result.unavailable is None:
                result.unavailable = _describe(error)

    def _lower_batch_limit(self, batch: _Sent, error: BaseException) -> None:
        """Halve the batches sent to a topic that refused one of ``batch.size`` bytes; a
        record over the limit goes alone, and the topic's refusal of it is its row's."""
        limit = max(1, min(self._batch_limits.get(batch.topic, batch.size), batch.size) // 2)
        self._batch_limits[batch.topic] = limit
        log.warning(
            "topic %r refused a batch of %d records (%d bytes) as too large (%s); sending it "
            "batches of at most %d bytes from now on. Set NOTIFY_OUTBOX_KAFKA_BATCH_SIZE below "
            "the topic's max.message.bytes to spare these retries",
            batch.topic,
            len(batch.rows),
            batch.size,
            _describe(error),
            limit,
        )

    def _watch(self, producer: AIOKafkaProducer) -> _OnAck:
        """What ``producer``'s failed batches are reported to: a record that fails must not
        let anything queued behind it on its partition go out of order.

        aiokafka numbers a partition's record batches when it sends them and never takes a
        number back, so a batch the broker refused (a record over the topic's
        ``max.message.bytes``, say) leaves a gap, and aiokafka still sends the partition's next
        batch. The broker refuses that one (OutOfOrderSequenceNumber) only if it holds state
        for this producer on the partition; if the refused batch was the producer's first
        there, it appends it, and a key's later rows are in Kafka before its failed row. The
        report comes while aiokafka handles the broker's answer (``_on_failure``), before its
        sender can send the partition's next batch, so acting here stops it in time (a
        done-callback came a loop turn later, after the sender had sent that batch when
        other claims' batches woke it: seen with four workers). A batch refused as too large
        (appended by no broker) has its numbers taken back and its partition's queued batches
        dropped (``_skip_partition``); any other failure abandons the producer, whose unsent
        records fail with ``_Abandoned`` and stay pending for the next producer. Either way
        the other topics' records go on.
        """

        def on_ack(error: BaseException, tp: tuple[str, int], records: int, now: bool) -> None:
            if isinstance(error, _Abandoned):
                return
            topic = tp[0]
            if isinstance(error, kafka_errors.TopicAuthorizationFailedError) or _topic_gone(
                producer, topic, error
            ):
                # A topic this principal may not write, or one deleted under the relay: the
                # broker appends none of its batches, so no later batch can overtake a
                # refused one while the ACL stands or the topic is gone, and the other topics
                # go on with this producer (one such topic would otherwise replace it at every
                # attempt, pausing them all). The rows are retried, then dead-lettered with
                # the reason. Left open: an ACL granted, or the topic created again, in the
                # instant between two batches of one partition queued together.
                return
            if isinstance(error, _TOO_LARGE) and _skip_partition(producer, tp, records, now):
                return
            if producer is self._producer and not self._broken:
                self._broken = True
                log.warning(
                    "a record failed at Kafka (%s); replacing the producer so that nothing "
                    "queued behind it is sent out of order",
                    _describe(error),
                )
            _abandon(producer)

        return on_ack

    async def _replace(self) -> None:
        """Start a new producer and abandon the old one without waiting for its sends.

        Its unacknowledged sends belong to claims that were given back: their rows are sent
        again by the new producer (at-least-once). A new producer id also leaves behind an
        idempotent session that a broker restart may have broken (sequence numbers the
        broker no longer expects), instead of discovering that through a failed send.
        """
        old = self._producer
        await self.start()  # not fatal: a running relay keeps retrying, saying why
        self._broken = False
        self._outstanding.clear()
        if old is not None:
            # Without its sender task, stop() does not wait to flush what it still holds.
            _abandon(old)
            with anyio.move_on_after(_PROBE_TIMEOUT, shield=True):
                await old.stop()

    async def check(self) -> bool:
        if not self.available:
            return False
        if await self._reachable():
            return True
        self._down = self._down or "Kafka stopped answering"
        return False

    async def wait_available(self) -> None:
        async with self._recovery_lock:  # one prober for all workers
            if self.available:
                return
            backoff = Backoff(_RECOVERY_FIRST, _RECOVERY_CAP)
            while not await self._reachable():
                await backoff.sleep()
            while self._registry_down and not await self._registry_answers():
                await backoff.sleep()
            self._registry_down = False
            if self._broken or any(not f.done() for f in self._outstanding):
                await self._replace()
            self._down = None

    async def _registry_answers(self) -> bool:
        assert self.encoder is not None
        try:
            await self.encoder.client.probe()
        except RegistryError:
            return False
        return True


class NotEncoded(Exception):
    """A governed row that cannot be encoded: ``reason``, and whether it never will be."""

    def __init__(self, reason: str, *, permanent: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent


def _row_encoder(settings: OutboxSettings) -> RowEncoder | None:
    """The Schema Registry's encoder of the settings (None without a registry URL)."""
    if not settings.schema_registry_url:
        return None
    try:
        # The extra's packages, imported by the client and the codecs when first used.
        import fastavro  # noqa: F401
        import httpx  # noqa: F401
        import jsonschema  # noqa: F401
    except ImportError as e:
        raise ConfigurationError(
            f"NOTIFY_OUTBOX_SCHEMA_REGISTRY_URL needs the schema-registry extra "
            f"(pip install 'notify-outbox[schema-registry]'): {e}"
        ) from None
    password = settings.schema_registry_password
    client = RegistryClient(
        settings.schema_registry_url,
        username=settings.schema_registry_username,
        password=password.get_secret_value() if password is not None else None,
        cafile=settings.schema_registry_cafile,
    )
    return RowEncoder(
        client,
        topics=settings.schema_registry_topics,
        strategy=settings.schema_registry_subject_strategy,
        keys=settings.schema_registry_keys,
        refresh=settings.schema_registry_refresh,
    )


def _abandon(producer: AIOKafkaProducer) -> None:
    """Cancel a producer's sender task, so nothing it still holds is sent; once the task has
    ended (after the requests already sent), fail what it still holds with ``_Abandoned``,
    so that nobody waits for those acks."""
    sender_task = getattr(getattr(producer, "_sender", None), "sender_task", None)
    if sender_task is not None and not sender_task.done() and not sender_task.cancelling():
        sender_task.cancel()
        accumulator = getattr(producer, "_message_accumulator", None)
        if accumulator is None:
            return

        def fail_unsent(_: object) -> None:
            queued = [batch for batches in accumulator._batches.values() for batch in batches]
            # A batch sent once and queued again for a retry (a Kafka restart) has left the
            # accumulator's pending set, but the callback aiokafka added when it first sent it
            # removes it from that set once it is done: without it there, failing it below
            # made that callback raise KeyError, logged by the event loop with a traceback.
            pending = getattr(accumulator, "_pending_batches", None)
            if isinstance(pending, set):
                pending.update(batch for batch in queued if batch.retry_count > 0)
            # Later send() calls raise it too, and a send() waiting for room in a full batch
            # returns at once instead of after request_timeout_ms.
            accumulator.fail_all(_Abandoned("the Kafka producer was abandoned"))
            for batch in queued:
                _retrieve(batch._drain_waiter)  # or asyncio logs it as never retrieved

        sender_task.add_done_callback(fail_unsent)


def _skip_partition(
    producer: AIOKafkaProducer, tp: tuple[str, int], records: int, now: bool
) -> bool:
    """After the broker refused a batch of ``tp`` as too large, appending none of it: take
    back the ``records`` sequence numbers aiokafka gave that batch, and fail the partition's
    queued batches with ``_Dropped`` (they may hold a key's later rows; they stay pending),
    so the partition's next batch follows the last one appended, with no gap. The producer
    and its other partitions go on. ``now``: called while aiokafka handles the refusal, the
    refused batch still in flight (its partition muted); otherwise no batch of ``tp`` may be
    in flight. False (abandon the producer instead) when aiokafka's state is not the one this
    relies on: another batch of ``tp`` in flight, or internals moved."""
    sender = getattr(producer, "_sender", None)
    accumulator = getattr(producer, "_message_accumulator", None)
    manager = getattr(producer, "_txn_manager", None)
    muted = getattr(sender, "_muted_partitions", None)
    queues = getattr(accumulator, "_batches", None)
    numbers = getattr(manager, "_sequence_numbers", None)
    partition = TopicPartition(*tp)
    if not isinstance(muted, set) or not isinstance(queues, dict) or (partition in muted) != now:
        return False
    if manager is not None:
        if not isinstance(numbers, dict) or numbers.get(partition, 0) < records:
            return False
        # aiokafka mutes a partition while its batch is in flight: nothing was numbered
        # after the refused batch (in flight, or just answered), whose numbers are the last.
        numbers[partition] -= records
    for queued in queues.pop(partition, ()):
        queued.failure(_Dropped(f"a batch before it on {tp[0]}[{tp[1]}] was refused"))
        _retrieve(queued.future)
        _retrieve(queued._drain_waiter)  # or asyncio logs it when no send waits on it
    return True


@dataclass(slots=True)
class _Batch:
    """A record batch being filled: aiokafka's BatchBuilder and the rows in it, in order."""

    builder: Any
    rows: list[OutboxRow] = field(default_factory=list)


@dataclass(slots=True)
class _Sent:
    """A record batch handed to the producer: its rows and its ack."""

    rows: list[OutboxRow]
    future: asyncio.Future[Any]
    topic: str
    size: int  # bytes, as built


async def _submit(
    producer: AIOKafkaProducer,
    batch: _Batch,
    tp: tuple[str, int],
    on_ack: _OnAck,
) -> _Sent:
    """Hand a batch to the producer, and watch for its failure at once: ``on_ack`` must see
    it before the producer sends anything after it on the partition (``_on_failure``; see
    ``KafkaPublisher._watch``)."""
    future = await producer.send_batch(batch.builder, tp[0], partition=tp[1])
    records = len(batch.rows)
    if not _on_failure(producer, batch.builder, tp, lambda e: on_ack(e, tp, records, True)):

        def failed(fut: asyncio.Future[Any]) -> None:
            error = None if fut.cancelled() else fut.exception()
            if error is not None:
                on_ack(error, tp, records, False)

        future.add_done_callback(failed)
    return _Sent(batch.rows, future, tp[0], batch.builder.size())


def _on_failure(
    producer: AIOKafkaProducer,
    builder: Any,
    tp: tuple[str, int],
    report: Callable[[BaseException], None],
) -> bool:
    """Have aiokafka call ``report(error)`` as it fails the batch of ``builder`` just handed
    over, from inside its handling of the broker's answer: before its sender can send the
    partition's next batch. False when that batch is not found (aiokafka's internals moved):
    the caller watches the batch's future instead, a loop turn late."""
    queues = getattr(getattr(producer, "_message_accumulator", None), "_batches", None)
    # send_batch appended it and returned without yielding: it is the partition's last. (A
    # plain tuple finds aiokafka's TopicPartition key: a named tuple hashes as its values.)
    queued = queues.get(tp) if isinstance(queues, dict) else None
    handed = queued[-1] if queued else None
    if handed is None or getattr(handed, "_builder", None) is not builder:
        return False
    failure = handed.failure

    def failed(exception: BaseException) -> None:
        failure(exception)
        try:
            report(exception)
        except Exception:  # never into aiokafka's sender: it would stop sending
            log.exception("handling a failed batch of %s[%d] failed", *tp)

    handed.failure = failed
    return True


def _fail(
    result: PublishResult,
    blocked: set[str],
    row: OutboxRow,
    reason: str,
    *,
    permanent: bool = False,
) -> None:
    """Record a row's failure; its key's later rows must not overtake it."""
    (result.rejected if permanent else result.failed).append((row.id, reason))
    if row.key is not None:
        blocked.add(row.key)


def _next_wave(
    rows: Sequence[OutboxRow], blocked: set[str]
) -> tuple[list[OutboxRow], list[OutboxRow]]:
    """Split off the rows that may go at once: for each key, its rows up to the first one
    for a topic other than its first row's. The rest (from that row on, per key) waits for
    the acks. Rows of blocked keys are left out: they stay pending."""
    wave: list[OutboxRow] = []
    later: list[OutboxRow] = []
    topic_of: dict[str, str] = {}
    deferred: set[str] = set()
    for row in rows:
        key = row.key
        if key is None:
            wave.append(row)
            continue
        if key in blocked:
            continue
        if key in deferred:
            later.append(row)
            continue
        first = topic_of.setdefault(key, row.topic)
        if first == row.topic:
            wave.append(row)
        else:
            deferred.add(key)
            later.append(row)
    return wave, later


class Partitions:
    """The partition of each record: Kafka's default rule for keyed records (murmur2 of the
    key, positive, modulo the topic's partition count; what the Java client and aiokafka's
    default partitioner do), hashed once per distinct key; keyless records of one publish
    stick to one partition chosen at random among those with a leader (Kafka's sticky
    partitioner), so they fill one batch."""

    _MAX_KEYS = 100_000

    def __init__(self) -> None:
        self._hashes: dict[bytes, int] = {}
        self._sticky: dict[str, int] = {}
        self._counts: dict[str, int] = {}  # partitions per topic, read once per publish

    def choose(self, producer: AIOKafkaProducer, topic: str, key: bytes | None) -> int | None:
        """The record's partition; None when the producer's metadata no longer knows the
        topic (deleted since the publish checked it: aiokafka refreshes the metadata when a
        send meets a missing partition)."""
        if key is None:
            partition = self._sticky.get(topic)
            if partition is None:
                cluster = producer.client.cluster
                available = cluster.available_partitions_for_topic(topic)
                known = available or cluster.partitions_for_topic(topic)
                if not known:
                    return None
                partition = random.choice(sorted(known))
                self._sticky[topic] = partition
            return partition
        h = self._hashes.get(key)
        if h is None:
            if len(self._hashes) >= self._MAX_KEYS:
                self._hashes.clear()
            h = self._hashes[key] = murmur2(key) & 0x7FFFFFFF
        count = self._counts.get(topic)
        if count is None:
            known = producer.client.cluster.partitions_for_topic(topic)
            if not known:
                return None
            count = self._counts[topic] = len(known)
        return h % count

    def next_publish(self) -> None:
        """A new publish reads the partition counts again, and picks new sticky partitions
        for keyless records."""
        self._sticky.clear()
        self._counts.clear()
