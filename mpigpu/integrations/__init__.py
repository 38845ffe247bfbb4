"""Framework integrations. ``mpigpu.integrations.torch``: average gradients during backward()."""
