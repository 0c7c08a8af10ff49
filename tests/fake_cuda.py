"""A test-only CUDA device on a CPU-only torch: tensors that report ``cuda:0`` while their data stays on the CPU.

The class of bug it catches: code that mixes a host tensor with an accelerator tensor the way CUDA refuses (a host
accumulator ``+=`` a device sum, a host ``arange`` times device values, a host target in ``searchsorted`` on device
values). The meta device does not catch it (a CPU 0-d tensor ``+=`` a meta 0-d tensor succeeds) and
``FakeTensorMode`` cannot run data-dependent code (``.item()``, ``int()``); this shim runs the real CPU kernels and
only checks devices, so every number is the CPU number.

What it enforces, as CUDA does (torch's TensorIterator and indexing rules):

- an op that takes a fake-CUDA tensor may take CPU tensors only as 0-d inputs (CPU scalars); a CPU tensor with
  dimensions, or a CPU tensor the op writes (``cpu_acc += cuda_scalar``, ``out=cpu``), raises torch's "Expected all
  tensors to be on the same device" error;
- no autograd: a CPU-only torch aborts the process when autograd records an op on a CUDA leaf that requires grad,
  so the fake device runs with grad disabled (inference and measurement code, not training);
- allowed mixes: ``copy_`` between devices, ``.to()`` / ``.cuda()`` / ``.cpu()``, indexing a device tensor with CPU
  index tensors, host reads (``.item()``, ``.tolist()``, ``float()``, ``int()``).

:class:`FakeCuda` (a ``TorchFunctionMode``) maps ``device="cuda"`` factories, ``.to("cuda")`` and ``.cuda()`` onto
:class:`FakeCudaTensor`; :func:`fake_cuda` also patches ``torch.cuda.is_available``, ``device_count``,
``_lazy_init``, the CUDA RNG state functions and a few queries, so that code that asks whether CUDA is there takes
its CUDA path. Use the ``fake_cuda`` fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
_MISMATCH = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"

aten = torch.ops.aten
#: ops that move data between devices, or read a device tensor on the host
_CROSS_DEVICE = {
    aten.copy_.default,
    aten._to_copy.default,
    aten._local_scalar_dense.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
}
#: indexing ops: their index tensors may live on the CPU (CUDA moves them)
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


#: factories that take their device from a tensor argument
_LIKE = {
    *(f"{kind}_like" for kind in ("zeros", "ones", "empty", "full", "rand", "randn", "randint")),
    *(f"new_{kind}" for kind in ("zeros", "ones", "empty", "full", "tensor", "empty_strided")),
}


#: methods that read a device tensor on the host
_HOST_READS = {"__float__", "__int__", "__bool__", "__index__", "item", "tolist", "__len__", "__format__"}
#: dtype casts by method name (their bindings take a device guard)
_CASTS = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "long": torch.int64,
    "int": torch.int32,
    "short": torch.int16,
    "bool": torch.bool,
    "byte": torch.uint8,
}


class FakeCudaTensor(torch.Tensor):
    """A tensor on ``cuda:0`` whose values live in a CPU tensor (``_data``)."""

    _data: torch.Tensor
    #: fake-CUDA tensors created so far (tests check that a path really ran on the device)
    created = 0
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> FakeCudaTensor:
        assert not isinstance(data, FakeCudaTensor) and data.device.type == "cpu"
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=CUDA,
            requires_grad=False,
        )
        out._data = data
        FakeCudaTensor.created += 1
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"FakeCudaTensor({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        cpu = [t for t in tensors if not isinstance(t, FakeCudaTensor) and t.device.type == "cpu"]
        if func not in _CROSS_DEVICE and cpu:
            _check_mix(func, args, kwargs, cpu)
        inner = tree_map(lambda t: t._data if isinstance(t, FakeCudaTensor) else t, (args, kwargs))
        out = func(*inner[0], **inner[1])
        if func is aten._local_scalar_dense.default:
            return out
        # results that alias an input (in-place ops, out=) are that input, wrapper and all
        owners = {id(t._data): t for t in tensors if isinstance(t, FakeCudaTensor)}
        owners.update({id(t): t for t in cpu})
        to_cpu = func is aten._to_copy.default and _is_cpu(kwargs.get("device"))
        target = kwargs.get("device")
        if target is not None and func is not aten._to_copy.default:
            to_cpu = _is_cpu(target)

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in owners:
                return owners[id(t)]
            return t if to_cpu else FakeCudaTensor(t)

        return return_and_correct_aliasing(func, args, kwargs, tree_map(wrap, out))


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str | torch.device):
        return torch.device(device).type == "cuda"
    return False


def _check_mix(func: Any, args: tuple, kwargs: dict, cpu: list[torch.Tensor]) -> None:
    """Raise as CUDA does for an op that mixes fake-CUDA tensors with the CPU tensors ``cpu``."""
    written: set[int] = set()
    schema = func._schema
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    written.add(id(t))
    indices: set[int] = set()
    if func in _INDEXING:
        value = args[1] if len(args) > 1 else kwargs.get("indices")
        indices = {id(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}
    for t in cpu:
        if id(t) in indices and id(t) not in written:
            continue
        if id(t) in written or t.dim() > 0:
            raise RuntimeError(f"{_MISMATCH} (fake CUDA: {func} with a CPU tensor of shape {list(t.shape)})")


def _unwrap(value: Any) -> Any:
    return tree_map(lambda t: t._data if isinstance(t, FakeCudaTensor) else t, value)


def to_fake(tensor: torch.Tensor) -> torch.Tensor:
    """A fake-CUDA copy of a CPU tensor (a fake-CUDA tensor is returned as it is)."""
    if isinstance(tensor, FakeCudaTensor):
        return tensor
    with torch._C.DisableTorchFunctionSubclass():
        data = tensor.detach().clone()
    return FakeCudaTensor(data)


class FakeCuda(TorchFunctionMode):
    """Maps ``device="cuda"`` factories, ``.to("cuda")``, ``.cuda()`` and pinned memory onto :class:`FakeCudaTensor`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            source = args[0]
            if func is torch.Tensor.cuda:
                device, dtype = CUDA, None
            else:
                options = {k: v for k, v in kwargs.items() if k not in ("copy", "non_blocking")}
                device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **options)
            copy = bool(kwargs.get("copy", False))
            if _is_cuda(device) or (device is None and isinstance(source, FakeCudaTensor)):
                if isinstance(source, FakeCudaTensor):  # torch's binding would take a CUDA device guard
                    if dtype in (None, source.dtype) and not copy:
                        return source
                    return FakeCudaTensor(source._data.to(dtype or source.dtype, copy=True))
                return to_fake(source.to(dtype or source.dtype))
            if isinstance(source, FakeCudaTensor):
                return source._data.to(dtype or source.dtype, copy=True)
            return func(*args, **kwargs)
        if isinstance(args[0] if args else None, FakeCudaTensor):
            source = args[0]
            if func is torch.Tensor.cpu:
                return source._data.clone()
            name = getattr(func, "__name__", "")
            if name in _HOST_READS:  # a host read of the value (legal; the binding takes a device guard)
                return getattr(source._data, name)(*args[1:], **kwargs)
            dtype = _CASTS.get(getattr(func, "__name__", ""))
            if dtype is not None:
                return source if source.dtype == dtype else FakeCudaTensor(source._data.to(dtype))
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and isinstance(args[0], FakeCudaTensor):
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
                "memory first."
            )
        if func is torch.Tensor.__getitem__ and isinstance(args[0], FakeCudaTensor):
            # torch's C++ indexing takes a CUDA device guard, which a CPU-only torch cannot: index the data here
            # (CPU index tensors are legal: CUDA moves them to the indexed tensor's device)
            return FakeCudaTensor(args[0]._data[_unwrap(args[1])])
        if func is torch.Tensor.__setitem__ and isinstance(args[0], FakeCudaTensor):
            value = args[2]
            if type(value) is torch.Tensor and value.dim() > 0:
                raise RuntimeError(f"{_MISMATCH} (fake CUDA: assigning a CPU tensor of shape {list(value.shape)})")
            with torch.no_grad():
                args[0]._data[_unwrap(args[1])] = _unwrap(value)
            return None
        if func is torch.Tensor.untyped_storage and isinstance(args[0], FakeCudaTensor):
            # a wrapper has no storage of its own: its data's (tensors that share memory on CUDA share it here too,
            # so code that keys tied weights by ``data_ptr()`` sees what it sees on CUDA)
            return args[0]._data.untyped_storage()
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.is_pinned:
            return False
        kwargs.pop("pin_memory", None)
        if getattr(func, "__name__", "") in _LIKE and isinstance(args[0], FakeCudaTensor) and "device" not in kwargs:
            kwargs["device"] = CUDA  # torch's bindings would take a CUDA device guard for the new tensor
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            return tree_map(lambda t: to_fake(t) if type(t) is torch.Tensor else t, out)
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:
            if "not linked with support for cuda" not in str(error):
                raise
            source = args[0] if args else None
            if not isinstance(source, FakeCudaTensor):
                raise NotImplementedError(f"fake CUDA: {func} needs a CUDA device guard (teach the shim)") from error
        # a Tensor method whose binding takes a CUDA device guard: run it on the data (results that are the data
        # itself, e.g. in-place methods, are the source; views of the data stay views of it)
        return tree_map(lambda t: _rewrap(t, source), func(*_unwrap(args), **_unwrap(kwargs)))


def _rewrap(value: Any, source: FakeCudaTensor) -> Any:
    if type(value) is not torch.Tensor:
        return value
    return source if value is source._data else FakeCudaTensor(value)


class _FakeRng:
    """The fake device's RNG state (a CPU generator), behind ``torch.cuda``'s RNG functions."""

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.generator.set_state(state.cpu() if isinstance(state, FakeCudaTensor) else state)

    def manual_seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))


@contextmanager
def fake_cuda_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """Run the body with the fake CUDA device: the mode active and ``torch.cuda`` patched (restored after).

    Args:
        monkeypatch: The test's monkeypatch (undoes the patches).

    Returns:
        The active mode.
    """
    rng = _FakeRng()
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "_lazy_init": lambda: None,
        "is_initialized": lambda: True,
        "current_device": lambda: 0,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "is_bf16_supported": lambda including_emulation=True: True,
        "get_device_name": lambda device=None: "fake CUDA (CPU data)",
        "mem_get_info": lambda device=None: (64 * 2**30, 80 * 2**30),
        "get_rng_state": rng.get_rng_state,
        "set_rng_state": rng.set_rng_state,
        "get_rng_state_all": lambda: [rng.get_rng_state()],
        "set_rng_state_all": lambda states: rng.set_rng_state(states[0]),
        "manual_seed": rng.manual_seed,
        "manual_seed_all": rng.manual_seed,
    }
    for name, value in patches.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda.random, "manual_seed_all", rng.manual_seed, raising=False)
    # Module.to("cuda") must replace each parameter (``param.data = fake`` would strip the fake's dispatch)
    compatible = torch._has_compatible_shallow_copy_type
    monkeypatch.setattr(
        torch,
        "_has_compatible_shallow_copy_type",
        lambda a, b: compatible(a, b) and not isinstance(a, FakeCudaTensor) and not isinstance(b, FakeCudaTensor),
    )
    monkeypatch.setattr(torch.nn.Module, "_apply", _apply_keeping_ties(torch.nn.Module._apply))
    with torch.no_grad(), FakeCuda() as mode:
        yield mode


def _apply_keeping_ties(apply: Any) -> Any:
    """``Module._apply`` that keeps shared parameters shared: replacing each parameter (see above) would give the two
    places of a tied weight (embeddings and ``lm_head``) two new parameters, where CUDA's ``param.data = ...`` keeps
    the one."""

    def _apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
        places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for module in self.modules() if recurse else [self]:
            for name, param in module._parameters.items():
                if param is not None:
                    places.setdefault(id(param), []).append((module, name))
        out = apply(self, fn, recurse)
        for shared in places.values():
            first = shared[0][0]._parameters[shared[0][1]]
            for module, name in shared[1:]:
                module._parameters[name] = first
        return out

    return _apply
