"""The repository's own tooling, not shipped: the docs site's generated references and hooks
(``docgen``, ``mkdocs_hooks``), the schema as truth (``schema``: ``sql/schema.sql`` from the
migrations) and the Kubernetes kit's checks (``k8s``). The local services the tests run on are
``devstack``'s."""
