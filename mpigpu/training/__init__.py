"""Training helpers on top of the public calls: the gradient averagers, parameter and optimizer-state
broadcast, compression, bucket packing and the PyTorch integration."""
