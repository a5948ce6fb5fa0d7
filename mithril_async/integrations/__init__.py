"""Bridges to other frameworks, one module each; import the one you need.

``torch_dcp`` (DCP planners), ``safetensors_file`` (safetensors in/out), ``hf_trainer``
(transformers ``TrainerCallback``), ``lightning`` (``CheckpointIO``), ``deepspeed``
(``CheckpointEngine``), ``torchtitan`` (a ``BaseCheckpointManager`` backend), ``orbax`` (JAX:
an Orbax ``CheckpointHandler`` and type handlers, for Orbax's own ``Checkpointer`` /
``CheckpointManager``). Nothing is imported here, so a missing
optional framework only matters to the module that needs it.
"""
