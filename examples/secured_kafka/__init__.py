"""A relay against a secured Kafka (docs/operations/secured-kafka.md): the settings of each
way in, as environment files (``scram.env``, ``mtls.env``, ``oauth.env``; secrets are read
from files, as Kubernetes mounts them), and an OAUTHBEARER token provider for an OpenID
Connect identity provider (``oidc_token.py``, client-credentials grant).

Use one with ``env $(grep -v '^#' examples/secured_kafka/scram.env | xargs) python -m
notify_outbox run`` (or as a Kubernetes ConfigMap beside the Secret it names)."""
