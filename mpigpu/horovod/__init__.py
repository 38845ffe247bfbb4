"""Horovod's API on top of mpigpu: ``import mpigpu.horovod.torch as hvd`` runs a ``horovod.torch``
training script (docs/horovod.md says what is supported). Importing this package imports nothing else."""
