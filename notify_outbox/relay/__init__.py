"""The relay: listener, wake-ups, gate, claim, publish, write-back, in one task group.

``relay.py`` wires the steps; each other module is one step or one guard of the data path
(docs/concepts/data-path.md). ``notify_outbox.relay.Relay`` is the public face.
"""

from .relay import Relay

__all__ = ["Relay"]
