"""Kafka: the publisher's port, its aiokafka adapter, and how a row becomes a record."""
