"""Expert parallel over the local devices, on JAX's own mesh and `shard_map`.

A one-axis mesh (`AXIS`) of n devices: each device holds a contiguous share of every MoE
layer's routed experts (the stack [E, ...] split along E, padded with zero experts to a multiple
of n); everything else (dense weights, KV cache, tokens) is replicated. A layer's routed outputs
are computed on every device for the experts it owns, with the same kernel as on one device
(ids of experts it does not own become -1, which gives zero rows), and summed over the devices
with `psum` of y [N, K, D]: each (row, k) has one non-zero term, so the sum is bitwise the
one-device result. (Summing the combined [N, D] instead would round differently.)

The mesh is chosen once per process, before the first forward is traced (`use_devices`), and
read at trace time (`mesh`): programs traced under one mesh are never run under another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "expert"
_mesh: jax.sharding.Mesh | None = None


def automatic(local: list) -> int:
    """How many devices `DEVICES=0` (the default) means: every local accelerator; one CPU
    device (simulated CPU devices share the same cores: spreading over them speeds nothing)."""
    return 1 if not local or local[0].platform == "cpu" else len(local)


def use_devices(n: int | None) -> jax.sharding.Mesh | None:
    """Spread the experts over the first n local devices (0: `automatic`; None or 1: one
    device, no mesh); with several processes (`jax.distributed`), over the first n devices of
    each of them. On the CPU, n devices exist only when XLA was asked for them before JAX
    started (`XLA_FLAGS=--xla_force_host_platform_device_count=n` or `jax_num_cpu_devices`)."""
    global _mesh
    local = jax.local_devices()
    if n == 0:
        n = automatic(local)
    if jax.process_count() > 1:  # every process's first n devices (`engine.lockstep`)
        n = n or 1
        if n > len(local):
            raise ValueError(f"DEVICES={n}: only {len(local)} local device(s)")
        every = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mine = [[d for d in every if d.process_index == p][:n] for p in range(jax.process_count())]
        _mesh = jax.sharding.Mesh(np.array([d for p in mine for d in p]), (AXIS,))
        return _mesh
    if n is None or n <= 1:
        _mesh = None
        return None
    if n > len(local):
        hint = (
            "; on the CPU, set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{n} to simulate them"
            if local[0].platform == "cpu"
            else ""
        )
        raise ValueError(f"DEVICES={n}: only {len(local)} local device(s){hint}")
    _mesh = jax.sharding.Mesh(np.array(local[:n]), (AXIS,))
    return _mesh


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for n CPU devices (no effect on accelerators), so that DEVICES=n runs on a
    machine without n of them, as tests do: the CPU's cores shared among n devices, a way to
    check expert parallel, not to speed anything up. Only before JAX has started its backends;
    afterwards (or with n of 1) nothing changes."""
    if n <= 1 or jax.config.jax_num_cpu_devices >= n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already up: use_devices names the way out
        pass


def mesh() -> jax.sharding.Mesh | None:
    """The expert mesh of this process, or None on one device."""
    return _mesh


def devices() -> list:
    """The devices the experts are spread over (one when there is no mesh)."""
    return list(_mesh.devices.flat) if _mesh is not None else jax.local_devices()[:1]


def share(num_experts: int) -> int:
    """Experts a device owns: E over the devices, rounded up."""
    n = len(devices())
    return -(-num_experts // n)


def owner(expert: int, num_experts: int) -> int:
    """The index (in `devices()`) of the device that owns `expert`."""
    return expert // share(num_experts)


def replicated(tree):
    """`tree` on every device of the mesh (one device: as `jax.device_put` puts it)."""
    if _mesh is None:
        return jax.device_put(tree)
    return jax.device_put(tree, NamedSharding(_mesh, P()))


def split_experts(stacks: dict) -> dict:
    """A layer's expert stacks {name: [E, ...]} split over the mesh along E, padded with zero
    experts to a multiple of the devices (never chosen: ids stay below E)."""
    if _mesh is None:
        return jax.device_put(stacks)
    n = _mesh.size
    out = {}
    for name, a in stacks.items():
        pad = -a.shape[0] % n
        if pad:
            a = np.concatenate([np.asarray(a), np.zeros((pad, *a.shape[1:]), a.dtype)])
        out[name] = jax.device_put(a, NamedSharding(_mesh, P(AXIS)))
    return out


def expert_outputs(compute, experts: dict, x: jax.Array, ids: jax.Array) -> jax.Array:
    """y [N, K, D] over experts split along the mesh: `compute(local_experts, x, local_ids)`
    on each device (ids it does not own as -1), then `psum` over the devices. Call inside a
    jitted program, with the mesh set."""
    m = _mesh

    def local(stacks, x, ids):
        n = stacks["gate"].shape[0]
        first = jax.lax.axis_index(AXIS) * n
        mine = (ids >= first) & (ids < first + n)
        return jax.lax.psum(compute(stacks, x, jnp.where(mine, ids - first, -1)), AXIS)

    specs = ({name: P(AXIS) for name in experts}, P(), P())
    # check_vma off: the kernel's FFI call and XLA's loops carry no varying-axis types.
    return jax.shard_map(local, mesh=m, in_specs=specs, out_specs=P(), check_vma=False)(
        experts, x, ids
    )
