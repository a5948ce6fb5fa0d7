"""Loaded by every Python process of ``run_dcp_suite.sh`` (PYTHONPATH), spawned ranks too.

``MITHRIL_DCP_SUITE_MODE``:
  default      DCP's own planners (the control run)
  mithril      MithrilSavePlanner / MithrilLoadPlanner as DCP's DefaultSavePlanner /
               DefaultLoadPlanner (every name torch looks them up by)
  mithril-all  the same, with every tensor compressed (``raw_below=0``: no tensor stays a plain
               DCP item, however small)

In every mode the same two test-harness shims apply (the test files are newer than the
installed torch 2.13 wheel): ``HardwareClassification`` and ``_get_device_type`` where the
wheel's ``torch.testing._internal`` lacks them; and with ``MITHRIL_DCP_SUITE_CPU_RANKS=1``,
``skip_if_lt_x_gpu`` runs the test on CPU ranks (its own ``allow_cpu=True``) instead of
skipping it, so the GPU-gated resharding and e2e tests run on gloo, and a backend string
naming the CPU twice (``cpu:gloo,cpu:gloo``: the e2e tests' ``cpu:gloo,{device}:{backend}``
on a CPU device) is passed to ``init_process_group`` once.
"""

from __future__ import annotations

import os


def _shims() -> None:
    import enum
    import functools

    import torch
    import torch.testing._internal.common_utils as cu

    if not hasattr(cu, "HardwareClassification"):
        cu.HardwareClassification = enum.Enum(  # type: ignore[attr-defined]
            "HardwareClassification", "GENERIC ACCELERATOR")
    import torch.testing._internal.common_distributed as cd

    if os.environ.get("MITHRIL_DCP_SUITE_CPU_RANKS") == "1":
        orig = cd.skip_if_lt_x_gpu

        @functools.wraps(orig)
        def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = True):  # type: ignore[no-untyped-def]
            return orig(x, allow_cpu=allow_cpu)

        cd.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    import torch.testing._internal.distributed._tensor.common_dtensor as cdt

    if os.environ.get("MITHRIL_DCP_SUITE_CPU_RANKS") == "1":
        cdt.skip_if_lt_x_gpu = cd.skip_if_lt_x_gpu  # type: ignore[attr-defined]
    if os.environ.get("MITHRIL_DCP_SUITE_CPU_RANKS") == "1":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        orig_init = c10d.init_process_group

        @functools.wraps(orig_init)
        def init_process_group(backend=None, *args, **kwargs):  # type: ignore[no-untyped-def]
            # "cpu:gloo,{device}:{backend}" names cpu twice when the device is the CPU
            if isinstance(backend, str) and "," in backend:
                parts = list(dict.fromkeys(backend.split(",")))
                backend = ",".join(parts)
            return orig_init(backend, *args, **kwargs)

        c10d.init_process_group = init_process_group
        dist.init_process_group = init_process_group
    if not hasattr(cdt, "_get_device_type"):
        def _get_device_type(world_size: int) -> str:
            ok = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
            return "cuda" if ok else "cpu"

        cdt._get_device_type = _get_device_type  # type: ignore[attr-defined]


def _planners(mode: str) -> None:
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.default_planner as dp
    import torch.distributed.checkpoint.state_dict_loader as loader
    import torch.distributed.checkpoint.state_dict_saver as saver

    from mithril_async.integrations.torch_dcp import MithrilLoadPlanner, MithrilSavePlanner

    save_cls: type = MithrilSavePlanner
    if mode == "mithril-all":
        class MithrilSaveEverything(MithrilSavePlanner):
            def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                kwargs.setdefault("raw_below", 0)
                super().__init__(*args, **kwargs)

        save_cls = MithrilSaveEverything
    for mod in (dcp, dp, saver):
        mod.DefaultSavePlanner = save_cls  # type: ignore[attr-defined]
    for mod in (dcp, dp, loader):
        mod.DefaultLoadPlanner = MithrilLoadPlanner  # type: ignore[attr-defined]


_MODE = os.environ.get("MITHRIL_DCP_SUITE_MODE")
if _MODE:
    _shims()
    if _MODE in ("mithril", "mithril-all"):
        _planners(_MODE)
    elif _MODE != "default":
        raise SystemExit(f"MITHRIL_DCP_SUITE_MODE={_MODE!r}: default, mithril or mithril-all")
