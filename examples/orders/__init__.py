"""Orders: a service writes an order and its event in one transaction, the relay publishes it,
and a billing consumer turns each order into exactly one invoice with the inbox.

Run it with ``python -m examples.orders`` (or ``make example``).
"""
