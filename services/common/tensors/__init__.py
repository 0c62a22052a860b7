"""services/common/tensors: Model and tensor code the torch services share: loading, regional compile, packing, fused log-probs, weights and their transports."""
