"""The gateway: the user-facing edge (OpenAI-compatible HTTP and gRPC), API keys, routing to
rollout replicas, the traffic fork to TRAFFIC and feedback intake to FEEDBACK."""
