"""The control plane in the service process: submission checks, admission and reconciliation
(``scheduler``), and the runtime that owns the cluster connection and the loop (``runtime``)."""
