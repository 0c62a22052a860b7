"""services/common/rpc: gRPC plumbing every service shares: server and channel factories, health, the registry and pools, launch, metrics and tracing."""
