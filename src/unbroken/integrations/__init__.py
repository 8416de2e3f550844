"""The library inside the training frameworks users already run, keeping their code.

- :mod:`unbroken.integrations.hf`: Hugging Face ``Trainer`` (a callback, and a ``Trainer``
  that iterates a ``VolumeDataset`` through ``ub.DataLoader``); extra ``[hf]``.
- :mod:`unbroken.integrations.lightning`: PyTorch Lightning (a ``CheckpointIO`` plugin with
  the callback it needs) and Fabric; extra ``[lightning]``.

Each module imports its framework; this package imports none of them.
"""
