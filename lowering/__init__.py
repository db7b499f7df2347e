"""TwELL ops: torch.library schemas, fake impls, autograd with the injected L1, device dispatch."""
