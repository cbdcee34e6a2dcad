"""A topic governed by a Schema Registry: producers checked before their commit, the relay
sending Avro in Confluent's wire format, a consumer decoding it. Run it with
``python -m examples.schema_registry``."""
