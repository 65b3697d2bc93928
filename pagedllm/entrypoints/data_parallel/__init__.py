"""Data parallelism: engine replicas in their own processes or on other nodes
(:mod:`replica`, :mod:`replica_nodes`), started and watched by :mod:`replica_group`, and
the client the API server talks to as to one engine (:mod:`replica_client`), over the
authenticated connections of :mod:`connections`. It sits with the serving layer: a
replica runs an engine and the server's metrics, and the API server starts the replicas."""
