"""The three ways a worker builds and applies an adapter version (services/rollout/worker_ext.py
drives them): `merged` (CPU: base + delta merged and packed into a new oneDNN handle),
`factored` (CPU: the load-time handle plus an unmerged low-rank term), `device` (CUDA and other
platforms with a real `weight`: base + delta written in place). `common` holds what they
share: the layer map, base weights, adapter reading and the merge math."""
