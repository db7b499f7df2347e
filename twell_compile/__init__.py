"""twell-compile: a torch.compile backend that runs ReLU FFNs sparse."""
