"""Run under torchrun (2 ranks, gloo): stage an FSDP2 model's DTensor state, save it with DCP.

Checks that staged values stay DTensors over host buffers with the same mesh and
placements, that training overlaps the copy, and that vanilla DCP saves and loads them.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.worker_exit import exit_after_checks
from unbroken.checkpoint.staging.stager import StateStager


def build(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def step(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()


def full(state):
    """Every DTensor gathered to a full tensor (a collective: all ranks call it in order)."""
    if isinstance(state, DTensor):
        return state.full_tensor()
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: full(v) for k, v in state.items()}
    return state


def same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")


def main(directory: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = build(mesh)
    step(model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    expected = full(state)

    stager = StateStager()
    staged = stager.stage(state)
    step(model, opt)  # overlaps the copy; step() waits for it
    staged.wait()
    for key, value in staged.state_dict["model"].items():
        source = model_sd[key]
        assert isinstance(value, DTensor), key
        assert value.device_mesh == source.device_mesh, key
        assert value.placements == source.placements, key
        assert value.shape == source.shape, key
        assert value.to_local().data_ptr() != source.to_local().data_ptr(), key
    same(expected, full(staged.state_dict))

    dcp.save(staged.state_dict, checkpoint_id=directory)
    staged.release()
    stager.close()

    fresh, fresh_opt = build(mesh)
    step(fresh, fresh_opt)  # optimizer state exists, then is overwritten by the load
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_opt)
    target = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    dcp.load(target, checkpoint_id=directory)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
    model_sd2, optim_sd2 = get_state_dict(fresh, fresh_opt)
    same(expected, full({"model": model_sd2, "optim": optim_sd2}))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else '-'} ok", flush=True)
    exit_after_checks()


if __name__ == "__main__":
    main(sys.argv[1])
